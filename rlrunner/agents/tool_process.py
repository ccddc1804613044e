"""One tool process: loads a tools file or an environment class itself, then answers its rollout worker's calls.

    python -m rlrunner.agents.tool_process FD_IN FD_OUT PARENT_PID

The protocol is the process pool's (`rlrunner.utils.process_pool.serve`). The load payload is a dict: `kind`
("tools" or "env"), `spec` (the CodeSpec of `rollout.multi_turn.tools` or `.env`), `max_output_chars`, `describe` (the
driver's check: the tools' JSON schemas come back in the ready message) and `parser` (a user's parser, loaded only to
check it). Items, and what each answers:

    ("call", name, arguments)      a tool's output: (text cut to max_output_chars, the characters it had)
    ("reset", trajectory, record)  a new environment instance for the trajectory: its first observation (str or None)
    ("step", trajectory, text)     the instance's step on the assistant's text: (observation, done, reward or None)
    ("drop", trajectory)           the instance goes (its close() called if it has one)

An environment instance lives in the process that reset it: the worker pins a trajectory's items to one process. It
imports neither torch nor the rest of rlrunner, only what the tools or the environment need (and, to describe tools,
transformers' schema builder).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

from rlrunner.agents.tools import output_text, tool_functions, tool_schemas
from rlrunner.utils.process_pool import serve
from rlrunner.utils.user_code import CodeLoadError, load_module, load_object, where


def load(payload: dict) -> tuple[Callable[[Any], Any], dict]:
    spec, max_chars = payload["spec"], payload["max_output_chars"]
    if payload.get("parser") is not None:  # a user's parser runs in the rollout worker: loaded here to check it
        load_object(payload["parser"])
    if payload["kind"] == "tools":
        functions = tool_functions(load_module(spec), spec.key)
        info: dict[str, Any] = {"tools": list(functions)}
        if payload.get("describe"):
            info["schemas"] = tool_schemas(functions, spec.key)
        return _tool_handler(functions, max_chars), info
    environment = load_object(spec)
    if not inspect.isclass(environment) or not all(callable(getattr(environment, m, None)) for m in ("reset", "step")):
        raise CodeLoadError(f"{spec.key}: '{spec.name}' in {where(spec)} is not a class with reset() and step()")
    return _environment_handler(environment), {"env": spec.name}


def _tool_handler(functions: dict[str, Callable[..., Any]], max_chars: int) -> Callable[[Any], Any]:
    def handle(item: tuple) -> Any:
        kind, name, arguments = item
        if kind != "call":
            raise ValueError(f"a tools process got a {kind!r} item")
        if name not in functions:
            raise LookupError(f"unknown tool '{name}' (the tools are {', '.join(functions)})")
        return output_text(functions[name](**arguments), max_chars)

    return handle


def _environment_handler(environment: type) -> Callable[[Any], Any]:
    instances: dict[Any, Any] = {}

    def handle(item: tuple) -> Any:
        kind, trajectory, argument = item
        if kind == "reset":
            instances.pop(trajectory, None)
            instance = environment()
            observation = instance.reset(argument)
            instances[trajectory] = instance
            return _observation(observation, "reset")
        if kind == "drop":
            instance = instances.pop(trajectory, None)
            if instance is not None and callable(getattr(instance, "close", None)):
                instance.close()
            return None
        if kind != "step":
            raise ValueError(f"an environment process got a {kind!r} item")
        if trajectory not in instances:
            raise LookupError("the environment instance of this trajectory is not in this process")
        return _step_result(instances[trajectory].step(argument))

    return handle


def _observation(value: Any, where_from: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"{where_from}() returned {type(value).__name__}, not a string observation or None")


def _step_result(value: Any) -> tuple[str | None, bool, float | None]:
    if not isinstance(value, tuple) or len(value) not in (2, 3):
        raise TypeError("step() must return (observation, done) or (observation, done, reward)")
    observation, done = _observation(value[0], "step"), value[1]
    reward = value[2] if len(value) == 3 else None
    if reward is not None:
        try:
            reward = float(reward)
        except (TypeError, ValueError):
            raise TypeError(f"step() returned a reward of {type(reward).__name__}, not a number") from None
        if not math.isfinite(reward):
            raise ValueError(f"step() returned a reward of {reward}")
    return observation, bool(done), reward


if __name__ == "__main__":
    serve(load)
