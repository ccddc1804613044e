"""The experiment lock: a flock on local disks, a lease of generation objects on object stores (moto's real S3 API)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from rlrunner.errors import ExperimentLockedError
from rlrunner.experiment import lease as lock_module
from rlrunner.experiment.lease import Clock
from rlrunner.experiment.lock import ExperimentLock, describe_holder
from rlrunner.storage import open_storage

from lease_fakes import FakeClock, StampedStorage

FAST = {
    "heartbeat_s": 0.25,
    "stale_after_s": 2.0,
}  # stale once the store's clock says > 3 s (1 s slack for whole seconds)
PAST_STALE_S = 4.2  # long enough for a lease that stopped beating to look stale


def remote(s3_store):
    url, options = s3_store
    storage = open_storage(url, options)
    return storage, storage.join(url, "exp")


def faked(s3_store):
    """(a fake clock, a storage whose clock it drives, the experiment URL, a function giving more such storages:
    other connections to the same store, on the same clock)."""
    storage, experiment = remote(s3_store)
    clock, stamps = FakeClock(), {}
    return clock, StampedStorage(storage, clock, stamps), experiment, lambda store: StampedStorage(store, clock, stamps)


def generations(storage, experiment) -> dict[int, dict]:
    lock_dir = storage.join(experiment, ".rlrunner.lock")
    return {
        int(name[:12]): json.loads(storage.read_bytes(storage.join(lock_dir, name))) for name in storage.list(lock_dir)
    }


def freeze(holder: ExperimentLock) -> None:
    """Stop a holder's heartbeat without releasing: a process that froze, or whose host vanished, while it held the
    lock."""
    holder._impl._halt.set()
    holder._impl._thread.join()


def acquire_when_free(lock: ExperimentLock, clock: Clock, deadline_s: float = 15.0) -> tuple[float, int]:
    """Keep trying; (seconds until it was taken, refusals before that), by `clock`."""
    start, refusals = clock.monotonic(), 0
    while True:
        try:
            lock.acquire()
            return clock.monotonic() - start, refusals
        except ExperimentLockedError:
            refusals += 1
            assert clock.monotonic() - start < deadline_s, "the lease never became free"
            clock.sleep(0.2)


def spawn_holder(storage, experiment, env):
    """A separate process that takes the lock (stale_after_s=300) and sleeps."""
    code = (
        "import sys, time, json; from rlrunner.storage import open_storage; "
        "from rlrunner.experiment.lock import ExperimentLock; "
        "s = open_storage(sys.argv[1], json.loads(sys.argv[2])); ExperimentLock(s, sys.argv[3], 1.0, 300.0).acquire(); "
        "print('locked', flush=True); time.sleep(120)"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, storage.url, json.dumps(storage.storage_options, default=str), experiment],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


# -- local disks: flock ------------------------------------------------------------------------------


def test_a_second_run_on_the_same_experiment_is_refused(tmp_path):
    storage = open_storage(tmp_path)
    assert describe_holder(storage, str(tmp_path)) is None
    with ExperimentLock(storage, str(tmp_path)) as held:
        with pytest.raises(ExperimentLockedError) as error:
            ExperimentLock(storage, str(tmp_path)).acquire()
        assert held.lost() is None
        assert describe_holder(storage, str(tmp_path)).startswith(f"pid {os.getpid()} on ")
    assert f"experiment folder {tmp_path} is in use by another run (pid {os.getpid()} on " in str(error.value)
    assert "\n" not in str(error.value)
    assert describe_holder(storage, str(tmp_path)) is None
    with ExperimentLock(storage, str(tmp_path)):  # released on exit
        pass


def test_a_killed_holder_does_not_leave_the_lock_stuck(tmp_path, subprocess_env):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from rlrunner.storage import open_storage; "
            "from rlrunner.experiment.lock import ExperimentLock; "
            "ExperimentLock(open_storage(sys.argv[1]), sys.argv[1]).acquire(); "
            "print('locked', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ExperimentLockedError, match=f"pid {holder.pid}"):
            ExperimentLock(open_storage(tmp_path), str(tmp_path)).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = ExperimentLock(open_storage(tmp_path), str(tmp_path))
    lock.acquire()
    assert json.loads((tmp_path / ".rlrunner.lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_bad_timings_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"stale_after_s \(50\) must be more than twice heartbeat_s \(30\)"):
        ExperimentLock(open_storage(tmp_path), str(tmp_path), heartbeat_s=30, stale_after_s=50)


# -- object stores: the lease ------------------------------------------------------------------------


def test_a_lease_is_taken_released_and_taken_again(s3_store):
    clock, storage, experiment, _ = faked(s3_store)
    assert describe_holder(storage, experiment, clock=clock) is None
    first = ExperimentLock(storage, experiment, **FAST, clock=clock)
    first.acquire()
    clock.beating(first)
    assert first.lost() is None
    held = generations(storage, experiment)
    assert list(held) == [1] and held[1]["pid"] == os.getpid() and held[1]["released"] is False
    assert describe_holder(storage, experiment, clock=clock).startswith(
        f"pid {os.getpid()} on {held[1]['host']}, since "
    )
    clock.sleep(0.7)  # a few heartbeats
    assert (
        generations(storage, experiment)[1]["heartbeat_unix"] == held[1]["heartbeat_unix"] + 0.5
    )  # the beats at 0.25 s and 0.5 s
    assert first.lost() is None
    first.release()
    assert generations(storage, experiment)[1]["released"] is True
    assert describe_holder(storage, experiment, clock=clock) is None

    with ExperimentLock(storage, experiment, **FAST, clock=clock) as second:  # the next generation, at once
        assert second.lost() is None
        assert sorted(generations(storage, experiment)) == [1, 2]
    for _ in range(3):  # the new holder keeps only the last KEEP_GENERATIONS generations
        with ExperimentLock(storage, experiment, **FAST, clock=clock):
            pass
    assert sorted(generations(storage, experiment)) == [3, 4, 5]


def test_a_second_holder_is_refused_while_the_first_beats(s3_store):
    clock, storage, experiment, _ = faked(s3_store)
    with ExperimentLock(storage, experiment, **FAST, clock=clock) as holder:
        clock.beating(holder)
        clock.sleep(PAST_STALE_S)  # only the heartbeats keep the lease fresh
        with pytest.raises(ExperimentLockedError) as error:
            ExperimentLock(storage, experiment, **FAST, clock=clock).acquire()
    message = str(error.value)
    assert message.startswith(
        f"experiment folder {experiment} is in use by another run (pid {os.getpid()} on {os.uname().nodename}, since "
    )
    assert "last heartbeat" in message and "by the store's clock" in message and "lease generation 1" in message
    assert "\n" not in message
    assert list(generations(storage, experiment)) == [1]


def test_a_stale_lease_is_taken_over_and_the_old_holder_learns_it(s3_store):
    clock, storage, experiment, _ = faked(s3_store)
    frozen = ExperimentLock(storage, experiment, **FAST, clock=clock)
    frozen.acquire()
    freeze(frozen)
    newcomer = ExperimentLock(storage, experiment, **FAST, clock=clock)
    waited, refusals = acquire_when_free(newcomer, clock)
    assert refusals > 0 and waited >= FAST["stale_after_s"]  # refused while the lease was fresh, taken once stale
    assert sorted(generations(storage, experiment)) == [1, 2]
    assert generations(storage, experiment)[1]["released"] is False  # taken over, not released
    assert "no successful heartbeat" in frozen.lost()  # it knows before its next beat that it may have lost it
    assert frozen._impl._beat() is False  # its next beat (were it to wake up) sees who took over
    assert frozen.lost().startswith(
        f"the experiment lock {storage.join(experiment, '.rlrunner.lock')} was taken over by pid {os.getpid()}"
    )
    assert "lease generation 2" in frozen.lost()
    frozen.release()  # writes nothing: generation 1 is no longer ours
    assert generations(storage, experiment)[1]["released"] is False
    assert newcomer.lost() is None
    newcomer.release()


def test_a_lease_whose_holder_stopped_beating_is_waited_for_not_refused(s3_store, caplog):
    """A driver killed on another machine and relaunched here (a rescheduled pod): the new run waits for the dead
    holder's lease to lapse instead of failing with 'in use', which the launch script would not retry."""
    clock, storage, experiment, _ = faked(s3_store)
    frozen = ExperimentLock(storage, experiment, **FAST, clock=clock)
    frozen.acquire()
    freeze(frozen)
    clock.sleep(2 * FAST["heartbeat_s"] + 2.2)  # two beats missed by the store's clock, not yet stale
    newcomer = ExperimentLock(storage, experiment, **FAST, clock=clock)
    started = clock.monotonic()
    with caplog.at_level(logging.WARNING, logger="rlrunner.experiment.lock"):
        newcomer.acquire()  # one call: it waits, then takes the lease over
    assert clock.monotonic() - started > 0.1
    assert "has missed its heartbeats: waiting" in caplog.text
    assert sorted(generations(storage, experiment)) == [1, 2]
    newcomer.release()


def test_exactly_one_of_two_racers_takes_over_a_stale_lease(s3_store):
    clock, storage, experiment, on_clock = faked(s3_store)
    frozen = ExperimentLock(storage, experiment, **FAST, clock=clock)
    frozen.acquire()
    freeze(frozen)
    stores = [
        on_clock(open_storage(storage.url, storage.storage_options)) for _ in range(2)
    ]  # one connection per racer
    for store in stores:
        store.list(experiment)  # connected before the race, so that they start together
    clock.sleep(PAST_STALE_S)  # stale by the store's clock
    barrier, outcomes = threading.Barrier(2), []

    def race(store) -> None:
        contender = ExperimentLock(store, experiment, **FAST, clock=clock)
        barrier.wait()
        try:
            contender.acquire()
            outcomes.append(contender)
        except ExperimentLockedError as exc:
            outcomes.append(str(exc))

    threads = [threading.Thread(target=race, args=(store,)) for store in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [o for o in outcomes if isinstance(o, ExperimentLock)]
    losers = [o for o in outcomes if isinstance(o, str)]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    assert "is in use by another run" in losers[0]
    assert sorted(generations(storage, experiment)) == [1, 2]
    winners[0].release()


def test_racers_for_a_released_lease_get_it_once_each_round(s3_store):
    storage, experiment = remote(s3_store)
    ExperimentLock(storage, experiment, **FAST).__enter__().release()
    stores = [open_storage(storage.url, storage.storage_options) for _ in range(3)]  # one connection per racer
    for store in stores:
        store.list(experiment)  # connected before the race, so that they start together
    # a lease that is not released is not taken here: the winner's stays fresh however slowly a loaded machine runs
    # the round (with FAST's 2 s, a racer held up 3 s would find it stale and take it over, as it should)
    patient = {**FAST, "stale_after_s": 60.0}
    for _ in range(3):
        barrier, winners = threading.Barrier(3), []

        def race(store) -> None:
            contender = ExperimentLock(store, experiment, **patient)
            barrier.wait()
            try:
                contender.acquire()
                winners.append(contender)
            except ExperimentLockedError:
                pass

        threads = [threading.Thread(target=race, args=(store,)) for store in stores]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(winners) == 1
        winners[0].release()


def test_a_released_lease_is_taken_without_waiting(s3_store):
    clock, storage, experiment, _ = faked(s3_store)
    patient = {"heartbeat_s": 30.0, "stale_after_s": 300.0}
    ExperimentLock(storage, experiment, **patient, clock=clock).__enter__().release()
    start = clock.monotonic()
    with ExperimentLock(storage, experiment, **patient, clock=clock):
        assert clock.monotonic() == start  # no sleep at all


def test_a_holder_with_a_skewed_clock_keeps_its_lease(s3_store):
    """Staleness is judged by the store's clock: a holder whose own clock is an hour behind still holds it."""
    storage, experiment = remote(s3_store)
    with ExperimentLock(storage, experiment, **FAST) as holder:
        freeze(holder)
        url = storage.join(experiment, ".rlrunner.lock", "000000000001.json")
        record = json.loads(storage.read_bytes(url))
        storage.write_bytes(
            url, json.dumps({**record, "heartbeat_unix": time.time() - 3600}).encode()
        )  # a beat, skewed
        with pytest.raises(ExperimentLockedError, match="s ago by the store's clock"):
            ExperimentLock(storage, experiment, **FAST).acquire()


def test_a_killed_holder_on_this_machine_is_taken_over_at_once(s3_store, subprocess_env):
    """The launch script relaunches a killed driver on the same machine: it must not wait stale_after_s."""
    storage, experiment = remote(s3_store)
    holder = spawn_holder(storage, experiment, subprocess_env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ExperimentLockedError, match=f"pid {holder.pid} on"):
            ExperimentLock(storage, experiment, **FAST).acquire()  # alive: refused
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    clock = FakeClock()  # the holder above ran on the real clock, in its own process: this one only counts sleeps
    start = clock.monotonic()
    with ExperimentLock(storage, experiment, heartbeat_s=30.0, stale_after_s=300.0, clock=clock):
        assert clock.monotonic() == start  # no sleep at all
        assert sorted(generations(storage, experiment)) == [1, 2]


def test_storage_errors_while_beating_lose_the_lease_only_after_stale_after_s(moto_endpoint, s3_store, caplog):
    import boto3

    _, options = s3_store
    s3 = boto3.client(
        "s3",
        endpoint_url=moto_endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    bucket = f"rlrunner-lock-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    storage = open_storage(f"s3://{bucket}", options)
    experiment = storage.join(storage.url, "exp")

    def drop_bucket() -> None:  # every request to it now fails (NoSuchBucket)
        for item in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=item["Key"])
        s3.delete_bucket(Bucket=bucket)

    clock = FakeClock()  # lost() counts on the lease's monotonic clock: no store clock involved
    holder = ExperimentLock(storage, experiment, heartbeat_s=0.25, stale_after_s=2.5, clock=clock)
    with caplog.at_level(logging.WARNING, logger="rlrunner.experiment.lock"):
        holder.acquire()
        clock.beating(holder)
        drop_bucket()
        clock.sleep(1.0)
        assert "experiment lock heartbeat failed" in caplog.text
        assert holder.lost() is None  # errors for less than stale_after_s: still ours
        s3.create_bucket(Bucket=bucket)
        clock.sleep(1.0)
        assert holder.lost() is None
        assert list(generations(storage, experiment)) == [1]  # the next beat wrote it again
        drop_bucket()
        clock.sleep(3.5)
        reason = holder.lost()
        assert reason is not None and "no successful heartbeat" in reason and "last error" in reason
        holder.release()


def test_a_store_without_conditional_create_gets_a_best_effort_lock(monkeypatch, caplog):
    monkeypatch.setattr(lock_module, "SETTLE_S", 0.1)  # shorter than a heartbeat, as it is against the default ones
    monkeypatch.setattr(lock_module, "_warned_best_effort", set())
    clock = FakeClock()  # the settle waits pass at once
    storage = StampedStorage(open_storage(f"memory://rlrunner-lock-{uuid.uuid4().hex[:8]}"), clock, {})
    assert not storage.supports_exclusive_create and not storage.is_local
    experiment = storage.join(storage.url, "exp")
    with caplog.at_level(logging.WARNING, logger="rlrunner.experiment.lock"):
        with ExperimentLock(storage, experiment, **FAST, clock=clock) as first:
            with pytest.raises(ExperimentLockedError, match=f"pid {os.getpid()}"):
                ExperimentLock(storage, experiment, **FAST, clock=clock).acquire()
            assert first.lost() is None
        with ExperimentLock(storage, experiment, **FAST, clock=clock):
            pass
    assert caplog.text.count("has no conditional create: the experiment lock is best effort") == 1
    assert sorted(generations(storage, experiment)) == [1, 2]
