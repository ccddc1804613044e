"""`rollout.multi_turn.*`: checked, resolved into what the rollout workers get, and its code loaded once by the driver.

    check_multi_turn_config(cfg)                 # config_checks: every value, no code loaded
    settings = multi_turn_settings(cfg, base_dir)  # None when neither tools nor an environment is set
    settings = described(settings)               # the driver, before Ray starts: the tools file (or environment) and a
                                                 # user's parser loaded in a tool process; the tools' names and schemas

A run is multi-turn when `rollout.multi_turn.tools` or `rollout.multi_turn.env` is set (not both: tools are one
environment). The settings are plain values: the workers' tool processes import the code themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable

from rlrunner.agents.parsers import PARSERS
from rlrunner.errors import ConfigError
from rlrunner.utils.process_pool import PoolLabels, ProcessPool
from rlrunner.utils.registry import import_attr
from rlrunner.utils.user_code import CodeLoadError, CodeSpec, load_object, parse_code_spec

KEY = "rollout.multi_turn"
TOOL_PROCESS = "rlrunner.agents.tool_process"
CHARS_PER_TOKEN = 32  # a tool's output is cut to this many characters per allowed token before it is tokenized
ON_TOOL_ERROR = ("feedback", "terminate")


@dataclass(frozen=True)
class MultiTurnSettings:
    tools: CodeSpec | None  # the tools file, or
    env: CodeSpec | None  # an environment class
    parser: str | CodeSpec  # a name in PARSERS, or a user's parser
    max_turns: int
    max_response_tokens: int
    max_tool_output_tokens: int
    tool_timeout_s: float
    on_tool_error: str
    num_workers: int
    tool_names: tuple[str, ...] = ()  # once `described`
    schemas: tuple[dict, ...] = ()  # the tools' JSON schemas, once `described`

    @property
    def code(self) -> CodeSpec:
        return self.tools if self.tools is not None else self.env  # type: ignore[return-value]

    def pool(self, describe: bool = False, num_workers: int | None = None) -> ProcessPool:
        """Tool processes (`num_workers`, else `rollout.multi_turn.num_workers`) loading the tools or the
        environment."""
        payload = {
            "kind": "tools" if self.tools is not None else "env",
            "spec": self.code,
            "max_output_chars": self.max_tool_output_tokens * CHARS_PER_TOKEN,
            "describe": describe,
            "parser": self.parser if isinstance(self.parser, CodeSpec) else None,
        }
        labels = PoolLabels(self.code.key, self.code.text, "tool process", f"{KEY}.tool_timeout_s")
        return ProcessPool(TOOL_PROCESS, payload, labels, num_workers or self.num_workers, self.tool_timeout_s)

    def load_parser(self) -> Callable[[str], Any]:
        """The parser, imported now (a user's: CodeLoadError naming the key when it cannot be)."""
        if isinstance(self.parser, CodeSpec):
            return load_object(self.parser)
        return import_attr(PARSERS[self.parser])


def check_multi_turn_config(cfg: Any) -> None:
    """ConfigError naming the first `rollout.multi_turn.*` key whose value cannot work (no code is loaded)."""
    options = cfg.rollout.multi_turn
    if options.tools is not None and options.env is not None:
        raise ConfigError(
            f"{KEY}.tools and {KEY}.env are both set: tools are an environment of their own, set one of them"
        )
    for key in ("max_turns", "max_tool_output_tokens", "num_workers"):
        if options[key] < 1:
            raise ConfigError(f"{KEY}.{key} must be >= 1, got {options[key]}")
    if options.max_response_tokens is not None and options.max_response_tokens < 1:
        raise ConfigError(f"{KEY}.max_response_tokens must be >= 1 or null, got {options.max_response_tokens}")
    if options.tool_timeout_s <= 0:
        raise ConfigError(f"{KEY}.tool_timeout_s must be positive, got {options.tool_timeout_s}")
    if options.on_tool_error not in ON_TOOL_ERROR:
        raise ConfigError(f"{KEY}.on_tool_error must be 'feedback' or 'terminate', got '{options.on_tool_error}'")
    multi_turn_settings(cfg, os.getcwd())  # the forms of the specs


def max_response_tokens(rollout_cfg: Any) -> int:
    """A trajectory's tokens after its prompt, all turns and what answered them together: `max_response_tokens`, else
    `max_turns` x (`rollout.max_new_tokens` + `max_tool_output_tokens`)."""
    options = rollout_cfg["multi_turn"]
    if options["max_response_tokens"] is not None:
        return int(options["max_response_tokens"])
    return int(options["max_turns"] * (rollout_cfg["max_new_tokens"] + options["max_tool_output_tokens"]))


def is_multi_turn(rollout_cfg: Any) -> bool:
    options = rollout_cfg["multi_turn"]
    return options["tools"] is not None or options["env"] is not None


def multi_turn_settings(cfg: Any, base_dir: str) -> MultiTurnSettings | None:
    """The run's settings (None: single-turn), with relative files made absolute against `base_dir` (the driver's
    working directory)."""
    options = cfg.rollout.multi_turn
    if not is_multi_turn(cfg.rollout):
        return None
    tools = None if options.tools is None else parse_code_spec(options.tools, f"{KEY}.tools", base_dir, named=False)
    env = None if options.env is None else parse_code_spec(options.env, f"{KEY}.env", base_dir)
    parser: str | CodeSpec = options.parser
    if options.parser not in PARSERS:
        if ":" not in options.parser:
            raise ConfigError(
                f"{KEY}.parser must be one of {', '.join(PARSERS)} or 'path/to/file.py:function', "
                f"got '{options.parser}'"
            )
        parser = parse_code_spec(options.parser, f"{KEY}.parser", base_dir)
    return MultiTurnSettings(
        tools=tools,
        env=env,
        parser=parser,
        max_turns=options.max_turns,
        max_response_tokens=max_response_tokens(cfg.rollout),
        max_tool_output_tokens=options.max_tool_output_tokens,
        tool_timeout_s=options.tool_timeout_s,
        on_tool_error=options.on_tool_error,
        num_workers=options.num_workers,
    )


def described(settings: MultiTurnSettings) -> MultiTurnSettings:
    """`settings` with the tools' names and JSON schemas, loaded in a tool process of its own (with a user's parser);
    ConfigError (one line, naming the key) when the tools file, the environment or the parser cannot be loaded. Asked
    once per process for the same files."""
    try:
        names, schemas = _describe(settings, _modified(settings.code), _modified(settings.parser))
    except CodeLoadError as exc:
        raise ConfigError(str(exc)) from None
    return dataclasses.replace(settings, tool_names=names, schemas=schemas)


def check_chat_template(tokenizer: Any, schemas: tuple[dict, ...]) -> None:
    """ConfigError (one line) unless the tokenizer's chat template can carry multi-turn trajectories token by token."""
    from rlrunner.agents.chat import ChatDeltas

    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"{KEY} needs a tokenizer with a chat template (the turns are its messages); this one has none"
        )
    try:
        ChatDeltas(tokenizer, schemas).check()
    except Exception as exc:  # a template's own error (jinja's, its raise_exception) or the append check's
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{KEY}: the chat template cannot carry the turns: {line}") from None


def _modified(spec: Any) -> float | None:
    """A spec's file's modification time (so that a changed file is described again)."""
    if isinstance(spec, CodeSpec) and spec.path is not None and os.path.isfile(spec.path):
        return os.path.getmtime(spec.path)
    return None


@functools.lru_cache(maxsize=16)
def _describe(settings: MultiTurnSettings, *modified: float | None) -> tuple[tuple[str, ...], tuple[dict, ...]]:
    pool = settings.pool(describe=True, num_workers=1)
    try:
        info = pool.ready()
    finally:
        pool.close()
    return tuple(info.get("tools", ())), tuple(info.get("schemas", ()))
