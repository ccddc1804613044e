"""Pure checkpoint logic (when to save, what to keep, config fingerprints) and safe DCP reading, without Ray."""

from __future__ import annotations

import json
import os
import pickle
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rlrunner.backends.dcp_files import SafeFileSystemReader, SafeLoadPlanner, UnsafeMetadataError, read_metadata
from rlrunner.checkpoint.diagnostics import root_cause
from rlrunner.checkpoint.inspect import main as checkpoint_cli
from rlrunner.checkpoint.manifest import (
    ManifestError,
    build_manifest,
    file_record,
    read_manifest,
    verify_files,
    write_manifest,
)
from rlrunner.checkpoint.policy import fingerprint_differences, flatten, should_save, steps_to_delete
from rlrunner.checkpoint.status import COMPLETE, INCOMPLETE, scan_checkpoints

from checkpoint_fakes import make_handler, save_steps  # a real CheckpointHandler with a small file backend
from conftest import LOCAL


@pytest.mark.parametrize(
    "step, interval, last, expected",
    [
        (50, 50, 200, True),
        (100, 50, 200, True),
        (49, 50, 200, False),
        (51, 50, 200, False),
        (200, 50, 200, True),
        (7, 50, 7, True),
        (3, 0, 10, False),
        (10, 0, 10, True),
        (5, -1, 10, False),
        (10, -1, 10, True),
        (1, 1, 10, True),
    ],
)
def test_should_save(step, interval, last, expected):
    assert should_save(step, interval, last) is expected


def test_steps_to_delete_keeps_the_newest():
    assert steps_to_delete([50, 100, 150, 200], None) == []
    assert steps_to_delete([50, 100, 150, 200], 2) == [50, 100]
    assert steps_to_delete([200, 50, 150, 100], 1) == [50, 100, 150]
    assert steps_to_delete([100], 1) == []
    assert steps_to_delete([100, 200], 5) == []
    assert steps_to_delete([], 2) == []


def test_flatten_and_fingerprint_differences():
    assert flatten("a", {"b": {"c": 1}, "d": [1, 2]}) == {"a.b.c": 1, "a.d": [1, 2]}
    saved = {"lr": 0.001, "betas": [0.9, 0.99], "layers": 2, "tie": False}
    assert fingerprint_differences(saved, {"lr": 1e-3, "betas": (0.9, 0.99), "layers": 2.0, "tie": False}) == []
    assert fingerprint_differences(saved, {"lr": 0.01, "betas": [0.9, 0.99], "layers": 2, "extra": 1}) == [
        "extra (checkpoint '<absent>', run 1)",
        "lr (checkpoint 0.001, run 0.01)",
        "tie (checkpoint False, run '<absent>')",
    ]


def test_manifest_round_trip_and_verification(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "shard.bin").write_bytes(b"hello world" * 100)
    record = file_record(LOCAL, str(tmp_path / "a" / "shard.bin"))
    assert record == {"size": 1100, "crc32": f"{zlib.crc32(b'hello world' * 100):08x}"}
    manifest = build_manifest(5, 2, "fsdp2-dcp", {"k": 1}, {"a/shard.bin": record}, {"epoch": 0})
    write_manifest(LOCAL, str(tmp_path), manifest)
    assert read_manifest(LOCAL, str(tmp_path)) == manifest
    assert verify_files(LOCAL, str(tmp_path), manifest, checksums=True) == []
    (tmp_path / "a" / "shard.bin").write_bytes(b"hello wOrld" * 100)
    assert [str(p) for p in verify_files(LOCAL, str(tmp_path), manifest, checksums=False)] == []
    assert "checksum" in str(verify_files(LOCAL, str(tmp_path), manifest, checksums=True)[0])


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "no manifest.json"),
        ("{", "unreadable"),
        ('{"format": "other"}', "not an rlrunner checkpoint manifest"),
        ('{"format": "rlrunner.checkpoint", "version": 99}', "has version 99"),
        ('{"format": "rlrunner.checkpoint", "version": 1, "step": 1}', "lacks 'world_size'"),
    ],
)
def test_bad_manifests(tmp_path, content, expected):
    if content is not None:
        (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(ManifestError, match=expected):
        read_manifest(LOCAL, str(tmp_path))


def _good_manifest() -> dict:
    return build_manifest(4, 2, "fsdp2-dcp", {"k": 1}, {"actor/a.distcp": {"size": 3, "crc32": "0000abcd"}}, {})


def _files(record) -> dict:
    return {"actor/a.distcp": record}


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("step", "4", "manifest.json: 'step' must be an integer, got str"),
        ("step", True, "manifest.json: 'step' must be an integer, got bool"),
        ("step", 4.0, "manifest.json: 'step' must be an integer, got float"),
        ("step", -1, "manifest.json: 'step' must be >= 0, got -1"),
        ("world_size", None, "manifest.json: 'world_size' must be an integer, got null"),
        ("world_size", -2, "manifest.json: 'world_size' must be >= 1, got -2"),
        ("world_size", 0, "manifest.json: 'world_size' must be >= 1, got 0"),
        ("backend", 7, "manifest.json: 'backend' must be a non-empty string, got int"),
        ("backend", "", "manifest.json: 'backend' must be a non-empty string, got ''"),
        ("fingerprint", ["k", 1], "manifest.json: 'fingerprint' must be an object, got list"),
        ("files", ["actor/a.distcp"], "manifest.json: 'files' must be an object, got list"),
        ("files", _files(3), "manifest.json: 'files' entry 'actor/a.distcp' must be an object, got int"),
        (
            "files",
            _files({"crc32": "0000abcd"}),
            "'files' entry 'actor/a.distcp' must have a non-negative integer 'size', got null",
        ),
        ("files", _files({"size": "3", "crc32": "0000abcd"}), "must have a non-negative integer 'size', got str"),
        ("files", _files({"size": False, "crc32": "0000abcd"}), "must have a non-negative integer 'size', got bool"),
        ("files", _files({"size": -3, "crc32": "0000abcd"}), "must have a non-negative integer 'size', got -3"),
        ("files", _files({"size": 3}), "'files' entry 'actor/a.distcp' must have a 'crc32' of 8 hex digits, got null"),
        ("files", _files({"size": 3, "crc32": 43981}), "must have a 'crc32' of 8 hex digits, got int"),
        ("files", _files({"size": 3, "crc32": "abc"}), "must have a 'crc32' of 8 hex digits, got 'abc'"),
        (
            "files",
            {"../outside.bin": {"size": 3, "crc32": "0000abcd"}},
            "not a relative path inside the checkpoint: '../outside.bin'",
        ),
        (
            "files",
            {"/etc/passwd": {"size": 3, "crc32": "0000abcd"}},
            "not a relative path inside the checkpoint: '/etc/passwd'",
        ),
    ],
)
def test_manifests_with_wrong_types_are_refused_naming_the_field(tmp_path, field, value, expected):
    manifest = {**_good_manifest(), field: value}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError) as error:
        read_manifest(LOCAL, str(tmp_path))
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


def test_a_well_typed_manifest_is_still_read(tmp_path):
    manifest = {**_good_manifest(), "step": 0, "world_size": 1, "fingerprint": {}, "files": {}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert read_manifest(LOCAL, str(tmp_path)) == manifest


def test_scan_list_and_auto_resume_report_a_tampered_manifest_instead_of_crashing(tmp_path, capsys):
    handler = make_handler(tmp_path / "exp")
    save_steps(handler, [2, 4])
    manifest_path = Path(handler.root) / "global_step_4" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "step": "four"}))
    statuses = scan_checkpoints(handler.storage, handler.root)
    assert [(s.name, s.status, s.step) for s in statuses] == [
        ("global_step_4", INCOMPLETE, 4),
        ("global_step_2", COMPLETE, 2),
    ]
    assert statuses[0].reasons == ["manifest.json: 'step' must be an integer, got str"]
    assert handler.find_resume("auto").step == 2
    assert checkpoint_cli(["list", str(tmp_path / "exp")]) == 0
    assert "manifest.json: 'step' must be an integer, got str" in capsys.readouterr().out


def _save_dcp(folder: Path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def _load_dcp(folder: Path, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(str(folder)), planner=SafeLoadPlanner(), no_dist=True)


def test_safe_reading_of_a_genuine_dcp_folder(tmp_path):
    _save_dcp(
        tmp_path,
        {"w": torch.arange(6.0).view(2, 3), "sched": {"last_epoch": 3, "lrs": [0.1]}, "rng": (3, (1, 2), None)},
    )
    assert sorted(read_metadata(tmp_path).state_dict_metadata) == ["rng", "sched.last_epoch", "sched.lrs", "w"]
    target = {"w": torch.zeros(2, 3), "sched": {"last_epoch": 0, "lrs": [0.0]}, "rng": None}
    _load_dcp(tmp_path, target)
    assert torch.equal(target["w"], torch.arange(6.0).view(2, 3))
    assert target["sched"] == {"last_epoch": 3, "lrs": [0.1]} and target["rng"] == (3, (1, 2), None)


class _Planted:
    """Unpickling this (as stock DCP would, weights_only off) creates a file: a stand-in for any code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_planted_pickle_in_an_item_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"
    _save_dcp(tmp_path / "ckpt", {"w": torch.ones(2), "evil": _Planted(str(marker))})
    with pytest.raises(BaseException) as error:  # DCP wraps each rank's error in its CheckpointException
        _load_dcp(tmp_path / "ckpt", {"w": torch.zeros(2), "evil": None})
    assert root_cause(error.value).startswith("rank 0: UnpicklingError: Weights only load failed")
    assert not marker.exists()


def test_a_planted_pickle_in_metadata_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"
    _save_dcp(tmp_path / "ckpt", {"w": torch.ones(2)})
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))))
    with pytest.raises(UnsafeMetadataError, match="refers to io.open, which a DCP .metadata never needs"):
        read_metadata(tmp_path / "ckpt")
    with pytest.raises(BaseException) as error:
        _load_dcp(tmp_path / "ckpt", {"w": torch.zeros(2)})
    assert "checkpoint metadata refers to io.open, which a DCP .metadata never needs" in root_cause(error.value)
    assert not marker.exists()
    assert os.listdir(tmp_path) == ["ckpt"]
