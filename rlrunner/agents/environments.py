"""The environment seam: what answers the model between its turns, run in the rollout worker's tool processes.

    envs = ToolEnvironments(pool, settings, parser, tokenizer)       # or UserEnvironments(pool, settings)
    first = envs.start(recorder, trajectories)             # each one's first observation (None: the prompt alone)
    pending = envs.ask(recorder, trajectories, texts, turn, last)   # returns at once: the calls run meanwhile
    answers = envs.answers(pending)                         # one Answer per trajectory, in order

A user's environment (`rollout.multi_turn.env`) is a class: `reset(record)` gives the first observation (a string, or
None), `step(assistant_text)` gives `(observation, done)` or `(observation, done, reward)`; one instance per
trajectory, living in one tool process (its items are pinned there). Tools (`rollout.multi_turn.tools`) are one such
environment: its step parses the turn's calls, runs each in any tool process, and answers with one tool message per
call; no call ends the trajectory.

Every answer is recorded (`Recorder`: the run's call ledger, `rlrunner.agents.ledger`) before the trajectory goes on,
and asked for first: a trajectory generated again gets the recorded answer instead of a new call. An environment
instance that must go on after answers it never gave in this process (a worker replaced, its process replaced) is
built again by replaying its trajectory: `reset` and every earlier `step` again, their answers dropped.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from rlrunner.agents.chat import encode_text
from rlrunner.agents.parsers import ToolCall, calls_of
from rlrunner.agents.settings import MultiTurnSettings
from rlrunner.agents.tools import cut_note
from rlrunner.utils.process_pool import Batch, ProcessPool, Result


class Recorder(Protocol):
    """Where answers are recorded and looked up (`CallLedger` semantics; the worker's is its Ray actor)."""

    def begin(self, entries: list[tuple[tuple, str]]) -> list[dict | None]:
        """Per (key, signature): the record to replay, or None (the caller makes the call now)."""

    def record(self, key: tuple, record: dict) -> None:
        """Keep `record` under `key`; may return before it is kept."""

    def flush(self) -> None:
        """Return once every record so far is kept."""


@dataclass
class Turn:
    """What the environment sees of a trajectory: who it is, its record, and its tokens so far."""

    mode: str  # "train" | "val"
    step: int
    position: int  # its sample's place in the step's batch
    record: dict  # the prompt's record (index, answer, data_source, extra_info) with "sample", "seed", "prompt"
    context: Sequence[int]  # prompt and response tokens so far
    texts: Sequence[str]  # its assistant turns' texts so far (the last one is the turn being answered)

    def key(self, turn: int, call: int | str) -> tuple:
        return (self.mode, self.step, self.position, turn, call)

    @property
    def name(self) -> tuple:
        """Its environment instance's name in a tool process."""
        return (self.mode, self.step, self.position)


@dataclass
class Answer:
    """The environment's answer to one turn."""

    messages: list[dict] = field(default_factory=list)  # what follows the turn (tool results, an observation)
    done: bool = False
    reward: float | None = None  # an environment's own reward
    ended: str | None = None  # why it ended, when not plainly done: max_turns, tool_error, env_error
    calls: list[dict] = field(default_factory=list)  # the turn's tool calls and their results (for the trajectory)
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0  # time its calls ran (recorded for replayed ones)


def signature(context: Sequence[int], what: Any) -> str:
    """A hash of the trajectory's tokens up to a call and of the call itself."""
    digest = hashlib.sha256(json.dumps([list(context), what], sort_keys=True, default=str).encode())
    return digest.hexdigest()[:32]


def as_record(result: Result, sig: str) -> dict:
    return {
        "signature": sig,
        "value": result.value,
        "error": result.error,
        "seconds": result.seconds,
        "timed_out": result.error is not None and result.error.startswith("timed out"),
    }


@dataclass
class Pending:
    """Answers asked for and not yet collected (`Environments.ask`)."""

    turns: list[Turn]
    index: int  # the assistant turn answered
    last: bool
    batch: Batch | None  # the calls made now
    waits: list[Any]  # per trajectory, what its answer is made of (each implementation's own)
    entries: list[tuple[tuple, str]] = field(default_factory=list)  # the (key, signature) of each trajectory's answer


class Environments(ABC):
    holds_instances = False  # whether it keeps state per trajectory in the tool processes (its turns need a record)

    def __init__(self, pool: ProcessPool, settings: MultiTurnSettings):
        self.pool, self.settings = pool, settings

    @abstractmethod
    def start(self, recorder: Recorder, turns: list[Turn]) -> list[str | None]:
        """Each trajectory's first observation (None: none), waited for."""

    @abstractmethod
    def ask(self, recorder: Recorder, turns: list[Turn], index: int, last: bool) -> Pending:
        """Start answering assistant turn `index` (1-based) of each of `turns` (its text: `turn.texts[-1]`); `last`:
        no turn follows, whatever the answer."""

    @abstractmethod
    def answers(self, recorder: Recorder, pending: Pending) -> list[Answer]:
        """The answers of `pending`, once every call has returned and is recorded."""

    def finish(self, turns: list[Turn]) -> None:
        """These trajectories are over: whatever they hold in the tool processes goes."""

    def close(self) -> None:
        self.pool.close()


class ToolEnvironments(Environments):
    def __init__(self, pool: ProcessPool, settings: MultiTurnSettings, parser: Callable[[str], Any], tokenizer: Any):
        super().__init__(pool, settings)
        self.parser, self.tokenizer = parser, tokenizer
        self.tools = set(settings.tool_names)

    def start(self, recorder: Recorder, turns: list[Turn]) -> list[str | None]:
        return [None] * len(turns)

    def ask(self, recorder: Recorder, turns: list[Turn], index: int, last: bool) -> Pending:
        # per trajectory: (its answer, when known without a call) or its calls, each [batch position or -1, its
        # record when known, the call, why it cannot be made]
        waits: list[Answer | list[list[Any]]] = []
        entries: list[tuple[tuple, str]] = []
        wanted: list[list[Any]] = []  # the calls to ask the recorder about, in `entries` order
        for turn in turns:
            calls = calls_of(self.parser, turn.texts[-1])
            if not calls or last:  # done; or the model wants more than max_turns allow: not called
                made = [call.as_dict() | {"made": False} for call in calls]
                waits.append(Answer(done=True, ended="max_turns" if calls else None, calls=made))
                continue
            mine = []
            for number, call in enumerate(calls):
                problem = call.error or self._problem(call)
                entry = [-1, None, call, problem]
                if problem is None:
                    what = {"name": call.name, "arguments": call.arguments, "call": number}
                    entries.append((turn.key(index, number), signature(turn.context, what)))
                    wanted.append(entry)
                mine.append(entry)
            waits.append(mine)
        items, keyed = [], []
        for entry, (key, sig), record in zip(wanted, entries, recorder.begin(entries) if entries else []):
            if record is not None:
                entry[1] = record
            else:
                entry[0] = len(items)
                items.append(("call", entry[2].name, entry[2].arguments))
                keyed.append((key, sig))
        batch = None
        if items:
            batch = self.pool.submit_items(
                items, on_result=lambda i, result: recorder.record(keyed[i][0], as_record(result, keyed[i][1]))
            )
        return Pending(turns, index, last, batch, waits, entries)

    def _problem(self, call: ToolCall) -> str | None:
        if call.name not in self.tools:
            return f"unknown tool '{call.name}' (the tools are {', '.join(sorted(self.tools))})"
        return None

    def answers(self, recorder: Recorder, pending: Pending) -> list[Answer]:
        results = self.pool.wait_batch(pending.batch) if pending.batch is not None else []
        if pending.batch is not None:
            recorder.flush()  # every result the trajectories go on with is kept outside this worker
        out = []
        for wait in pending.waits:
            if isinstance(wait, Answer):
                out.append(wait)
                continue
            answer = Answer()
            for position, record, call, problem in wait:
                if problem is not None:  # malformed, or a tool that does not exist: never called
                    record = {"value": None, "error": problem, "seconds": 0.0, "timed_out": False}
                elif position >= 0:
                    record = as_record(results[position], "")
                content = self._content(record)
                answer.messages.append({"role": "tool", "name": call.name or "", "content": content})
                answer.calls.append(call.as_dict() | {"output": content, "error": record["error"]})
                answer.errors += record["error"] is not None
                answer.timeouts += bool(record["timed_out"])
                answer.seconds += record["seconds"]
            if answer.errors and self.settings.on_tool_error == "terminate":
                answer.done, answer.ended = True, "tool_error"
            out.append(answer)
        return out

    def _content(self, record: dict) -> str:
        """A call's tool message: its output cut to `max_tool_output_tokens` (saying so), or its error."""
        if record["error"] is not None:
            return f"Error: {record['error']}"
        text, total = record["value"]
        limit = self.settings.max_tool_output_tokens
        ids = encode_text(self.tokenizer, text)
        if len(ids) <= limit and total <= len(text):
            return text
        return self.tokenizer.decode(ids[:limit]) + cut_note(min(limit, len(ids)), total)


class UserEnvironments(Environments):
    """A user's environment class, one instance per trajectory in the tool process its position pins it to."""

    holds_instances = True

    def __init__(self, pool: ProcessPool, settings: MultiTurnSettings):
        super().__init__(pool, settings)
        self.live: dict[tuple, tuple[int, int]] = {}  # instance name -> (slot, its process's generation)

    def _slot(self, turn: Turn) -> int:
        return turn.position % self.pool.num_workers

    def _is_live(self, turn: Turn) -> bool:
        slot = self._slot(turn)
        return self.live.get(turn.name) == (slot, self.pool.generations[slot])

    def _send(self, recorder: Recorder, turns: list[Turn], entries: list, found: list, index: int) -> Pending:
        """The reset (`index` 0) or the step of each turn without a record, pinned to its instance's process; an
        instance that is not live there is built first (reset and its earlier steps again, answers dropped)."""
        items: list[tuple] = []
        pins: list[int] = []
        keyed: dict[int, tuple] = {}
        waits: list[tuple[int, dict | None]] = []
        for turn, entry, record in zip(turns, entries, found):
            if record is not None:
                waits.append((-1, record))
                continue
            slot = self._slot(turn)
            if index > 0 and not self._is_live(turn):
                items += [("reset", turn.name, turn.record)] + [("step", turn.name, text) for text in turn.texts[:-1]]
                pins += [slot] * len(turn.texts)
            keyed[len(items)] = entry
            waits.append((len(items), None))
            items.append(("step", turn.name, turn.texts[-1]) if index > 0 else ("reset", turn.name, turn.record))
            pins.append(slot)
            self.live[turn.name] = (slot, self.pool.generations[slot])

        def on_result(i: int, result: Result) -> None:
            if i in keyed and not result.lost:
                recorder.record(keyed[i][0], as_record(result, keyed[i][1]))

        batch = self.pool.submit_items(items, pins=pins, on_result=on_result) if items else None
        return Pending(turns, index, False, batch, waits, list(entries))

    def _collect(self, recorder: Recorder, pending: Pending) -> list[dict]:
        """Each turn's record: replayed, or its call's; a call lost with a process replaced before its turn (another
        instance's call killed it) is asked again, its instance built again."""
        results = self.pool.wait_batch(pending.batch) if pending.batch is not None else []
        records = [record if position < 0 else None for position, record in pending.waits]
        lost = []
        for row, (position, _) in enumerate(pending.waits):
            if position >= 0:
                if results[position].lost:
                    lost.append(row)
                else:
                    records[row] = as_record(results[position], "")
        if lost:
            turns, entries = [pending.turns[row] for row in lost], [pending.entries[row] for row in lost]
            again = self._send(recorder, turns, entries, [None] * len(turns), pending.index)
            for row, record in zip(lost, self._collect(recorder, again)):
                records[row] = record
        if pending.batch is not None:
            recorder.flush()
        return records  # type: ignore[return-value]

    def start(self, recorder: Recorder, turns: list[Turn]) -> list[str | None]:
        entries = [(turn.key(0, "reset"), signature(turn.context, "reset")) for turn in turns]
        pending = self._send(recorder, turns, entries, recorder.begin(entries), 0)
        return [record["value"] if record["error"] is None else None for record in self._collect(recorder, pending)]

    def ask(self, recorder: Recorder, turns: list[Turn], index: int, last: bool) -> Pending:
        entries = [(turn.key(index, "env"), signature(turn.context, turn.texts[-1])) for turn in turns]
        pending = self._send(recorder, turns, entries, recorder.begin(entries), index)
        pending.last = last
        return pending

    def answers(self, recorder: Recorder, pending: Pending) -> list[Answer]:
        out = []
        for record in self._collect(recorder, pending):
            seconds = record["seconds"]
            if record["error"] is not None:
                out.append(
                    Answer(done=True, ended="env_error", errors=1, timeouts=int(record["timed_out"]), seconds=seconds)
                )
                continue
            observation, done, reward = record["value"]
            messages = [] if observation is None else [{"role": "user", "content": observation}]
            ended = "max_turns" if pending.last and not done else None
            out.append(Answer(messages, done or pending.last, reward, ended, seconds=seconds))
        return out

    def finish(self, turns: list[Turn]) -> None:
        items, pins = [], []
        for turn in turns:
            if self._is_live(turn):
                items.append(("drop", turn.name, None))
                pins.append(self._slot(turn))
            self.live.pop(turn.name, None)
        if items:
            self.pool.submit_items(items, pins=pins)
