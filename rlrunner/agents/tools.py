"""A tools file: every public function with type hints and a docstring is a tool (TRL's convention).

    functions = tool_functions(module)    # {name: function}, in the file's order
    schemas = tool_schemas(functions)     # the JSON schemas the chat template renders (`apply_chat_template(tools=)`)
    text, length = output_text(functions[name](**arguments), max_chars)

A tool's schema comes from its signature and its Google-style docstring (`transformers.utils.get_json_schema`: the
description, and one `Args:` line per parameter). Functions a tools file imports from elsewhere are not its tools.
"""

from __future__ import annotations

import inspect
import json
from types import ModuleType
from typing import Any, Callable

from rlrunner.utils.user_code import CodeLoadError


def tool_functions(module: ModuleType, key: str = "rollout.multi_turn.tools") -> dict[str, Callable[..., Any]]:
    """The module's tools: its own public functions whose parameters all have type hints and which have a docstring;
    CodeLoadError (one line naming `key`) when it has none."""
    found: dict[str, Callable[..., Any]] = {}
    for name, value in vars(module).items():
        if name.startswith("_") or not inspect.isfunction(value) or value.__module__ != module.__name__:
            continue
        parameters = inspect.signature(value).parameters.values()
        if inspect.getdoc(value) and all(p.annotation is not inspect.Parameter.empty for p in parameters):
            found[name] = value
    if not found:
        where = getattr(module, "__file__", None) or module.__name__
        raise CodeLoadError(f"{key}: {where} has no tools (public functions with type hints and a docstring)")
    return found


def tool_schemas(functions: dict[str, Callable[..., Any]], key: str = "rollout.multi_turn.tools") -> list[dict]:
    """Each tool's JSON schema, in order; CodeLoadError naming the tool whose docstring or hints do not describe it."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, function in functions.items():
        try:
            schemas.append(get_json_schema(function))
        except Exception as exc:  # transformers raises its own types for undescribed arguments and unknown hints
            line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CodeLoadError(f"{key}: tool '{name}' cannot be described: {line}") from None
    return schemas


def output_text(value: Any, max_chars: int) -> tuple[str, int]:
    """A tool's return value as the text of its message, and how many characters it had: a string as it is, anything
    else as JSON (or its str()), cut to its first `max_chars` characters (a tool that returns a megabyte costs no more
    than the cut; the rollout worker cuts it to `rollout.multi_turn.max_tool_output_tokens` and says so)."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(value)
    return text[:max_chars], len(text)


def cut_note(kept_tokens: int, total_chars: int) -> str:
    """What a cut tool message ends with."""
    return f"\n[output cut to {kept_tokens} tokens: the tool returned {total_chars} characters]"
