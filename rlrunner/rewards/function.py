"""Which function scores, and what its result means: `reward.function` parsed, loaded and its results read.

    spec = parse_spec("my_reward.py:compute_score", base_dir=os.getcwd())   # in the driver: paths made absolute
    fn = load_object(spec)                                               # in a scoring process (utils.user_code)
    score, extras = read_result(fn(data_source, solution_str, ground_truth, extra_info))

A spec is "path/to/file.py[:name]" or "package.module[:name]" (name: `compute_score` when left out, as in verl). The
function is imported where rewards are scored, never pickled from the driver: a spec is plain strings
(`rlrunner.utils.user_code`, which a tools file or an environment is named with too).
"""

from __future__ import annotations

import math
import os
from typing import Any

from rlrunner.errors import ConfigError, first_line
from rlrunner.utils.user_code import CodeSpec, parse_code_spec

DEFAULT_NAME = "compute_score"
KEY = "reward.function"


def parse_spec(text: str, base_dir: str) -> CodeSpec:
    """`text` ("file.py[:name]" or "package.module[:name]") with a relative file made absolute against `base_dir`."""
    return parse_code_spec(text, KEY, base_dir, default_name=DEFAULT_NAME)


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


def builtin_spec(entry: str, label: str) -> CodeSpec:
    """A built-in verifier's "module:function" entry as a spec (named `label` in messages)."""
    module, _, name = entry.partition(":")
    return CodeSpec("reward.verifier", label, name, module=module)


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
