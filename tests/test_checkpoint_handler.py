"""CheckpointHandler on real files, with a small file-writing backend (no Ray): commit, discovery, resume, retention, lock."""

from __future__ import annotations

import io
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlrunner.checkpoint import layout
from rlrunner.checkpoint.handler import COMPLETE, CORRUPT, INCOMPLETE, CheckpointHandler, scan_checkpoints
from rlrunner.checkpoint.lock import ExperimentLock
from rlrunner.checkpoint.manifest import file_record, read_manifest
from rlrunner.errors import CheckpointError, CheckpointSaveError, ExperimentLockedError

FINGERPRINT = {"model.config.hidden_size": 32, "actor.optim.lr": 0.001, "actor.optim.betas": [0.9, 0.99]}


class FileBackend:
    """A second CheckpointManager implementation: one torch file per rank. Shows the handler is backend-agnostic."""

    backend = "test-files"

    def __init__(self, world_size: int = 2, payload_bytes: int = 4096):
        self.world_size = world_size
        self.payload_bytes = payload_bytes
        self.loaded: list[dict] = []

    def start_save(self, path: Path, step: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.written = {}
        for rank in range(self.world_size):
            name = f"rank_{rank}.pt"
            buffer = io.BytesIO()
            torch.save({"step": step, "rank": rank, "weights": torch.full((self.payload_bytes // 4,), float(step))}, buffer)
            (path / name).write_bytes(buffer.getvalue())
            self.written[name] = file_record(path / name)

    def finish_save(self, wait: bool) -> dict[str, dict]:
        return self.written

    def load(self, path: Path) -> None:
        self.loaded = [torch.load(path / f"rank_{r}.pt", weights_only=True) for r in range(self.world_size)]


def make_handler(experiment: Path, interval: int = 2, keep: int | None = None, fingerprint=None) -> CheckpointHandler:
    return CheckpointHandler(experiment, interval, keep, fingerprint or FINGERPRINT)


def save_steps(handler: CheckpointHandler, steps, backend=None) -> None:
    backend = backend or FileBackend()
    for step in steps:
        handler.save(step, backend, {"runner": {"global_step": step}})


def test_save_commits_the_layout_with_manifest_written_last(tmp_path):
    handler = make_handler(tmp_path / "exp")
    path = handler.save(4, FileBackend(), {"runner": {"global_step": 4}}, write_extra=lambda d: (d / "extra.txt").write_text("x"))
    assert path == tmp_path / "exp" / "checkpoints" / "global_step_4"
    assert sorted(p.name for p in path.iterdir()) == ["actor", "data", "extra.txt", "manifest.json"]
    manifest = read_manifest(path)
    assert manifest["step"] == 4 and manifest["world_size"] == 2 and manifest["backend"] == "test-files"
    assert set(manifest["files"]) == {"actor/rank_0.pt", "actor/rank_1.pt", "data/data.pt", "extra.txt"}
    assert manifest["files"]["data/data.pt"] == file_record(path / "data" / "data.pt")
    assert manifest["fingerprint"] == FINGERPRINT
    assert torch.load(path / "data" / "data.pt", weights_only=True) == {"runner": {"global_step": 4}}
    assert layout.leftover_dirs(handler.root) == []


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    handler = make_handler(tmp_path)
    handler.save(2, FileBackend(world_size=3), {"v": 1})
    handler.save(2, FileBackend(world_size=1), {"v": 2})
    path = handler.root / "global_step_2"
    assert sorted(p.name for p in (path / "actor").iterdir()) == ["rank_0.pt"]
    assert read_manifest(path)["world_size"] == 1
    assert layout.leftover_dirs(handler.root) == []


def test_failed_write_commits_nothing_and_names_the_cause(tmp_path):
    handler = make_handler(tmp_path)
    save_steps(handler, [2])
    # A real write failure from the OS: a file-size limit makes the big shard's write fail (EFBIG),
    # the same path a full disk (ENOSPC) takes.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(CheckpointSaveError) as error:
            handler.save(4, FileBackend(payload_bytes=1 << 20), {"runner": {"global_step": 4}})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(error.value)
    assert message.startswith("saving global_step_4 failed: ")
    assert "OSError: [Errno 27] File too large" in message and "the newest complete checkpoint is still global_step_2" in message
    assert f" free on the disk holding {handler.root}" in message
    assert "\n" not in message
    assert [s.path.name for s in scan_checkpoints(handler.root)] == ["global_step_2"]
    assert layout.leftover_dirs(handler.root) == []
    assert error.value.permanent and error.value.exit_code == 4  # no space: a relaunch would fail the same way


def test_a_save_that_fails_for_another_reason_may_be_relaunched(tmp_path):
    class Crashing(FileBackend):
        def finish_save(self, wait):
            raise RuntimeError("worker lost mid-save")

    with pytest.raises(CheckpointSaveError) as error:
        make_handler(tmp_path).save(2, Crashing(), {})
    assert not error.value.permanent and error.value.exit_code == 1


def test_scan_reports_complete_incomplete_and_corrupt(tmp_path):
    handler = make_handler(tmp_path)
    save_steps(handler, [2, 4, 6])
    (handler.root / "global_step_4" / "manifest.json").unlink()
    shard = handler.root / "global_step_6" / "actor" / "rank_1.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    (handler.root / "global_step_8").mkdir()
    statuses = {s.path.name: s for s in scan_checkpoints(handler.root)}
    assert [s.status for s in scan_checkpoints(handler.root)] == [INCOMPLETE, CORRUPT, INCOMPLETE, COMPLETE]
    assert "no manifest.json" in statuses["global_step_4"].reasons[0]
    assert statuses["global_step_6"].reasons == [f"actor/rank_1.pt: {shard.stat().st_size} bytes, the manifest says {shard.stat().st_size + 10} (truncated or rewritten)"]


def test_a_flipped_byte_is_caught_by_the_checksum_only(tmp_path):
    handler = make_handler(tmp_path)
    save_steps(handler, [2])
    shard = handler.root / "global_step_2" / "actor" / "rank_0.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert scan_checkpoints(handler.root, checksums=False)[0].status == COMPLETE
    deep = scan_checkpoints(handler.root, checksums=True)[0]
    assert deep.status == CORRUPT and "checksum" in deep.reasons[0] and "(corrupted)" in deep.reasons[0]


# -- resume -----------------------------------------------------------------------------------


def test_null_resume_dir_starts_fresh_only_without_checkpoints(tmp_path):
    handler = make_handler(tmp_path)
    assert handler.find_resume(None) is None
    save_steps(handler, [2])
    with pytest.raises(CheckpointError, match="already has checkpoints \\(newest global_step_2\\) and runner.resume_dir is null"):
        handler.find_resume(None)


def test_auto_takes_the_newest_complete_and_logs_each_skip(tmp_path, caplog):
    handler = make_handler(tmp_path)
    save_steps(handler, [2, 4, 6, 8])
    (handler.root / "global_step_8" / "data" / "data.pt").unlink()
    (handler.root / "global_step_6" / "manifest.json").unlink()
    (handler.root / f"{layout.STAGING_PREFIX}global_step_10-abc").mkdir()  # a save killed halfway
    with caplog.at_level(logging.INFO, logger="rlrunner.checkpoint.handler"):
        checkpoint = handler.find_resume("auto")
    assert checkpoint.step == 4 and checkpoint.path == handler.root / "global_step_4"
    assert "skipping global_step_8: corrupt (data/data.pt: missing)" in caplog.text
    assert "skipping global_step_6: incomplete (no manifest.json (the save did not finish))" in caplog.text
    assert "resuming from" in caplog.text and "global_step_4 (step 4)" in caplog.text


def test_auto_with_nothing_usable_starts_fresh_and_says_so(tmp_path, caplog):
    handler = make_handler(tmp_path)
    (handler.root / "global_step_2").mkdir(parents=True)
    with caplog.at_level(logging.INFO, logger="rlrunner.checkpoint.handler"):
        assert handler.find_resume("auto") is None
    assert "no complete checkpoint" in caplog.text and "starting fresh" in caplog.text


def test_step_comes_from_the_manifest_not_the_name(tmp_path):
    handler = make_handler(tmp_path)
    save_steps(handler, [4])
    renamed = tmp_path / "renamed_checkpoint"
    os.rename(handler.root / "global_step_4", renamed)
    assert handler.find_resume(str(renamed)).step == 4


def test_explicit_resume_dir_accepts_trailing_slash_relative_path_and_symlink(tmp_path, monkeypatch):
    handler = make_handler(tmp_path / "exp")
    save_steps(handler, [2])
    target = handler.root / "global_step_2"
    assert handler.find_resume(str(target) + "/").path == target
    monkeypatch.chdir(handler.root)
    assert handler.find_resume("global_step_2").path == target
    assert handler.find_resume("./global_step_2//").path == target
    link = tmp_path / "latest"
    link.symlink_to(target, target_is_directory=True)
    checkpoint = handler.find_resume(str(link))
    assert checkpoint.path == target and checkpoint.step == 2


@pytest.mark.parametrize(
    "breakage, expected",
    [
        ("nonexistent", "runner.resume_dir does not exist: "),
        ("file", "runner.resume_dir is not a directory: "),
        ("no_manifest", "is not a complete checkpoint: no manifest.json (the save did not finish)"),
        ("experiment_dir", "(it holds global_step_* folders: name one of them, or use runner.resume_dir=auto)"),
        ("missing_shard", "fails verification: actor/rank_1.pt: missing"),
        ("missing_data", "fails verification: data/data.pt: missing"),
        ("truncated_shard", "fails verification: actor/rank_0.pt: "),
        ("garbled_manifest", "is not a complete checkpoint: manifest.json is unreadable (JSONDecodeError)"),
    ],
)
def test_every_bad_resume_dir_is_a_clear_error(tmp_path, breakage, expected):
    handler = make_handler(tmp_path / "exp")
    save_steps(handler, [2])
    path = handler.root / "global_step_2"
    if breakage == "nonexistent":
        path = tmp_path / "nowhere" / "global_step_9"
    elif breakage == "file":
        path = path / "data" / "data.pt"
    elif breakage == "no_manifest":
        (path / "manifest.json").unlink()
    elif breakage == "experiment_dir":
        path = tmp_path / "exp"
    elif breakage == "missing_shard":
        (path / "actor" / "rank_1.pt").unlink()
    elif breakage == "missing_data":
        (path / "data" / "data.pt").unlink()
    elif breakage == "truncated_shard":
        (path / "actor" / "rank_0.pt").write_bytes(b"short")
    elif breakage == "garbled_manifest":
        (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError) as error:
        handler.find_resume(str(path))
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


def test_a_checkpoint_of_another_model_or_optimizer_is_refused_naming_the_keys(tmp_path):
    save_steps(make_handler(tmp_path), [2])
    changed = {**FINGERPRINT, "model.config.hidden_size": 64, "actor.optim.lr": 0.01}
    with pytest.raises(CheckpointError) as error:
        make_handler(tmp_path, fingerprint=changed).find_resume("auto")
    message = str(error.value)
    assert "was saved with a different model/optimizer config" in message
    assert "actor.optim.lr (checkpoint 0.001, run 0.01)" in message
    assert "model.config.hidden_size (checkpoint 32, run 64)" in message


def test_load_restores_the_backend_state_and_returns_data_state(tmp_path):
    handler = make_handler(tmp_path)
    save_steps(handler, [2, 4])
    backend = FileBackend()
    data = handler.load(handler.find_resume("auto"), backend)
    assert data == {"runner": {"global_step": 4}}
    assert [s["rank"] for s in backend.loaded] == [0, 1] and backend.loaded[0]["step"] == 4


def test_load_refuses_a_checkpoint_of_another_backend(tmp_path):
    handler = make_handler(tmp_path)
    save_steps(handler, [2])
    other = FileBackend()
    other.backend = "fsdp2-dcp"
    with pytest.raises(CheckpointError, match="was written by the test-files backend, this run uses fsdp2-dcp"):
        handler.load(handler.find_resume("auto"), other)


# -- retention --------------------------------------------------------------------------------


def test_retention_holds_across_restarts_and_keeps_the_newest(tmp_path):
    save_steps(make_handler(tmp_path, keep=2), [2, 4, 6])
    assert [s.step for s in scan_checkpoints(tmp_path / "checkpoints")] == [6, 4]
    # a new run (new handler) counts what is on disk, including a corrupt newer folder it must not count
    handler = make_handler(tmp_path, keep=2)
    (handler.root / "global_step_7").mkdir()
    save_steps(handler, [8])
    assert [(s.step, s.status) for s in scan_checkpoints(handler.root)] == [(8, COMPLETE), (7, INCOMPLETE), (6, COMPLETE)]
    save_steps(make_handler(tmp_path, keep=1), [10])
    assert [s.step for s in scan_checkpoints(handler.root) if s.status == COMPLETE] == [10]


class BackgroundBackend(FileBackend):
    """Writes nothing until told to: a save whose files are still being written in the background."""

    def __init__(self):
        super().__init__()
        self.done = False

    def start_save(self, path, step):
        self.args = (path, step)

    def finish_save(self, wait):
        if not (self.done or wait):
            return None
        super().start_save(*self.args)
        return self.written


def test_a_background_save_commits_only_once_written_and_only_then_retains(tmp_path):
    handler = make_handler(tmp_path, keep=1)
    save_steps(handler, [2])
    backend = BackgroundBackend()
    pending = handler.begin_save(4, backend, {"runner": {"global_step": 4}})
    assert handler.finish_save(pending, wait=False) is None  # still writing: no commit, nothing deleted
    assert [s.step for s in scan_checkpoints(handler.root)] == [2] and pending.staging.is_dir()
    backend.done = True
    assert handler.finish_save(pending, wait=False) == handler.root / "global_step_4"
    assert [(s.step, s.status) for s in scan_checkpoints(handler.root, checksums=True)] == [(4, COMPLETE)]
    # the data position is the one at the time the save began
    assert torch.load(handler.root / "global_step_4" / "data" / "data.pt", weights_only=True) == {"runner": {"global_step": 4}}


def test_a_background_write_that_fails_never_commits(tmp_path):
    class FailingBackground(BackgroundBackend):
        def finish_save(self, wait):
            raise OSError(28, "No space left on device")

    handler = make_handler(tmp_path)
    save_steps(handler, [2])
    pending = handler.begin_save(4, FailingBackground(), {})
    with pytest.raises(CheckpointSaveError, match="saving global_step_4 failed: OSError: .*No space left on device") as error:
        handler.finish_save(pending, wait=False)
    assert error.value.exit_code == 4
    assert [s.step for s in scan_checkpoints(handler.root)] == [2] and layout.leftover_dirs(handler.root) == []


def test_the_checkpoint_just_committed_is_never_deleted(tmp_path):
    handler = make_handler(tmp_path, keep=1)
    save_steps(handler, [6])
    save_steps(handler, [3])  # an older step committed while a newer one exists (e.g. a branch not moved aside)
    assert sorted(s.step for s in scan_checkpoints(handler.root)) == [3, 6]


def test_an_explicit_resume_from_an_older_checkpoint_starts_a_new_branch(tmp_path, caplog):
    handler = make_handler(tmp_path, keep=1)
    handler.max_keep = None
    save_steps(handler, [2, 4, 6])
    (handler.root / "global_step_5").mkdir()  # an unfinished save of the old branch goes too
    checkpoint = handler.find_resume(str(handler.root / "global_step_2"))
    with caplog.at_level(logging.WARNING, logger="rlrunner.checkpoint.handler"):
        assert handler.start_branch(checkpoint) == ["global_step_4", "global_step_5", "global_step_6"]
    [moved_to] = list((handler.root / layout.ABANDONED_DIR).iterdir())
    assert sorted(p.name for p in moved_to.iterdir()) == ["global_step_4", "global_step_5", "global_step_6"]
    assert read_manifest(moved_to / "global_step_6")["step"] == 6  # moved whole, never deleted
    assert f"moved the old branch's newer checkpoints global_step_4, global_step_5, global_step_6 to {moved_to}" in caplog.text
    # the live branch is all that discovery and retention see now
    assert [s.step for s in scan_checkpoints(handler.root)] == [2]
    handler.max_keep = 1
    save_steps(handler, [3])
    assert [s.step for s in scan_checkpoints(handler.root)] == [3]
    assert handler.find_resume("auto").step == 3
    assert handler.start_branch(handler.find_resume("auto")) == []  # resuming the newest moves nothing


def test_resuming_from_another_experiment_moves_this_one_s_newer_steps_aside(tmp_path):
    other = make_handler(tmp_path / "other")
    save_steps(other, [4])
    handler = make_handler(tmp_path / "this")
    save_steps(handler, [2, 4, 6])
    moved = handler.start_branch(handler.find_resume(str(other.root / "global_step_4")))
    assert moved == ["global_step_4", "global_step_6"]
    assert [s.step for s in scan_checkpoints(handler.root)] == [2]


def test_leftovers_of_killed_saves_are_removed_at_start(tmp_path):
    handler = make_handler(tmp_path)
    save_steps(handler, [2, 6])
    (handler.root / f"{layout.STAGING_PREFIX}global_step_4-dead").mkdir()
    (handler.root / f"{layout.TRASH_PREFIX}global_step_0-dead").mkdir()
    # killed between the two renames of a re-save of step 6: the old global_step_6 was set aside, the new one
    # is still staged. The old one comes back; a set-aside copy whose replacement did arrive is deleted.
    os.rename(handler.root / "global_step_6", handler.root / f"{layout.REPLACED_PREFIX}global_step_6-abcd1234")
    (handler.root / f"{layout.STAGING_PREFIX}global_step_6-feed0000").mkdir()
    shutil.copytree(handler.root / "global_step_2", handler.root / f"{layout.REPLACED_PREFIX}global_step_2-00000000")
    handler.remove_leftovers()
    assert sorted(p.name for p in handler.root.iterdir()) == ["global_step_2", "global_step_6"]
    assert [s.status for s in scan_checkpoints(handler.root, checksums=True)] == [COMPLETE, COMPLETE]


def test_schedule_description_mentions_disabled_periodic_saves(tmp_path):
    assert "periodic checkpoints are off (the last step is still saved)" in make_handler(tmp_path, interval=0).describe_schedule()
    assert "every 50 steps" in make_handler(tmp_path, interval=50, keep=3).describe_schedule()


# -- lock -------------------------------------------------------------------------------------


def test_a_second_run_on_the_same_experiment_is_refused(tmp_path):
    with ExperimentLock(tmp_path):
        with pytest.raises(ExperimentLockedError) as error:
            ExperimentLock(tmp_path).acquire()
    assert f"experiment folder {tmp_path} is in use by another run (pid {os.getpid()} on " in str(error.value)
    with ExperimentLock(tmp_path):  # released on exit
        pass


def test_a_killed_holder_does_not_leave_the_lock_stuck(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from rlrunner.checkpoint.lock import ExperimentLock; "
         "ExperimentLock(Path(sys.argv[1])).acquire(); print('locked', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ExperimentLockedError, match=f"pid {holder.pid}"):
            ExperimentLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = ExperimentLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / ".rlrunner.lock").read_text())["pid"] == os.getpid()
    lock.release()
