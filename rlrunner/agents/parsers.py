"""The model's text -> the tool calls it makes: `rollout.multi_turn.parser`.

    calls = parse_hermes('<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</tool_call>')
    # [ToolCall(name="multiply", arguments={"a": 3, "b": 4})]

A parser is a function from the text of one assistant turn to a list of calls, each `{"name": str, "arguments":
dict}`; `hermes` is built in (what Qwen2.5, Qwen3 and many others emit), and a user's own is named
"path/to/file.py:function" (or "package.module:function"). A call that cannot be read (bad JSON, no name, arguments
that are not an object) is kept as a `ToolCall` with its `error`: it is answered as a tool error, like an unknown tool
or wrong arguments. No call in a turn: the model is done.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

PARSERS: dict[str, str] = {"hermes": "rlrunner.agents.parsers:parse_hermes"}


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: dict | None
    error: str | None = None  # why the call cannot be made as written (a malformed call): a tool error

    def as_dict(self) -> dict[str, Any]:
        """As a trajectory records it (what a reward function reads)."""
        found: dict[str, Any] = {"name": self.name, "arguments": self.arguments}
        if self.error is not None:
            found["error"] = self.error
        return found


_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of `text`, in order (an unclosed last one is
    malformed)."""
    calls = []
    for match in _HERMES.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall(None, None, "malformed tool call: <tool_call> without </tool_call>"))
            continue
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall(None, None, f"malformed tool call: not JSON ({exc.msg} at character {exc.pos})"))
            continue
        calls.append(call_from(value))
    return calls


def call_from(value: Any) -> ToolCall:
    """One call from what a parser found: a mapping with a string `name` and an object `arguments` (or a JSON string
    of one, as some models write it; none: no arguments)."""
    if not isinstance(value, dict):
        return ToolCall(
            None, None, f"malformed tool call: {type(value).__name__}, not an object with name and arguments"
        )
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, "malformed tool call: no 'name'")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name, None, "malformed tool call: 'arguments' is a string but not JSON")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(name, None, f"malformed tool call: 'arguments' is {type(arguments).__name__}, not an object")
    return ToolCall(name, arguments)


def calls_of(parser: Callable[[str], Any], text: str) -> list[ToolCall]:
    """What `parser` finds in `text`, each entry read by `call_from`; a parser that raises or returns no list is one
    malformed call (a tool error the model is told about)."""
    try:
        found = parser(text)
    except Exception as exc:  # noqa: BLE001 - a user's parser may raise anything
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return [ToolCall(None, None, f"the tool-call parser raised {type(exc).__name__}: {message}".rstrip(": "))]
    if found is None:
        return []
    if not isinstance(found, (list, tuple)):
        return [ToolCall(None, None, f"the tool-call parser returned {type(found).__name__}, not a list of calls")]
    return [item if isinstance(item, ToolCall) else call_from(item) for item in found]
