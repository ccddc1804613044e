"""The experiment lock on object stores: a lease made of generation objects.

`<experiment>/.rlrunner.lock/<12-digit generation>.json`; the highest generation is the current lease. A run
takes the lease by creating the next generation with a conditional create (`write_if_absent`: S3's
`If-None-Match: *`, GCS's `ifGenerationMatch=0`), so of several racers exactly one wins, and only when the current
lease is released, stale (no heartbeat for the holder's `stale_after_s`, measured on the store's clock), or held by
a process of this machine that has exited (so a driver relaunched by the launch script need not wait). The holder
rewrites its own object every `heartbeat_s` from a daemon thread, and on each beat looks for a higher generation:
one appears only when another run found this lease stale, which this holder learns from `lost()`. Nothing is ever
overwritten but one's own object. The new holder deletes all but the last KEEP_GENERATIONS generations.

Stores without a conditional create: write, wait SETTLE_S, read back; best effort (two runs that start within
the settle time of each other may both think they hold it), with a warning.

All reading of the time and all waiting goes through a `Clock` (the real one unless a test passes its own), so
that tests can let lease time pass without waiting for it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from typing import Any

from rlrunner.errors import ExperimentLockedError
from rlrunner.storage import Storage

logger = logging.getLogger(__name__)

LOCK_NAME = ".rlrunner.lock"  # a file (flock) on local disks, a folder of generations on object stores
KEEP_GENERATIONS = 3  # the holder's own and the two before it, for the record
SETTLE_S = 2.0  # stores without conditional create: how long a racer's write has to show up before we read back
CLOCK_SLACK_S = 1.0  # S3's Last-Modified has whole seconds: a lease must look this much older before it is stale
_GENERATION = re.compile(r"^(\d{12})\.json$")
_warned_best_effort: set[str] = set()


class Clock:
    """Where the lease reads the time and waits: the real clock. Tests pass a subclass whose time passes at once.

    `now` is wall-clock (Unix) time, what the lease writes into its objects; `monotonic` measures intervals;
    `wait` is a `sleep` that ends early when `event` is set (the heartbeat thread's halt) and says whether it was."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(seconds)


SYSTEM_CLOCK = Clock()


class Current:
    """The highest generation of a lease folder: its number, URL and record (None when unreadable)."""

    def __init__(self, generation: int, url: str, record: dict[str, Any] | None):
        self.generation, self.url, self.record = generation, url, record

    def describe(self, age: str | None) -> str:
        record = self.record
        if record is None:
            return f"an unreadable lease {self.url}"
        beat = f"last heartbeat {clock(record.get('heartbeat_unix'))}" + (f" ({age})" if age else "")
        return f"pid {record.get('pid')} on {record.get('host')}, since {clock(record.get('since_unix'))}, {beat}"


class Lease:
    def __init__(
        self,
        storage: Storage,
        experiment_url: str,
        heartbeat_s: float,
        stale_after_s: float,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ):
        self.storage = storage
        self.clock = clock
        self.experiment_url = experiment_url
        self.lock_dir = storage.join(experiment_url, LOCK_NAME)
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self._record: dict[str, Any] | None = None  # ours, while held
        self._url = ""
        self._generation = 0
        self._last_ok = 0.0  # clock.monotonic() at the *start* of the last heartbeat that landed
        self._last_error: str | None = None
        self._lost: str | None = None
        self._state = threading.Lock()  # guards _lost
        self._write = threading.Lock()  # a heartbeat never lands after release's "released"
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    # acquire / release

    def acquire(self) -> None:
        waited_for: int | None = None  # the generation whose lapse we are waiting for
        while True:
            current = current_lease(self.storage, self.lock_dir)
            free_because = None
            if current is None:
                break
            free_because, age_text, age = self._assess(current)
            if free_because is not None:
                break
            lapse_in = self._lapse_in(current, age)
            if lapse_in is None or (waited_for is not None and waited_for != current.generation):
                raise ExperimentLockedError(self._held_message(current, age_text))
            if waited_for is None:
                logger.warning(
                    "the experiment lock is held by %s, which has missed its heartbeats: "
                    "waiting %.0f s for its lease to lapse",
                    current.describe(age_text),
                    lapse_in,
                )
                waited_for = current.generation
            self.clock.sleep(min(max(lapse_in, 0.2), 5.0))
        generation = current.generation + 1 if current else 1
        url = _generation_url(self.storage, self.lock_dir, generation)
        now = self.clock.now()
        record = {
            "owner": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process": _process_identity(os.getpid()),
            "since_unix": now,
            "heartbeat_unix": now,
            "heartbeat_s": self.heartbeat_s,
            "stale_after_s": self.stale_after_s,
            "released": False,
        }
        started = self.clock.monotonic()
        if not self._create(url, record):
            winner = current_lease(self.storage, self.lock_dir)
            raise ExperimentLockedError(self._held_message(winner, None) if winner else f"lost the race for {url}")
        if current is not None and free_because != "released":
            logger.warning("took over the experiment lock of %s: %s", current.describe(None), free_because)
        self._record, self._url, self._generation, self._last_ok = record, url, generation, started
        self._lost, self._last_error = None, None
        self._halt = threading.Event()
        self._thread = threading.Thread(
            target=self._beat_until, args=(self._halt,), name="rlrunner-lock-heartbeat", daemon=True
        )
        self._thread.start()
        self._delete_old_generations()

    def _create(self, url: str, record: dict[str, Any]) -> bool:
        """Create generation `url`; False when another run got there first."""
        if self.storage.supports_exclusive_create:
            return self.storage.write_if_absent(url, _encode(record))
        if self.storage.protocol not in _warned_best_effort:
            _warned_best_effort.add(self.storage.protocol)
            logger.warning(
                "%s:// storage has no conditional create: the experiment lock is best effort "
                "(two runs started within %.0f s of each other may both hold it)",
                self.storage.protocol,
                SETTLE_S,
            )
        if self.storage.exists(url):
            return False
        self.storage.write_bytes(url, _encode(record))
        self.clock.sleep(SETTLE_S)  # a racer's write that landed after ours replaced it: read back to see who is left
        back = _read_record(self.storage, url)
        return back is not None and back.get("owner") == record["owner"]

    def release(self) -> None:
        if self._record is None:
            return
        self._halt.set()
        with self._write:  # waits for a heartbeat in flight
            if self.lost() is None:  # when lost, our object may no longer be ours to write (best-effort stores)
                try:
                    self.storage.write_bytes(
                        self._url, _encode({**self._record, "released": True, "heartbeat_unix": self.clock.now()})
                    )
                except Exception as exc:
                    logger.warning(
                        "could not mark the experiment lock %s released (%s: %s): the next run can take it over %.0f s "
                        "after the last heartbeat",
                        self._url,
                        type(exc).__name__,
                        exc,
                        self.stale_after_s,
                    )
        self._record = None

    # heartbeats

    def lost(self) -> str | None:
        if self._lost is None and self._record is not None:
            silent = self.clock.monotonic() - self._last_ok
            if silent > self.stale_after_s:
                error = f"; last error: {self._last_error}" if self._last_error else ""
                self._set_lost(
                    f"the experiment lock {self.lock_dir} had no successful heartbeat for {silent:.0f} s "
                    f"(stale after {self.stale_after_s:.0f} s{error}): another run may have taken the experiment over"
                )
        return self._lost

    def _set_lost(self, reason: str, replace: bool = False) -> None:
        with self._state:
            if self._lost is None or replace:
                self._lost = reason

    def _beat_until(self, halt: threading.Event) -> None:
        while not self.clock.wait(halt, self.heartbeat_s):
            if not self._beat():
                return

    def _beat(self) -> bool:
        """One heartbeat: look for a newer generation, then rewrite our own object. False once the lease is lost.

        A storage error only skips this beat; the lease is lost when no beat lands for stale_after_s.
        """
        started, record = self.clock.monotonic(), self._record
        if record is None:  # released
            return False
        try:
            newer = [g for g in _generations(self.storage, self.lock_dir) if g > self._generation]
            if newer:
                winner = current_lease(self.storage, self.lock_dir)
                who = winner.describe(None) if winner else "another run"
                self._set_lost(
                    f"the experiment lock {self.lock_dir} was taken over by {who} (lease generation {max(newer)}; "
                    f"ours, {self._generation}, had looked stale to it)",
                    replace=True,
                )
                return False
            if self.lost() is not None:
                return False
            if not self.storage.supports_exclusive_create:  # racers may have written our key: is it still ours?
                back = _read_record(self.storage, self._url)
                if back is not None and back.get("owner") != record["owner"]:
                    who = Current(self._generation, self._url, back).describe(None)
                    self._set_lost(f"the experiment lock {self._url} was overwritten by {who}")
                    return False
            with self._write:
                if self._halt.is_set():  # released (or, in tests, frozen) meanwhile
                    return False
                record["heartbeat_unix"] = self.clock.now()
                self.storage.write_bytes(self._url, _encode(record))
        except Exception as exc:  # a storage error: record it, try again next beat
            self._last_error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "experiment lock heartbeat failed (%s); retrying in %.0f s", self._last_error, self.heartbeat_s
            )
            return self.lost() is None
        if (
            self.clock.monotonic() - self._last_ok > self.stale_after_s
        ):  # landed too late: another run may have taken over
            return self.lost() is None
        self._last_ok, self._last_error = started, None
        return True

    # what the current lease is worth

    def _assess(self, current: Current) -> tuple[str | None, str | None, float | None]:
        """(why the current lease may be taken, or None; its age as text; its age in seconds where known)."""
        record = current.record
        if record is not None and record.get("released"):
            return "released", None, None
        if record is not None and _holder_exited(record):
            return f"pid {record.get('pid')} on this machine has exited without releasing it", None, None
        stale_after = float((record or {}).get("stale_after_s", self.stale_after_s))
        written = self.storage.modified(current.url)  # by the store's clock (S3: LastModified)
        if written is not None and (now := _store_now(self.storage, self.lock_dir)) is not None:
            age, clock, slack = now - written, "the store's clock", CLOCK_SLACK_S
        elif record is not None:  # a store that keeps no modification times: this host's clock against the holder's
            age, clock, slack = self.clock.now() - float(record.get("heartbeat_unix", 0)), "this host's clock", 0.0
        else:
            return None, None, None
        text = f"{age:.0f} s ago by {clock}"
        if age > stale_after + slack:
            return f"its last heartbeat was {text} (stale after {stale_after:.0f} s)", text, age
        return None, text, age

    def _lapse_in(self, current: Current, age: float | None) -> float | None:
        """Seconds until a lease that has stopped beating lapses; None while its holder still beats (or unknown).

        A holder beats every heartbeat_s: one that missed two beats is most likely dead (a driver killed on
        another machine, which the launch script or a scheduler relaunches here). Waiting for its lease to lapse
        beats refusing a relaunch that would succeed minutes later."""
        record = current.record
        if record is None or age is None:
            return None
        heartbeat = float(record.get("heartbeat_s", self.heartbeat_s))
        if age <= 2 * heartbeat + CLOCK_SLACK_S:
            return None
        return max(0.0, float(record.get("stale_after_s", self.stale_after_s)) + CLOCK_SLACK_S - age)

    def _held_message(self, current: Current, age: str | None) -> str:
        lapse = float((current.record or {}).get("stale_after_s", self.stale_after_s))
        remedy = "wait for it to end" if current.record is not None else f"delete {current.url} if no run uses it"
        return (
            f"experiment folder {self.experiment_url} is in use by another run ({current.describe(age)}, "
            f"lease generation {current.generation}); {remedy} (a dead run's lease lapses {lapse:.0f} s after its "
            "last heartbeat) or choose another runner.experiment_name"
        )

    def _delete_old_generations(self) -> None:
        try:
            for generation in _generations(self.storage, self.lock_dir):
                if generation <= self._generation - KEEP_GENERATIONS:
                    self.storage.delete(_generation_url(self.storage, self.lock_dir, generation))
        except OSError as exc:  # only tidiness: old generations never count
            logger.debug("could not delete old experiment lock generations: %s", exc)


# -- helpers -----------------------------------------------------------------------------------------


def _generation_url(storage: Storage, lock_dir: str, generation: int) -> str:
    return storage.join(lock_dir, f"{generation:012d}.json")


def _generations(storage: Storage, lock_dir: str) -> list[int]:
    found = (_GENERATION.match(name) for name in storage.list(lock_dir))
    return sorted(int(match.group(1)) for match in found if match)


def current_lease(storage: Storage, lock_dir: str) -> Current | None:
    """The highest generation, or None when there is none. Re-lists if it vanishes under us (deleted by hand)."""
    for _ in range(3):
        generations = _generations(storage, lock_dir)
        if not generations:
            return None
        url = _generation_url(storage, lock_dir, generations[-1])
        try:
            data = storage.read_bytes(url)
        except FileNotFoundError:
            continue
        return Current(generations[-1], url, _decode(data))
    raise OSError(f"the experiment lock {lock_dir} keeps changing under us; retry")


def _read_record(storage: Storage, url: str) -> dict[str, Any] | None:
    try:
        return _decode(storage.read_bytes(url))
    except FileNotFoundError:
        return None


def _encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True).encode()


def _decode(data: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _store_now(storage: Storage, lock_dir: str) -> float | None:
    """The store's clock now: the modification time of a probe object written for the purpose."""
    probe = storage.join(lock_dir, f"clock-{uuid.uuid4().hex}.probe")
    storage.write_bytes(probe, b"")
    try:
        return storage.modified(probe)
    finally:
        storage.delete(probe)


def _process_identity(pid: int) -> str | None:
    """`<boot id>/<pid namespace>/<pid>/<start time>` of a running process; None if it is not running or
    this is not Linux. Equal identities mean the same process: pids are comparable only within one boot and
    one pid namespace, and the start time tells a reused pid apart."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
        with open(f"/proc/{pid}/stat") as handle:
            start = handle.read().rsplit(")", 1)[1].split()[19]  # field 22; the fields after `(comm)` start at 3
    except (OSError, IndexError):
        return None
    return f"{boot}/{namespace}/{pid}/{start}"


def _holder_exited(record: dict[str, Any]) -> bool:
    """Whether the holder was a process of this machine (same boot, same pid namespace) that no longer runs.
    A reused pid reads as another process; a process we cannot see reads as alive (the safe side)."""
    theirs, ours = record.get("process"), _process_identity(os.getpid())
    if not isinstance(theirs, str) or ours is None or theirs.rsplit("/", 2)[0] != ours.rsplit("/", 2)[0]:
        return False
    try:
        return _process_identity(int(record["pid"])) != theirs
    except (KeyError, TypeError, ValueError):
        return False


def clock(unix: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(unix)))
    except (TypeError, ValueError, OverflowError):
        return "unknown"
