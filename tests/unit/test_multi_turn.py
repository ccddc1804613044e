"""Multi-turn rollouts without Ray: the turn loop (`rlrunner.rollout.multi_turn`) over real tool processes, with an
engine that answers from a script (what the model "says" is the test's to choose) and the call ledger in this process.
Token in and token out, the bounds, tools that fail in every way, an environment class, and calls made once."""

from __future__ import annotations

import dataclasses
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest
from chat_tokenizer import build_chat_tokenizer

from rlrunner.agents.environments import ToolEnvironments, UserEnvironments
from rlrunner.agents.settings import MultiTurnSettings, described
from rlrunner.models.loading import TokenIds
from rlrunner.rollout.base import Completion, RolloutEngine, Sampling
from rlrunner.rollout.call_records import LocalRecorder
from rlrunner.rollout.multi_turn import MultiTurnRollout, Trajectory
from rlrunner.utils.user_code import CodeSpec, parse_code_spec

TOOLS = '''
import os, time

def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    with open(os.environ["CALLS_FILE"], "a") as handle:
        handle.write(f"{a}*{b}\\n")
    return a * b

def trouble(kind: str) -> str:
    """Misbehave.

    Args:
        kind: how
    """
    if kind == "raise":
        raise ValueError("no such thing\\nsecond line")
    if kind == "hang":
        time.sleep(3600)
    if kind == "exit":
        os._exit(9)
    if kind == "huge":
        return "y" * 1_000_000
    return kind
'''

ENVIRONMENT = '''
import os

class Guess:
    """Guess the number: the first observation asks, each step says higher or lower, done on the number."""

    def reset(self, record):
        self.target = int(record["answer"])
        with open(os.environ["CALLS_FILE"], "a") as handle:
            handle.write(f"reset {record['index']} {record['sample']}\\n")
        return "guess"

    def step(self, text):
        with open(os.environ["CALLS_FILE"], "a") as handle:
            handle.write(f"step {text}\\n")
        guess = int(text)
        if guess == self.target:
            return None, True, 1.0
        return ("higher" if guess < self.target else "lower"), False
'''


class ScriptedEngine(RolloutEngine):
    """A rollout engine whose "model" says what `script(context text)` returns, followed by eos: every token it gives
    is kept, to be compared with the trajectory."""

    def __init__(self, tokenizer, script: Callable[[str], str]):
        super().__init__({}, {}, tokenizer, TokenIds(tokenizer.pad_token_id, (tokenizer.eos_token_id,)), 0, None, 512)
        self.script = script
        self.given: list[list[int]] = []  # every completion, in order

    def generate(self, chunks, sampling: Sampling) -> list[list[Completion]]:
        out = []
        for chunk in chunks:
            completions = []
            for request in chunk:
                text = self.script(self.tokenizer.decode(list(request.prompt_ids)))
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                ids = ids[: request.limit(sampling)]
                self.given.append(ids)
                completions.append(Completion(ids, [-0.25] * len(ids)))
            out.append(completions)
        return out

    def weight_sink(self):
        raise NotImplementedError


BOUNDS = dict(
    parser="hermes",
    max_turns=4,
    max_response_tokens=400,
    max_tool_output_tokens=40,
    tool_timeout_s=1.0,
    on_tool_error="feedback",
    num_workers=2,
)


@pytest.fixture(scope="module")
def described_tools(tmp_path_factory) -> MultiTurnSettings:
    """The tools file, described once for the module (its schemas cost a tool process importing transformers)."""
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(textwrap.dedent(TOOLS))
    spec = parse_code_spec(str(path), "rollout.multi_turn.tools", "/", named=False)
    return described(MultiTurnSettings(tools=spec, env=None, **BOUNDS))


def settings(tmp_path: Path, monkeypatch, base: MultiTurnSettings | None = None, **overrides) -> MultiTurnSettings:
    """`base` (the described tools; None: the Guess environment, written to `tmp_path`) with `overrides`; the calls a
    tool or the environment makes are appended to tmp_path/calls.txt."""
    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls.txt"))
    if base is None:
        path = tmp_path / "env.py"
        path.write_text(textwrap.dedent(overrides.pop("source", ENVIRONMENT)))
        env = parse_code_spec(f"{path}:Guess", "rollout.multi_turn.env", "/")
        base = described(MultiTurnSettings(tools=None, env=env, **BOUNDS))
    return dataclasses.replace(base, **overrides)


def rollout(found: MultiTurnSettings, script: Callable[[str], str]) -> MultiTurnRollout:
    tokenizer = build_chat_tokenizer()
    engine = ScriptedEngine(tokenizer, script)
    pool = found.pool()
    if found.tools is not None:
        environments = ToolEnvironments(pool, found, found.load_parser(), tokenizer)
    else:
        environments = UserEnvironments(pool, found)
    return MultiTurnRollout(engine, tokenizer, engine.token_ids, found, environments, seed=1)


def records(tokenizer, schemas, *questions: tuple[str, str]) -> list[dict]:
    out = []
    for index, (question, answer) in enumerate(questions):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tools=list(schemas), tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append({"index": index, "prompt_ids": ids, "answer": answer, "data_source": "t", "extra_info": {}})
    return out


def run(turns: MultiTurnRollout, prompts: list[dict], recorder=None, per_prompt: int = 1, chunk: int = 2):
    rows = [(record, j) for record in prompts for j in range(per_prompt)]
    chunks = [rows[i : i + chunk] for i in range(0, len(rows), chunk)]
    done: list[list[int]] = []
    sampling = Sampling(1.0, 1.0, 64)
    trajectories = turns.run(
        recorder or LocalRecorder(), "train", 3, chunks, 0, sampling, lambda ts: done.append([t.position for t in ts])
    )
    assert sorted(p for chunk_done in done for p in chunk_done) == list(range(len(rows)))  # every chunk scored once
    return trajectories


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def calls_made(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls.txt"
    return path.read_text().splitlines() if path.exists() else []


def answer_once(text: str) -> str:
    """Call multiply with the question's numbers, then answer with the tool's result."""
    if "<tool_response>" in text:
        return "It is " + text.split("<tool_response>\n")[-1].split("\n</tool_response>")[0]
    a, b = text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0].split("*")
    return call("multiply", a=int(a), b=int(b))


# --- token in, token out ------------------------------------------------------------------------------------------


def test_the_models_tokens_are_kept_as_sampled_and_only_they_are_trained_on(
    tmp_path, monkeypatch, described_tools
) -> None:
    found = settings(tmp_path, monkeypatch, described_tools)
    turns = rollout(found, answer_once)
    tokenizer = turns.tokenizer
    try:
        prompts = records(tokenizer, found.schemas, ("3*4", "12"), ("5*6", "30"))
        first, second = run(turns, prompts)
    finally:
        turns.environments.close()
    given = turns.engine.given  # one chunk: turn 1 of both trajectories, then turn 2 of both
    for trajectory in (first, second):
        model = [t for t, m in zip(trajectory.response, trajectory.mask) if m == 1]
        assert model == given[trajectory.position] + given[2 + trajectory.position]  # never re-encoded
        assert all(lp == -0.25 for lp, m in zip(trajectory.logprobs, trajectory.mask) if m == 1)
        assert all(lp == 0.0 for lp, m in zip(trajectory.logprobs, trajectory.mask) if m == 0)
    # what is not the model's is exactly the template's delta: the whole renders as the template renders it
    result = {"role": "tool", "name": "multiply", "content": "12"}
    conversation = [
        {"role": "user", "content": "3*4"},
        {"role": "assistant", "content": call("multiply", a=3, b=4)},
        result,
        {"role": "assistant", "content": "It is 12"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tools=list(found.schemas), tokenize=False)
    assert tokenizer.decode(first.prompt_ids + first.response) + "\n" == rendered
    assert first.turns == 2 and first.ended == "done" and first.texts == [call("multiply", a=3, b=4), "It is 12"]
    assert first.calls == [{"name": "multiply", "arguments": {"a": 3, "b": 4}, "output": "12", "error": None}]
    assert first.messages[1] == result
    assert sorted(calls_made(tmp_path)) == ["3*4", "5*6"]  # two tool processes: in any order


# --- bounds -------------------------------------------------------------------------------------------------------


def test_the_bounds_end_a_trajectory_and_say_which(tmp_path, monkeypatch, described_tools) -> None:
    def script(text: str) -> str:
        question = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        if question == "loop":  # calls forever
            return call("multiply", a=1, b=2)
        if question == "long":  # a turn longer than rollout.max_new_tokens (64 here)
            return "x" * 100
        if question == "big":  # a tool output that fills the trajectory's budget
            return call("trouble", kind="huge")
        return "fine"

    found = settings(
        tmp_path, monkeypatch, described_tools, max_turns=3, max_response_tokens=400, max_tool_output_tokens=300
    )
    turns = rollout(found, script)
    try:
        prompts = records(turns.tokenizer, found.schemas, ("loop", ""), ("long", ""), ("big", ""), ("ok", ""))
        loop, long, big, ok = run(turns, prompts)
    finally:
        turns.environments.close()
    assert (loop.ended, loop.turns) == ("max_turns", 3)
    assert [c.get("made", True) for c in loop.calls] == [True, True, False]  # the last turn's call is not made
    assert calls_made(tmp_path) == ["1*2", "1*2"]
    # a turn cut by rollout.max_new_tokens is answered as it is: no call in it, so it is done
    assert (long.ended, long.turns, long.mask) == ("done", 1, [1] * 64)
    assert big.ended == "max_response_tokens" and len(big.response) < 150  # the cut output had no room
    assert (ok.ended, ok.turns) == ("done", 1)


# --- tools that fail ----------------------------------------------------------------------------------------------


def test_a_tool_that_raises_hangs_kills_its_process_or_floods_costs_its_call_only(
    tmp_path, monkeypatch, described_tools
) -> None:
    kinds = ["raise", "hang", "exit", "huge", "fine"]

    def script(text: str) -> str:
        if "<tool_response>" in text:
            return "done"
        question = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        if question == "malformed":
            return "<tool_call>{not json}</tool_call>"
        if question == "unknown":
            return call("divide", a=1)
        if question == "wrong":
            return call("multiply", a=1)
        return call("trouble", kind=question)

    found = settings(tmp_path, monkeypatch, described_tools)
    turns = rollout(found, script)
    try:
        questions = [(kind, "") for kind in [*kinds, "malformed", "unknown", "wrong"]]
        started = time.monotonic()
        trajectories = run(turns, records(turns.tokenizer, found.schemas, *questions), chunk=8)
        assert time.monotonic() - started < 20  # the hung call cost its timeout, not an hour
        # the processes that were killed were replaced: the next call works
        again = run(turns, records(turns.tokenizer, found.schemas, ("fine", "")))
    finally:
        turns.environments.close()
    outputs = {t.texts[0]: t.calls[0] for t in trajectories}
    by_kind = dict(zip([*kinds, "malformed", "unknown", "wrong"], [outputs[t.texts[0]] for t in trajectories]))
    assert by_kind["raise"]["output"] == "Error: ValueError: no such thing"
    assert by_kind["hang"]["output"] == "Error: timed out after 1 s (rollout.multi_turn.tool_timeout_s)"
    assert by_kind["exit"]["output"] == "Error: the tool process died (exit code 9)"
    assert by_kind["huge"]["output"] == "y" * 40 + "\n[output cut to 40 tokens: the tool returned 1000000 characters]"
    assert by_kind["fine"] == {"name": "trouble", "arguments": {"kind": "fine"}, "output": "fine", "error": None}
    assert by_kind["malformed"]["output"].startswith("Error: malformed tool call: not JSON")
    assert by_kind["unknown"]["output"] == "Error: unknown tool 'divide' (the tools are multiply, trouble)"
    assert by_kind["wrong"]["output"].startswith("Error: TypeError: multiply() missing 1 required positional")
    errors = {kind: t.errors for kind, t in zip(by_kind, trajectories)}
    assert errors == {"raise": 1, "hang": 1, "exit": 1, "huge": 0, "fine": 0, "malformed": 1, "unknown": 1, "wrong": 1}
    assert [t.timeouts for t in trajectories] == [0, 1, 0, 0, 0, 0, 0, 0]
    assert all(t.ended == "done" and t.turns == 2 for t in trajectories)  # feedback: the model is told, and goes on
    assert again[0].calls[0]["output"] == "fine"
    # on_tool_error=terminate: a failed call ends its trajectory
    found = settings(tmp_path, monkeypatch, described_tools, on_tool_error="terminate")
    turns = rollout(found, script)
    try:
        raised, fine = run(turns, records(turns.tokenizer, found.schemas, ("raise", ""), ("fine", "")))
    finally:
        turns.environments.close()
    assert (raised.ended, raised.turns, fine.ended, fine.turns) == ("tool_error", 1, "done", 2)


# --- every call made once ------------------------------------------------------------------------------------------


def test_a_trajectory_generated_again_replays_its_recorded_calls(tmp_path, monkeypatch, described_tools) -> None:
    found = settings(tmp_path, monkeypatch, described_tools)
    recorder = LocalRecorder()
    turns = rollout(found, answer_once)
    try:
        prompts = records(turns.tokenizer, found.schemas, ("3*4", "12"), ("5*6", "30"), ("7*8", "56"))
        first = run(turns, prompts, recorder, per_prompt=2)
        assert len(calls_made(tmp_path)) == 6
        # generated again (a lost worker's chunk, a resumed batch): the same trajectories, no call made again
        again = run(turns, prompts, recorder, per_prompt=2)
        assert sorted(calls_made(tmp_path)) == ["3*4", "3*4", "5*6", "5*6", "7*8", "7*8"]
        assert [trajectory_bits(t) for t in again] == [trajectory_bits(t) for t in first]
        # a call in progress when its worker died (begun, never recorded) is made again, and said so
        lost = ("train", 3, 4, 1, 0)
        recorder.ledger.records.pop(lost)
        recorder.ledger.begun[lost] = ("a worker that died", "")
        third = run(turns, prompts, recorder, per_prompt=2)
        assert calls_made(tmp_path)[6:] == ["7*8"]
        assert [trajectory_bits(t) for t in third] == [trajectory_bits(t) for t in first]
        assert [e["event"] for e in recorder.ledger.take_events()] == ["tool_call_repeated"]
    finally:
        turns.environments.close()


def trajectory_bits(trajectory: Trajectory) -> tuple:
    return (trajectory.prompt_ids, trajectory.response, trajectory.mask, trajectory.logprobs, trajectory.calls)


# --- an environment -----------------------------------------------------------------------------------------------


def test_an_environment_answers_each_turn_and_is_built_again_where_it_was_lost(tmp_path, monkeypatch) -> None:
    def guesser(text: str) -> str:  # guesses 5, then 1 below or above what it was told
        told = text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
        turns = text.split("<|im_start|>assistant\n")[1:-1]  # the turns so far (the last piece: the open one)
        guesses = [int(turn.split("<|im_end|>")[0]) for turn in turns]
        last = guesses[-1] if guesses else 5
        return str(5 if not guesses else last + 1 if told == "higher" else last - 1)

    found = settings(tmp_path, monkeypatch)
    recorder = LocalRecorder()
    turns = rollout(found, guesser)
    try:
        prompts = records(turns.tokenizer, (), ("find it", "7"), ("find it", "3"), ("find it", "5"))
        seven, three, five = run(turns, prompts, recorder)
        made = calls_made(tmp_path)
    finally:
        turns.environments.close()
    assert seven.texts == ["5", "6", "7"] and seven.env_reward == 1.0 and seven.ended == "done"
    assert three.texts == ["5", "4", "3"] and five.texts == ["5"] and five.turns == 1
    assert seven.messages[0] == {"role": "user", "content": "guess"}  # the first observation follows the prompt
    assert turns.tokenizer.decode(seven.prompt_ids).endswith("find it<|im_end|>\n<|im_start|>user\nguess<|im_end|>\n"
                                                             "<|im_start|>assistant\n")  # fmt: skip
    assert sum(line.startswith("reset") for line in made) == 3 and len(made) == 3 + 7
    # a new worker (new processes, no instance) with the records of every turn but seven's last: that trajectory's
    # instance is built again (reset and its first step replayed), then its last step is made; nothing else runs
    recorder.ledger.records.pop(("train", 3, 0, 3, "env"))
    turns = rollout(found, guesser)
    try:
        again = run(turns, prompts, recorder)
    finally:
        turns.environments.close()
    assert [trajectory_bits(t) for t in again] == [trajectory_bits(t) for t in (seven, three, five)]
    assert calls_made(tmp_path)[len(made) :] == ["reset 0 0", "step 5", "step 6", "step 7"]


def test_a_tools_file_an_environment_or_a_parser_that_cannot_load_is_refused_in_one_line(tmp_path, monkeypatch):
    from rlrunner.errors import ConfigError

    (tmp_path / "empty.py").write_text("x = 1\n")
    empty = CodeSpec("rollout.multi_turn.tools", "empty.py", path=str(tmp_path / "empty.py"))
    with pytest.raises(ConfigError, match=r"^rollout.multi_turn.tools: .*empty.py has no tools"):
        described(MultiTurnSettings(tools=empty, env=None, **BOUNDS))
    with pytest.raises(ConfigError, match=r"^rollout.multi_turn.env: .*env.py has no 'Guess'$"):
        settings(tmp_path, monkeypatch, source="x = 1\n")
    parser = parse_code_spec("nowhere.py:f", "rollout.multi_turn.parser", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^rollout.multi_turn.parser: file not found: .*nowhere.py$"):
        described(dataclasses.replace(settings(tmp_path, monkeypatch), parser=parser))


def test_an_instance_lost_with_a_process_another_one_killed_is_built_again(tmp_path, monkeypatch) -> None:
    """Trajectories 0 and 2 live in the same tool process (their positions pin them); 0's step kills it, so 2's step,
    queued behind, finds no instance: it is built again in the new process and answers as it would have."""
    source = ENVIRONMENT.replace(
        "        guess = int(text)", "        if text == 'crash':\n            os._exit(3)\n        guess = int(text)"
    )

    def script(text: str) -> str:
        question = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        return "crash" if question == "crash" else question

    found = settings(tmp_path, monkeypatch, source=source)
    turns = rollout(found, script)
    try:
        prompts = records(turns.tokenizer, (), ("crash", "1"), ("2", "2"), ("3", "3"), ("4", "4"))
        crashed, *others = run(turns, prompts, chunk=4)
    finally:
        turns.environments.close()
    assert crashed.ended == "env_error" and crashed.errors == 1
    assert [(t.ended, t.env_reward, t.turns) for t in others] == [("done", 1.0, 1)] * 3
    assert calls_made(tmp_path).count("reset 2 0") == 2  # trajectory 2's instance, built again
