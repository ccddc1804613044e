"""The ledger of tool calls: every tool result and environment answer, kept outside the rollout worker that asked
for it, so that a trajectory generated again uses it instead of calling again.

    ledger = CallLedger(journal_path, keep=True, after_step=checkpoint_step)
    found = ledger.begin(owner, [(key, signature), ...])   # per entry: its record (replay it), or None (call now)
    ledger.record([(key, record), ...])                    # as each call returns
    ledger.retire([owner]); ledger.in_progress([owner])    # a group going: no new calls; those under way finish
    ledger.drop_through(step)                               # a checkpoint of `step` committed: earlier keys never recur

A key is (mode, step, position, turn, call): "train" or "val", the step, the sample's position in the step's batch,
the assistant turn after which it was made, and its place among that turn's calls ("env" for an environment's step,
"reset" for its first observation). A record holds the call's `signature` (a hash of the trajectory's tokens up to the
call and of the call itself): a trajectory generated again with the same seeds and weights asks for the same key with
the same signature and gets the record; any other trajectory (another config, another engine) gets None and calls
anew (the old record is replaced, and the mismatch is an event). A key begun and never recorded was in progress when
its worker died: it is called again, and that is an event too (`take_events`: the driver writes them to
recovery.jsonl).

The records are journaled, a JSON line each, flushed as it is recorded, and so is each call as it begins: a driver
that dies and is relaunched (`runner.resume_dir` set) reads them back for the steps after its checkpoint, and a call
that had begun without a record is called again, as an event. Plain Python, no Ray or torch: the driver
runs one as a Ray actor on its own node (`rlrunner.runner.tool_records`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

Key = tuple  # (mode, step, position, turn, call)


class OwnerRetired(RuntimeError):
    """A rollout worker whose group is going asked to begin a call: it must not."""


def _key(value: Sequence) -> Key:
    return tuple(value)


class CallLedger:
    def __init__(self, journal: str | None = None, keep: bool = False, after_step: int = 0):
        """`journal`: the file records are appended to (None: memory only); `keep`: read the records it holds for steps
        after `after_step` (a resumed run), else start it empty."""
        self.records: dict[Key, dict] = {}
        self.begun: dict[Key, tuple[str, str]] = {}  # key -> (owner, signature): called, not yet recorded
        self.retired: set[str] = set()
        self.events: list[dict[str, Any]] = []
        self.journal = journal
        if journal is not None and keep and os.path.exists(journal):
            for key, record in _read(journal):
                if key[1] <= after_step:
                    continue
                if record is None:  # begun
                    self.begun[key] = ("a driver before this one", "")
                else:
                    self.begun.pop(key, None)
                    self.records[key] = record
        self._file = None
        if journal is not None:
            self._rewrite()

    def ping(self) -> int:
        return os.getpid()

    def begin(self, owner: str, entries: Sequence[tuple[Sequence, str]]) -> list[dict | None]:
        """For each (key, signature): the record to replay, or None when the caller is to make the call now (it is
        then in progress until recorded)."""
        if owner in self.retired:
            raise OwnerRetired(f"rollout worker {owner} is leaving: it may begin no tool call")
        found: list[dict | None] = []
        for raw_key, signature in entries:
            key = _key(raw_key)
            record = self.records.get(key)
            if record is not None and record["signature"] == signature:
                found.append(record)
                continue
            if record is not None:
                self.events.append({"event": "tool_record_mismatch", "key": list(key)})
                del self.records[key]
            if key in self.begun:
                self.events.append({"event": "tool_call_repeated", "key": list(key), "owner": self.begun[key][0]})
            self.begun[key] = (owner, signature)
            self._write(key, None)
            found.append(None)
        self._flush()
        return found

    def record(self, entries: Sequence[tuple[Sequence, dict]]) -> None:
        for raw_key, record in entries:
            key = _key(raw_key)
            self.begun.pop(key, None)
            self.records[key] = record
            self._write(key, record)
        self._flush()

    def _write(self, key: Key, record: dict | None) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"key": list(key), "record": record}) + "\n")

    def _flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def retire(self, owners: Iterable[str]) -> None:
        self.retired.update(owners)

    def in_progress(self, owners: Iterable[str]) -> int:
        """The calls begun by `owners` and not recorded yet."""
        owners = set(owners)
        return sum(1 for owner, _ in self.begun.values() if owner in owners)

    def drop_through(self, step: int) -> None:
        """Forget the keys of steps up to `step` (a checkpoint of it is committed: no attempt redoes them)."""
        self.records = {key: record for key, record in self.records.items() if key[1] > step}
        self.begun = {key: begun for key, begun in self.begun.items() if key[1] > step}
        if self.journal is not None:
            self._rewrite()

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def count(self) -> int:
        return len(self.records)

    def _rewrite(self) -> None:
        """The journal made to hold exactly the records kept (written aside, then put in place)."""
        if self._file is not None:
            self._file.close()
        os.makedirs(os.path.dirname(self.journal) or ".", exist_ok=True)
        temporary = f"{self.journal}.tmp"
        with open(temporary, "w") as handle:
            for key in self.begun:
                handle.write(json.dumps({"key": list(key), "record": None}) + "\n")
            for key, record in self.records.items():
                handle.write(json.dumps({"key": list(key), "record": record}) + "\n")
        os.replace(temporary, self.journal)
        self._file = open(self.journal, "a")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _read(journal: str) -> Iterable[tuple[Key, dict | None]]:
    """The journal's entries (a record, or None for a call begun), up to a line cut short by a crash."""
    with open(journal) as handle:
        for line in handle:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                return
            yield _key(entry["key"]), entry["record"]
