"""CheckpointHandler retention, background commits, branches and the leftovers of killed saves, on real files and on a
real S3 API (moto), with a small file-writing backend (no Ray)."""

from __future__ import annotations

import io
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from rlrunner.checkpoint import layout
from rlrunner.checkpoint.manifest import read_manifest
from rlrunner.checkpoint.status import COMPLETE, INCOMPLETE, scan_checkpoints
from rlrunner.errors import CheckpointSaveError
from rlrunner.storage import open_storage

from checkpoint_fakes import BackgroundBackend, Store, make_handler, save_steps, steps_of

# -- retention --------------------------------------------------------------------------------


def test_retention_holds_across_restarts_and_keeps_the_newest(store):
    save_steps(store.handler(keep=2), [2, 4, 6])
    assert steps_of(store.handler()) == [6, 4]
    # a new run (new handler) counts what is stored, including an unfinished newer folder it must not count
    handler = store.handler(keep=2)
    store.partial_folder(store.url(handler, "global_step_7"))
    save_steps(handler, [8])
    assert [(s.step, s.status) for s in scan_checkpoints(store.storage, handler.root)] == [
        (8, COMPLETE),
        (7, INCOMPLETE),
        (6, COMPLETE),
    ]
    save_steps(store.handler(keep=1), [10])
    assert steps_of(handler, complete_only=True) == [10]


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
    assert [(s.step, s.status) for s in scan_checkpoints(store.storage, handler.root, checksums=True)] == [
        (4, COMPLETE)
    ]
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
    with pytest.raises(
        CheckpointSaveError, match="saving global_step_4 failed: OSError: .*No space left on device"
    ) as error:
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
    with caplog.at_level(logging.WARNING, logger="rlrunner.checkpoint"):
        assert handler.start_branch(checkpoint) == ["global_step_4", "global_step_5", "global_step_6"]
    [stamp] = store.storage.list(store.url(handler, layout.ABANDONED_DIR))
    moved_to = store.url(handler, layout.ABANDONED_DIR, stamp)
    assert store.storage.list(moved_to) == ["global_step_4", "global_step_5", "global_step_6"]
    assert read_manifest(store.storage, moved_to + "/global_step_6")["step"] == 6  # moved whole, never deleted
    assert (
        f"moved the old branch's newer checkpoints global_step_4, global_step_5, global_step_6 to {moved_to}"
        in caplog.text
    )
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
    assert (
        "periodic checkpoints are off (the last step is still saved)"
        in make_handler(tmp_path, interval=0).describe_schedule()
    )
    assert "every 50 steps" in make_handler(tmp_path, interval=50, keep=3).describe_schedule()


def test_the_inspector_lists_and_verifies_checkpoints_on_a_store(s3_store, capsys):
    import json

    from rlrunner.checkpoint.inspect import main as checkpoint_cli

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
