"""CheckpointHandler on real files and on a real S3 API (moto), with a small file-writing backend (no Ray):
commit, discovery, resume, retention, branches, leftovers (the experiment lock: tests/test_lock.py)."""

from __future__ import annotations

import io
import logging
import os
import resource
import shutil
from pathlib import Path

import pytest
import torch

from rlrunner.checkpoint import layout
from rlrunner.checkpoint.handler import COMPLETE, CORRUPT, INCOMPLETE, CheckpointHandler, scan_checkpoints
from rlrunner.checkpoint.manifest import file_record, read_manifest
from rlrunner.errors import CheckpointError, CheckpointSaveError
from rlrunner.storage import Storage, open_storage

FINGERPRINT = {"model.config.hidden_size": 32, "actor.optim.lr": 0.001, "actor.optim.betas": [0.9, 0.99]}


class FileBackend:
    """A second CheckpointManager implementation: one torch file per rank. Shows the handler is backend-agnostic."""

    backend = "test-files"

    def __init__(self, world_size: int = 2, payload_bytes: int = 4096, storage: Storage | None = None):
        self.world_size = world_size
        self.payload_bytes = payload_bytes
        self.storage = storage
        self.loaded: list[dict] = []

    def start_save(self, url: str, step: int) -> None:
        storage = self.storage or open_storage(url)
        self.written = {}
        for rank in range(self.world_size):
            name = f"rank_{rank}.pt"
            buffer = io.BytesIO()
            torch.save({"step": step, "rank": rank, "weights": torch.full((self.payload_bytes // 4,), float(step))}, buffer)
            with storage.open_write(storage.join(url, name)) as out:
                out.write(buffer.getvalue())
            self.written[name] = out.record().as_dict()

    def finish_save(self, wait: bool) -> dict[str, dict]:
        return self.written

    def load(self, url: str) -> None:
        storage = self.storage or open_storage(url)
        self.loaded = [torch.load(io.BytesIO(storage.read_bytes(storage.join(url, f"rank_{r}.pt"))), weights_only=True)
                       for r in range(self.world_size)]


class Store:
    """An experiment folder on one storage, with the file surgery the tests do (truncate, delete, a leftover)."""

    def __init__(self, storage: Storage, experiment: str):
        self.storage, self.experiment = storage, experiment

    def handler(self, interval: int = 2, keep: int | None = None, fingerprint=None, name: str | None = None) -> CheckpointHandler:
        experiment = self.storage.join(self.experiment, name) if name else self.experiment
        return CheckpointHandler(self.storage, experiment, interval, keep, fingerprint or FINGERPRINT)

    def backend(self, **kwargs) -> FileBackend:
        return FileBackend(storage=self.storage, **kwargs)

    def url(self, handler: CheckpointHandler, *parts: str) -> str:
        return self.storage.join(handler.root, *parts)

    def read(self, url: str) -> bytes:
        return self.storage.read_bytes(url)

    def write(self, url: str, data: bytes) -> None:
        self.storage.write_bytes(url, data)

    def delete(self, url: str) -> None:
        self.storage.delete(url)

    def partial_folder(self, url: str) -> None:
        """A folder a killed save left: some bytes, no manifest (an empty folder does not exist on an object store)."""
        self.write(self.storage.join(url, "actor", "__0_0.distcp"), b"partial")


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        storage = open_storage(str(tmp_path))
        return Store(storage, storage.join(storage.url, "exp"))
    url, options = request.getfixturevalue("s3_store")
    return Store(open_storage(url, options), url + "/exp")


def make_handler(experiment: Path, interval: int = 2, keep: int | None = None, fingerprint=None) -> CheckpointHandler:
    """A handler on a local experiment folder (the local-only tests)."""
    storage = open_storage(str(experiment))
    return CheckpointHandler(storage, storage.url, interval, keep, fingerprint or FINGERPRINT)


def save_steps(handler: CheckpointHandler, steps, backend=None) -> None:
    backend = backend or FileBackend(storage=handler.storage)
    for step in steps:
        handler.save(step, backend, {"runner": {"global_step": step}})


def steps_of(handler: CheckpointHandler, checksums: bool = False, complete_only: bool = False) -> list[int]:
    return [s.step for s in scan_checkpoints(handler.storage, handler.root, checksums) if s.status == COMPLETE or not complete_only]


def test_save_commits_the_layout_with_manifest_written_last(store):
    handler = store.handler()
    url = handler.save(4, store.backend(), {"runner": {"global_step": 4}}, write_extra=lambda d: Path(d, "extra.txt").write_text("x"))
    assert url == store.storage.join(store.experiment, "checkpoints", "global_step_4")
    assert store.storage.list(url) == ["actor", "data", "extra.txt", "manifest.json"]
    manifest = read_manifest(store.storage, url)
    assert manifest["step"] == 4 and manifest["world_size"] == 2 and manifest["backend"] == "test-files"
    assert set(manifest["files"]) == {"actor/rank_0.pt", "actor/rank_1.pt", "data/data.pt", "extra.txt"}
    assert manifest["files"]["data/data.pt"] == file_record(store.storage, url + "/data/data.pt")
    assert manifest["fingerprint"] == FINGERPRINT
    assert torch.load(io.BytesIO(store.read(url + "/data/data.pt")), weights_only=True) == {"runner": {"global_step": 4}}
    assert store.storage.list(handler.root) == ["global_step_4"]  # no staging or trash left behind


def test_saving_a_step_again_replaces_it_whole(store):
    handler = store.handler()
    handler.save(2, store.backend(world_size=3), {"v": 1})
    handler.save(2, store.backend(world_size=1), {"v": 2})
    url = store.url(handler, "global_step_2")
    assert store.storage.list(url + "/actor") == ["rank_0.pt"]
    assert read_manifest(store.storage, url)["world_size"] == 1
    assert store.storage.list(handler.root) == ["global_step_2"]


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
    assert "File too large" in message and "the newest complete checkpoint is still global_step_2" in message
    assert f" free on the disk holding {handler.root}" in message
    assert "\n" not in message
    assert [s.name for s in scan_checkpoints(handler.storage, handler.root)] == ["global_step_2"]
    assert layout.leftover_dirs(handler.storage, handler.root) == []
    assert error.value.permanent and error.value.exit_code == 4  # no space: a relaunch would fail the same way


def test_a_save_that_fails_for_another_reason_may_be_relaunched(store):
    class Crashing(FileBackend):
        def finish_save(self, wait):
            raise RuntimeError("worker lost mid-save")

    handler = store.handler()
    with pytest.raises(CheckpointSaveError) as error:
        handler.save(2, Crashing(storage=store.storage), {})
    assert not error.value.permanent and error.value.exit_code == 1
    assert store.storage.list(handler.root) == []  # the unfinished folder went too


def test_scan_reports_complete_incomplete_and_corrupt(store):
    handler = store.handler()
    save_steps(handler, [2, 4, 6])
    store.delete(store.url(handler, "global_step_4", "manifest.json"))
    shard = store.url(handler, "global_step_6", "actor", "rank_1.pt")
    data = store.read(shard)
    store.write(shard, data[:-10])  # a truncated object
    store.partial_folder(store.url(handler, "global_step_8"))
    statuses = {s.name: s for s in scan_checkpoints(store.storage, handler.root)}
    assert [s.status for s in scan_checkpoints(store.storage, handler.root)] == [INCOMPLETE, CORRUPT, INCOMPLETE, COMPLETE]
    assert "no manifest.json" in statuses["global_step_4"].reasons[0]
    assert statuses["global_step_6"].reasons == [f"actor/rank_1.pt: {len(data) - 10} bytes, the manifest says {len(data)} (truncated or rewritten)"]


def test_a_flipped_byte_is_caught_by_the_checksum_only(store):
    handler = store.handler()
    save_steps(handler, [2])
    shard = store.url(handler, "global_step_2", "actor", "rank_0.pt")
    data = bytearray(store.read(shard))
    data[len(data) // 2] ^= 0xFF
    store.write(shard, bytes(data))
    assert scan_checkpoints(store.storage, handler.root, checksums=False)[0].status == COMPLETE
    deep = scan_checkpoints(store.storage, handler.root, checksums=True)[0]
    assert deep.status == CORRUPT and "checksum" in deep.reasons[0] and "(corrupted)" in deep.reasons[0]


# -- resume -----------------------------------------------------------------------------------


def test_null_resume_dir_starts_fresh_only_without_checkpoints(store):
    handler = store.handler()
    assert handler.find_resume(None) is None
    save_steps(handler, [2])
    with pytest.raises(CheckpointError, match="already has checkpoints \\(newest global_step_2\\) and runner.resume_dir is null"):
        handler.find_resume(None)


def test_auto_takes_the_newest_complete_and_logs_each_skip(store, caplog):
    handler = store.handler()
    save_steps(handler, [2, 4, 6, 8])
    store.delete(store.url(handler, "global_step_8", "data", "data.pt"))
    store.delete(store.url(handler, "global_step_6", "manifest.json"))
    store.partial_folder(store.url(handler, "global_step_10"))  # a save killed halfway
    with caplog.at_level(logging.INFO, logger="rlrunner.checkpoint.handler"):
        checkpoint = handler.find_resume("auto")
    assert checkpoint.step == 4 and checkpoint.url == store.url(handler, "global_step_4")
    assert "skipping global_step_10: incomplete" in caplog.text
    assert "skipping global_step_8: corrupt (data/data.pt: missing)" in caplog.text
    assert "skipping global_step_6: incomplete (no manifest.json (the save did not finish))" in caplog.text
    assert "resuming from" in caplog.text and "global_step_4 (step 4)" in caplog.text


def test_auto_with_nothing_usable_starts_fresh_and_says_so(store, caplog):
    handler = store.handler()
    store.partial_folder(store.url(handler, "global_step_2"))
    with caplog.at_level(logging.INFO, logger="rlrunner.checkpoint.handler"):
        assert handler.find_resume("auto") is None
    assert "no complete checkpoint" in caplog.text and "starting fresh" in caplog.text


def test_step_comes_from_the_manifest_not_the_name(store):
    handler = store.handler()
    save_steps(handler, [4])
    renamed = store.storage.join(store.experiment, "renamed_checkpoint")
    store.storage.copy_tree(store.url(handler, "global_step_4"), renamed)
    assert handler.find_resume(renamed).step == 4


def test_explicit_resume_dir_accepts_trailing_slash_relative_path_and_symlink(tmp_path, monkeypatch):
    handler = make_handler(tmp_path / "exp")
    save_steps(handler, [2])
    target = handler.storage.join(handler.root, "global_step_2")
    assert handler.find_resume(target + "/").url == target
    monkeypatch.chdir(handler.root)
    assert handler.find_resume("global_step_2").url == target
    assert handler.find_resume("./global_step_2//").url == target
    assert handler.find_resume("file://" + target).url == target
    link = tmp_path / "latest"
    link.symlink_to(target, target_is_directory=True)
    checkpoint = handler.find_resume(str(link))
    assert checkpoint.url == target and checkpoint.step == 2


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
def test_every_bad_resume_dir_is_a_clear_error(store, breakage, expected):
    handler = store.handler()
    save_steps(handler, [2])
    url = store.url(handler, "global_step_2")
    if breakage == "nonexistent":
        url = store.storage.join(store.experiment, "nowhere", "global_step_9")
    elif breakage == "file":
        url = url + "/data/data.pt"
    elif breakage == "no_manifest":
        store.delete(url + "/manifest.json")
    elif breakage == "experiment_dir":
        url = store.experiment
    elif breakage == "missing_shard":
        store.delete(url + "/actor/rank_1.pt")
    elif breakage == "missing_data":
        store.delete(url + "/data/data.pt")
    elif breakage == "truncated_shard":
        store.write(url + "/actor/rank_0.pt", b"short")
    elif breakage == "garbled_manifest":
        store.write(url + "/manifest.json", b"{not json")
    with pytest.raises(CheckpointError) as error:
        handler.find_resume(url)
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


def test_a_checkpoint_of_another_model_or_optimizer_is_refused_naming_the_keys(store):
    save_steps(store.handler(), [2])
    changed = {**FINGERPRINT, "model.config.hidden_size": 64, "actor.optim.lr": 0.01}
    with pytest.raises(CheckpointError) as error:
        store.handler(fingerprint=changed).find_resume("auto")
    message = str(error.value)
    assert "was saved with a different model/optimizer config" in message
    assert "actor.optim.lr (checkpoint 0.001, run 0.01)" in message
    assert "model.config.hidden_size (checkpoint 32, run 64)" in message


def test_load_restores_the_backend_state_and_returns_data_state(store):
    handler = store.handler()
    save_steps(handler, [2, 4])
    backend = store.backend()
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


def test_retention_holds_across_restarts_and_keeps_the_newest(store):
    save_steps(store.handler(keep=2), [2, 4, 6])
    assert steps_of(store.handler()) == [6, 4]
    # a new run (new handler) counts what is stored, including an unfinished newer folder it must not count
    handler = store.handler(keep=2)
    store.partial_folder(store.url(handler, "global_step_7"))
    save_steps(handler, [8])
    assert [(s.step, s.status) for s in scan_checkpoints(store.storage, handler.root)] == [(8, COMPLETE), (7, INCOMPLETE), (6, COMPLETE)]
    save_steps(store.handler(keep=1), [10])
    assert steps_of(handler, complete_only=True) == [10]


class BackgroundBackend(FileBackend):
    """Writes nothing until told to: a save whose files are still being written in the background."""

    def __init__(self, storage=None):
        super().__init__(storage=storage)
        self.done = False

    def start_save(self, url, step):
        self.args = (url, step)

    def finish_save(self, wait):
        if not (self.done or wait):
            return None
        super().start_save(*self.args)
        return self.written


def test_a_background_save_commits_only_once_written_and_only_then_retains(store):
    handler = store.handler(keep=1)
    save_steps(handler, [2])
    backend = BackgroundBackend(store.storage)
    pending = handler.begin_save(4, backend, {"runner": {"global_step": 4}})
    assert handler.finish_save(pending, wait=False) is None  # still writing: no commit, nothing deleted
    assert [(s.step, s.status) for s in scan_checkpoints(store.storage, handler.root)][-1] == (2, COMPLETE)
    assert steps_of(handler, complete_only=True) == [2]
    backend.done = True
    assert handler.finish_save(pending, wait=False) == store.url(handler, "global_step_4")
    assert [(s.step, s.status) for s in scan_checkpoints(store.storage, handler.root, checksums=True)] == [(4, COMPLETE)]
    # the data position is the one at the time the save began
    data = store.read(store.url(handler, "global_step_4", "data", "data.pt"))
    assert torch.load(io.BytesIO(data), weights_only=True) == {"runner": {"global_step": 4}}


def test_a_background_write_that_fails_never_commits(store):
    class FailingBackground(BackgroundBackend):
        def finish_save(self, wait):
            raise OSError(28, "No space left on device")

    handler = store.handler()
    save_steps(handler, [2])
    pending = handler.begin_save(4, FailingBackground(store.storage), {})
    with pytest.raises(CheckpointSaveError, match="saving global_step_4 failed: OSError: .*No space left on device") as error:
        handler.finish_save(pending, wait=False)
    assert error.value.exit_code == 4
    assert steps_of(handler) == [2] and store.storage.list(handler.root) == ["global_step_2"]


def test_the_checkpoint_just_committed_is_never_deleted(store):
    handler = store.handler(keep=1)
    save_steps(handler, [6])
    save_steps(handler, [3])  # an older step committed while a newer one exists (e.g. a branch not moved aside)
    assert sorted(steps_of(handler)) == [3, 6]


def test_an_explicit_resume_from_an_older_checkpoint_starts_a_new_branch(store, caplog):
    handler = store.handler()
    save_steps(handler, [2, 4, 6])
    store.partial_folder(store.url(handler, "global_step_5"))  # an unfinished save of the old branch goes too
    checkpoint = handler.find_resume(store.url(handler, "global_step_2"))
    with caplog.at_level(logging.WARNING, logger="rlrunner.checkpoint.handler"):
        assert handler.start_branch(checkpoint) == ["global_step_4", "global_step_5", "global_step_6"]
    [stamp] = store.storage.list(store.url(handler, layout.ABANDONED_DIR))
    moved_to = store.url(handler, layout.ABANDONED_DIR, stamp)
    assert store.storage.list(moved_to) == ["global_step_4", "global_step_5", "global_step_6"]
    assert read_manifest(store.storage, moved_to + "/global_step_6")["step"] == 6  # moved whole, never deleted
    assert f"moved the old branch's newer checkpoints global_step_4, global_step_5, global_step_6 to {moved_to}" in caplog.text
    # the live branch is all that discovery and retention see now
    assert steps_of(handler) == [2]
    handler.max_keep = 1
    save_steps(handler, [3])
    assert steps_of(handler) == [3]
    assert handler.find_resume("auto").step == 3
    assert handler.start_branch(handler.find_resume("auto")) == []  # resuming the newest moves nothing


def test_resuming_from_another_experiment_moves_this_one_s_newer_steps_aside(store):
    other = store.handler(name="other")
    save_steps(other, [4])
    handler = store.handler(name="this")
    save_steps(handler, [2, 4, 6])
    moved = handler.start_branch(handler.find_resume(store.url(other, "global_step_4")))
    assert moved == ["global_step_4", "global_step_6"]
    assert steps_of(handler) == [2]


def test_leftovers_of_killed_saves_are_removed_at_start(tmp_path):
    handler = make_handler(tmp_path)
    root = Path(handler.root)
    save_steps(handler, [2, 6])
    (root / f"{layout.STAGING_PREFIX}global_step_4-dead").mkdir()
    (root / f"{layout.TRASH_PREFIX}global_step_0-dead").mkdir()
    # killed between the two renames of a re-save of step 6: the old global_step_6 was set aside, the new one
    # is still staged. The old one comes back; a set-aside copy whose replacement did arrive is deleted.
    os.rename(root / "global_step_6", root / f"{layout.REPLACED_PREFIX}global_step_6-abcd1234")
    (root / f"{layout.STAGING_PREFIX}global_step_6-feed0000").mkdir()
    shutil.copytree(root / "global_step_2", root / f"{layout.REPLACED_PREFIX}global_step_2-00000000")
    handler.remove_leftovers()
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2", "global_step_6"]
    assert [s.status for s in scan_checkpoints(handler.storage, handler.root, checksums=True)] == [COMPLETE, COMPLETE]


def test_unfinished_folders_on_an_object_store_are_removed_at_start(s3_store):
    url, options = s3_store
    store = Store(open_storage(url, options), url + "/exp")
    handler = store.handler()
    save_steps(handler, [2, 6])
    store.partial_folder(store.url(handler, "global_step_8"))  # a save killed halfway
    store.delete(store.url(handler, "global_step_6", "manifest.json"))  # a deletion killed after its first step
    handler.remove_leftovers()
    assert store.storage.list(handler.root) == ["global_step_2"]


def test_schedule_description_mentions_disabled_periodic_saves(tmp_path):
    assert "periodic checkpoints are off (the last step is still saved)" in make_handler(tmp_path, interval=0).describe_schedule()
    assert "every 50 steps" in make_handler(tmp_path, interval=50, keep=3).describe_schedule()


def test_the_inspector_lists_and_verifies_checkpoints_on_a_store(s3_store, capsys):
    import json

    from rlrunner.tools.inspect import main as checkpoint_cli

    url, options = s3_store
    store = Store(open_storage(url, options), url + "/exp")
    handler = store.handler()
    save_steps(handler, [2, 4])
    store.delete(store.url(handler, "global_step_4", "manifest.json"))
    flags = ["--storage_options", json.dumps(options)]
    assert checkpoint_cli(["list", store.experiment, *flags]) == 0
    out = capsys.readouterr().out
    assert "experiment lock: free" in out
    assert f"complete    {store.url(handler, 'global_step_2')}" in out and "incomplete" in out
    assert checkpoint_cli(["verify", store.url(handler, "global_step_2"), *flags]) == 0
    assert checkpoint_cli(["verify", store.url(handler, "global_step_4"), *flags]) == 1
    assert "incomplete: no manifest.json" in capsys.readouterr().out
