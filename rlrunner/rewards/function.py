"""Which function scores, and what its result means: `reward.function` parsed, loaded and its results read.

    spec = parse_spec("my_reward.py:compute_score", base_dir=os.getcwd())   # in the driver: paths made absolute
    fn = load_function(spec)                                             # in a scoring process
    score, extras = read_result(fn(data_source, solution_str, ground_truth, extra_info))

A spec is "path/to/file.py[:name]" or "package.module[:name]" (name: `compute_score` when left out, as in verl). The
function is imported where rewards are scored, never pickled from the driver: a spec is plain strings.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from rlrunner.errors import ConfigError, first_line

DEFAULT_NAME = "compute_score"


class RewardLoadError(Exception):
    """The reward function cannot be loaded (its file is missing, does not import, lacks the name); one line."""


@dataclass(frozen=True)
class RewardFunctionSpec:
    text: str  # as the user wrote it: what messages name
    name: str  # the function's name in its file or module
    path: str | None = None  # an absolute .py file, or
    module: str | None = None  # a module imported by name
    search_path: str | None = None  # a folder put on sys.path first (the driver's working directory, for modules)


def parse_spec(text: str, base_dir: str) -> RewardFunctionSpec:
    """`text` ("file.py[:name]" or "package.module[:name]") with a relative file made absolute against `base_dir`."""
    target, _, name = text.rpartition(":") if ":" in text else (text, "", DEFAULT_NAME)
    target, name = target.strip(), name.strip()
    if not target or not name.isidentifier():
        raise ConfigError(f"reward.function must be 'path/to/file.py:name' or 'package.module:name', got '{text}'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = os.path.abspath(os.path.join(base_dir, os.path.expanduser(target)))
        return RewardFunctionSpec(text, name, path=path)
    if not all(part.isidentifier() for part in target.split(".")):
        raise ConfigError(f"reward.function must be 'path/to/file.py:name' or 'package.module:name', got '{text}'")
    return RewardFunctionSpec(text, name, module=target, search_path=os.path.abspath(base_dir))


def check_reward_config(reward: Any) -> None:
    """ConfigError naming the first `reward.*` key whose value cannot work (the function's form only: it is loaded by
    the driver's start-up checks)."""
    from rlrunner.rewards import BUILTIN_VERIFIERS

    if reward.verifier is not None and reward.verifier not in BUILTIN_VERIFIERS:
        raise ConfigError(
            f"reward.verifier must be one of {', '.join(sorted(BUILTIN_VERIFIERS))} or null, got '{reward.verifier}'"
        )
    if reward.function is not None:
        parse_spec(reward.function, os.getcwd())
    if reward.num_workers < 1:
        raise ConfigError(f"reward.num_workers must be >= 1, got {reward.num_workers}")
    if reward.timeout_s <= 0:
        raise ConfigError(f"reward.timeout_s must be positive, got {reward.timeout_s}")
    if reward.on_error not in ("raise", "zero"):
        raise ConfigError(f"reward.on_error must be 'raise' or 'zero', got '{reward.on_error}'")


def builtin_spec(entry: str, label: str) -> RewardFunctionSpec:
    """A built-in verifier's "module:function" entry as a spec (named `label` in messages)."""
    module, _, name = entry.partition(":")
    return RewardFunctionSpec(label, name, module=module)


def load_function(spec: RewardFunctionSpec) -> Callable[..., Any]:
    """The function `spec` names, imported now; RewardLoadError (one line naming it) when it cannot be."""
    if spec.path is not None:
        if not os.path.isfile(spec.path):
            raise RewardLoadError(f"reward.function: file not found: {spec.path}")
        module_name = f"rlrunner_user_reward_{abs(hash(spec.path))}"
        where = spec.path
        try:
            # the file's folder first, so that it can import its own helper modules beside it
            sys.path.insert(0, os.path.dirname(spec.path))
            module_spec = importlib.util.spec_from_file_location(module_name, spec.path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module  # dataclasses and pickling look a module up by name
            module_spec.loader.exec_module(module)
        except BaseException as exc:  # noqa: BLE001 - anything the user's file raises (SystemExit included) is reported
            sys.modules.pop(module_name, None)
            raise RewardLoadError(f"reward.function: {where} does not import: {_describe(exc)}") from None
    else:
        where = f"module {spec.module}"
        try:
            if spec.search_path and spec.search_path not in sys.path:
                sys.path.append(spec.search_path)
            module = importlib.import_module(spec.module)
        except BaseException as exc:  # noqa: BLE001
            raise RewardLoadError(f"reward.function: {where} does not import: {_describe(exc)}") from None
    function = getattr(module, spec.name, None)
    if function is None:
        raise RewardLoadError(f"reward.function: {where} has no '{spec.name}'")
    if not callable(function):
        raise RewardLoadError(f"reward.function: '{spec.name}' in {where} is not callable")
    return function


def read_result(value: Any) -> tuple[float, dict[str, float]]:
    """(the reward, the other numeric keys) of what a reward function returned: a number, or a dict with `score`.
    ValueError (one line) for anything else, or a score that is not a finite number."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score' (keys: {', '.join(map(str, value)) or 'none'})")
        for key, item in value.items():
            if key != "score" and _is_number(item):
                extras[str(key)] = float(item)
        value = value["score"]
    if not _is_number(value):
        raise ValueError(
            f"returned {type(value).__name__} {first_line(repr(value))[:60]}, not a number or a dict with 'score'"
        )
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned a score of {score}")
    return score, extras


def _is_number(value: Any) -> bool:
    if isinstance(value, (bool, int, float)):
        return True
    # numpy and torch scalars (a reward written with either) convert with float()
    return hasattr(value, "__float__") and getattr(value, "ndim", 0) == 0 and not isinstance(value, (str, bytes))


def _describe(exc: BaseException) -> str:
    line = first_line(exc)
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__
