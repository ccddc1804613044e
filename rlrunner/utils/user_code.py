"""A user's own code named in the config: a Python file or an importable module, and a name in it.

    spec = parse_code_spec("my_reward.py:compute_score", "reward.function", base_dir=os.getcwd())  # in the driver
    function = load_object(spec)                     # in the process that runs it
    module = load_module(parse_code_spec("tools.py", "rollout.multi_turn.tools", os.getcwd(), named=False))

A spec is "path/to/file.py[:name]" or "package.module[:name]" (a file when it ends in .py or holds a slash; a relative
file is made absolute against the driver's working directory, and a module's import path gets that directory). It is
plain strings: the code is imported where it runs (a scoring or tool process, a rollout worker), never pickled from
the driver. Every error names the config key and is one line.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from rlrunner.errors import ConfigError, describe


class CodeLoadError(Exception):
    """The code cannot be loaded (its file is missing, does not import, lacks the name); one line naming the key."""


@dataclass(frozen=True)
class CodeSpec:
    key: str  # the config key it was given as: what messages name
    text: str  # as the user wrote it
    name: str | None = None  # the object's name in its file or module; None: the module itself
    path: str | None = None  # an absolute .py file, or
    module: str | None = None  # a module imported by name
    search_path: str | None = None  # a folder put on sys.path first (the driver's working directory, for modules)


def parse_code_spec(
    text: str, key: str, base_dir: str, default_name: str | None = None, named: bool = True
) -> CodeSpec:
    """`text` as a spec; with `named`, "target:name" (`default_name` when the name is left out, else it is required),
    without, a file or module alone. ConfigError (one line naming `key`) for any other form."""
    form = "'path/to/file.py:name' or 'package.module:name'" if named else "'path/to/file.py' or 'package.module'"
    if named and ":" in text:
        target, _, name = text.rpartition(":")
    elif named and default_name is not None:
        target, name = text, default_name
    elif named:
        raise ConfigError(f"{key} must be {form} (the name is needed), got '{text}'")
    else:
        target, name = text, None
    target = target.strip()
    if name is not None:
        name = name.strip()
    if not target or (name is not None and not name.isidentifier()):
        raise ConfigError(f"{key} must be {form}, got '{text}'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(os.path.join(base_dir, os.path.expanduser(target)))
        return CodeSpec(key, text, name, path=path)
    if not all(part.isidentifier() for part in target.split(".")):
        raise ConfigError(f"{key} must be {form}, got '{text}'")
    return CodeSpec(key, text, name, module=target, search_path=os.path.abspath(base_dir))


def where(spec: CodeSpec) -> str:
    """The file or module of `spec`, for messages."""
    return spec.path if spec.path is not None else f"module {spec.module}"


def load_module(spec: CodeSpec) -> ModuleType:
    """The file or module of `spec`, imported now; CodeLoadError (one line naming its key) when it cannot be."""
    if spec.path is not None:
        if not os.path.isfile(spec.path):
            raise CodeLoadError(f"{spec.key}: file not found: {spec.path}")
        module_name = f"rlrunner_user_{spec.key.replace('.', '_')}_{abs(hash(spec.path))}"
        try:
            # the file's folder first, so that it can import its own helper modules beside it
            sys.path.insert(0, os.path.dirname(spec.path))
            module_spec = importlib.util.spec_from_file_location(module_name, spec.path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module  # dataclasses and pickling look a module up by name
            module_spec.loader.exec_module(module)
        except BaseException as exc:  # noqa: BLE001 - anything the user's file raises (SystemExit included) is reported
            sys.modules.pop(module_name, None)
            raise CodeLoadError(f"{spec.key}: {spec.path} does not import: {describe(exc)}") from None
        return module
    try:
        if spec.search_path and spec.search_path not in sys.path:
            sys.path.append(spec.search_path)
        return importlib.import_module(spec.module)
    except BaseException as exc:  # noqa: BLE001
        raise CodeLoadError(f"{spec.key}: {where(spec)} does not import: {describe(exc)}") from None


def load_object(spec: CodeSpec) -> Any:
    """The callable `spec` names (a function or a class), imported now; CodeLoadError (one line) when it cannot be."""
    module = load_module(spec)
    found = getattr(module, spec.name, None)
    if found is None:
        raise CodeLoadError(f"{spec.key}: {where(spec)} has no '{spec.name}'")
    if not callable(found):
        raise CodeLoadError(f"{spec.key}: '{spec.name}' in {where(spec)} is not callable")
    return found
