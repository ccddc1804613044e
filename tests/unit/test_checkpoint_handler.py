"""CheckpointHandler on real files and on a real S3 API (moto), with a small file-writing backend (no Ray):
commit, discovery, resume (retention, branches, leftovers: test_checkpoint_retention.py)."""

from __future__ import annotations

import io
import logging
import resource
from pathlib import Path

import pytest
import torch

from rlrunner.checkpoint import layout
from rlrunner.checkpoint.manifest import file_record, read_manifest
from rlrunner.checkpoint.status import COMPLETE, CORRUPT, INCOMPLETE, scan_checkpoints
from rlrunner.errors import CheckpointError, CheckpointSaveError

from checkpoint_fakes import FINGERPRINT, FileBackend, make_handler, save_steps


def test_save_commits_the_layout_with_manifest_written_last(store):
    handler = store.handler()
    url = handler.save(
        4, store.backend(), {"runner": {"global_step": 4}}, write_extra=lambda d: Path(d, "extra.txt").write_text("x")
    )
    assert url == store.storage.join(store.experiment, "checkpoints", "global_step_4")
    assert store.storage.list(url) == ["actor", "data", "extra.txt", "manifest.json"]
    manifest = read_manifest(store.storage, url)
    assert manifest["step"] == 4 and manifest["world_size"] == 2 and manifest["backend"] == "test-files"
    assert set(manifest["files"]) == {"actor/rank_0.pt", "actor/rank_1.pt", "data/data.pt", "extra.txt"}
    assert manifest["files"]["data/data.pt"] == file_record(store.storage, url + "/data/data.pt")
    assert manifest["fingerprint"] == FINGERPRINT
    assert torch.load(io.BytesIO(store.read(url + "/data/data.pt")), weights_only=True) == {
        "runner": {"global_step": 4}
    }
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
    assert [s.status for s in scan_checkpoints(store.storage, handler.root)] == [
        INCOMPLETE,
        CORRUPT,
        INCOMPLETE,
        COMPLETE,
    ]
    assert "no manifest.json" in statuses["global_step_4"].reasons[0]
    assert statuses["global_step_6"].reasons == [
        f"actor/rank_1.pt: {len(data) - 10} bytes, the manifest says {len(data)} (truncated or rewritten)"
    ]


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
    with pytest.raises(
        CheckpointError, match="already has checkpoints \\(newest global_step_2\\) and runner.resume_dir is null"
    ):
        handler.find_resume(None)


def test_auto_takes_the_newest_complete_and_logs_each_skip(store, caplog):
    handler = store.handler()
    save_steps(handler, [2, 4, 6, 8])
    store.delete(store.url(handler, "global_step_8", "data", "data.pt"))
    store.delete(store.url(handler, "global_step_6", "manifest.json"))
    store.partial_folder(store.url(handler, "global_step_10"))  # a save killed halfway
    with caplog.at_level(logging.INFO, logger="rlrunner.checkpoint"):
        checkpoint = handler.find_resume("auto")
    assert checkpoint.step == 4 and checkpoint.url == store.url(handler, "global_step_4")
    assert "skipping global_step_10: incomplete" in caplog.text
    assert "skipping global_step_8: corrupt (data/data.pt: missing)" in caplog.text
    assert "skipping global_step_6: incomplete (no manifest.json (the save did not finish))" in caplog.text
    assert "resuming from" in caplog.text and "global_step_4 (step 4)" in caplog.text


def test_auto_with_nothing_usable_starts_fresh_and_says_so(store, caplog):
    handler = store.handler()
    store.partial_folder(store.url(handler, "global_step_2"))
    with caplog.at_level(logging.INFO, logger="rlrunner.checkpoint"):
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
    # a checkpoint without batches in flight has no in_flight file, and loads the part empty
    assert data == {"runner": {"global_step": 4}, "in_flight": {}}
    assert [s["rank"] for s in backend.loaded] == [0, 1] and backend.loaded[0]["step"] == 4


def test_batches_in_flight_are_a_file_of_their_own_in_the_commit(store):
    handler = store.handler()
    batches = {"batches": [{"step": 3, "weights_step": 1, "samples": [{"prompt_ids": [1, 2], "reward": 0.5}]}]}
    handler.save(2, store.backend(), {"runner": {"global_step": 2}, "in_flight": batches})
    checkpoint = handler.find_resume("auto")
    assert "data/in_flight.pt" in checkpoint.manifest["files"] and "data/data.pt" in checkpoint.manifest["files"]
    assert handler.load(checkpoint, store.backend()) == {"runner": {"global_step": 2}, "in_flight": batches}
    # it is checksummed like every file of the checkpoint
    store.write(checkpoint.url + "/data/in_flight.pt", b"flipped")
    with pytest.raises(CheckpointError, match="in_flight.pt"):
        handler.find_resume(checkpoint.url)


def test_load_refuses_a_checkpoint_of_another_backend(tmp_path):
    handler = make_handler(tmp_path)
    save_steps(handler, [2])
    other = FileBackend()
    other.backend = "fsdp2-dcp"
    with pytest.raises(CheckpointError, match="was written by the test-files backend, this run uses fsdp2-dcp"):
        handler.load(handler.find_resume("auto"), other)
