"""FSDP2/DCP checkpoints written and read straight from an S3 API (moto), with real gloo ranks.

Two spawned ranks save a small FSDP2 model + optimizer to s3:// (sync and async) and load it back;
rank 0 then loads the 2-rank checkpoint alone (resharding). The other tests write DCP folders in
this process (no process group) to check the refusal of planted pickles, that a write failing
halfway leaves no object, and the converters on s3:// URLs.
"""

from __future__ import annotations

import json
import os
import pickle
import traceback
import uuid
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from spawned_ranks import forked_context

from rlrunner.backends.dcp_files import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeMetadataError,
    checksumming_writer,
    read_metadata,
)
from rlrunner.checkpoint.diagnostics import root_cause
from rlrunner.storage import FileRecord, join, open_storage
from rlrunner.tools.convert import load_model_weights

from conftest import S3_BUCKET, TINY_MODEL_CFG, assert_bit_equal, load_toolkit

WORLD = 2
TIMEOUT_S = 120
OPTIM_CFG = {
    "lr": 1e-2,
    "betas": [0.9, 0.99],
    "weight_decay": 0.01,
    "warmup_steps": 2,
    "lr_schedule": "cosine",
    "min_lr_ratio": 0.1,
}


def _s3_options(endpoint: str) -> dict:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


# -- the ranks ------------------------------------------------------------------------------------


def _build(seed: int):
    """A small FSDP2 model (33 rows: uneven shards), AdamW and the actor's LR schedule; same weights on every rank."""
    from torch.distributed.fsdp import fully_shard

    from rlrunner.backends.optim import build_optimizer

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 33), torch.nn.ReLU(), torch.nn.Linear(33, 16))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    optimizer, scheduler = build_optimizer(model.parameters(), OPTIM_CFG, total_steps=10)
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler, seed: int) -> None:
    inputs = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed))
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _tensors(model, optimizer, scheduler, full: bool) -> dict[str, torch.Tensor]:
    """Model and optimizer state as plain tensors: this rank's shards, or (collective) the full tensors."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    def plain(value):
        if hasattr(value, "full_tensor"):
            value = value.full_tensor() if full else value.to_local()
        return value.detach().clone()

    out = {f"model.{k}": plain(v) for k, v in model.state_dict().items()}
    for fqn, state in get_optimizer_state_dict(model, optimizer)["state"].items():
        out.update({f"optim.{fqn}.{k}": plain(v) for k, v in state.items()})
    out["scheduler.last_epoch"] = torch.tensor(scheduler.last_epoch)
    return out


def _rank(rank: int, url: str, options: dict, out: str) -> None:
    os.environ["NO_PROXY"] = "127.0.0.1,localhost"  # never route the local endpoint through a proxy
    try:
        _rank_body(rank, url, options, Path(out))
    except BaseException:
        (Path(out) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def _rank_body(rank: int, url: str, options: dict, out: Path) -> None:
    import torch.distributed as dist

    from rlrunner.backends.background_save import BackgroundSave
    from rlrunner.backends.fsdp.dcp_state import fsdp_parts, load_fsdp_state, stager_for_next_save, start_dcp_save
    from rlrunner.backends.rank_parts import RankRNG
    from rlrunner.utils.stateful import StateParts

    def parts(model, optimizer, scheduler, rank: int) -> StateParts:
        return StateParts({**fsdp_parts(model, optimizer, scheduler), "rng": RankRNG(rank)})

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD, timeout=timedelta(seconds=TIMEOUT_S)
    )
    group, saver = dist.new_group(backend="gloo"), BackgroundSave()
    live = _build(seed=1)
    _train_step(*live, seed=10)
    results: dict = {"sync_saved": _tensors(*live, full=False), "sync_full": _tensors(*live, full=True)}
    results["rng_saved"] = torch.get_rng_state()
    start_dcp_save(saver, join(url, "sync"), parts(*live, rank).state_dict(), False, options, group, None)
    results["sync_files"] = saver.finish()["files"]

    _train_step(*live, seed=11)
    results["async_saved"] = _tensors(*live, full=False)
    stager = stager_for_next_save(None)
    start_dcp_save(saver, join(url, "async"), parts(*live, rank).state_dict(), True, options, group, stager)
    _train_step(*live, seed=12)  # training goes on while the upload runs
    results["async_live_after"] = _tensors(*live, full=False)
    results["async_files"] = saver.finish()["files"]
    # the next background save, with the stager the worker would use (the same one where torch allows)
    results["async2_saved"] = _tensors(*live, full=False)
    stager = stager_for_next_save(stager)
    start_dcp_save(saver, join(url, "async2"), parts(*live, rank).state_dict(), True, options, group, stager)
    results["async2_files"] = saver.finish()["files"]

    for name in ("sync", "async", "async2"):
        fresh = _build(seed=2)
        results[f"{name}_restored_rng"] = load_fsdp_state(join(url, name), parts(*fresh, rank), WORLD, options)
        results[f"{name}_rng_loaded"] = torch.get_rng_state()
        results[f"{name}_loaded"] = _tensors(*fresh, full=False)
    dist.destroy_process_group()

    if rank == 0:  # the same checkpoint, loaded by one rank alone
        dist.init_process_group(
            "gloo", init_method=f"file://{out}/store1", rank=0, world_size=1, timeout=timedelta(seconds=TIMEOUT_S)
        )
        alone = _build(seed=3)
        results["alone_restored_rng"] = load_fsdp_state(join(url, "sync"), parts(*alone, 0), 1, options)
        results["alone_loaded"] = _tensors(*alone, full=True)
        dist.destroy_process_group()
    torch.save(results, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(moto_endpoint, tmp_path_factory):
    """Runs the two ranks once: (url, storage_options, [rank 0's results, rank 1's])."""
    url = f"s3://{S3_BUCKET}/two-ranks-{uuid.uuid4().hex[:8]}"
    options = _s3_options(moto_endpoint)
    out = tmp_path_factory.mktemp("ranks")
    procs = [forked_context().Process(target=_rank, args=(r, url, options, str(out))) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(TIMEOUT_S)
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.kill()
    errors = {p.name: p.read_text() for p in out.glob("*.error")}
    assert not errors, errors
    assert not alive, "a rank hung"
    return url, options, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


# -- the two ranks' checkpoints ---------------------------------------------------------------------


def test_each_rank_uploads_its_shard_and_the_crcs_are_of_the_bytes_stored(two_ranks):
    url, options, ranks = two_ranks
    storage = open_storage(url, options)
    for name in ("sync", "async", "async2"):
        folder = join(url, name)
        assert sorted(storage.walk(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # no .metadata.tmp
        assert sorted(ranks[0][f"{name}_files"]) == [".metadata", "__0_0.distcp"]
        assert sorted(ranks[1][f"{name}_files"]) == ["__1_0.distcp"]
        recorded = {**ranks[0][f"{name}_files"], **ranks[1][f"{name}_files"]}
        stored = {n: FileRecord.of(storage.read_bytes(join(folder, n))).as_dict() for n in recorded}
        assert recorded == stored


def test_loading_back_from_s3_is_bit_identical(two_ranks):
    _, _, ranks = two_ranks
    for results in ranks:
        assert_bit_equal(results["sync_loaded"], results["sync_saved"])
        # the async save holds the state when it started, not the steps trained while it uploaded
        assert_bit_equal(results["async_loaded"], results["async_saved"])
        assert_bit_equal(results["async2_loaded"], results["async2_saved"])  # a second save with the same stager
        assert not torch.equal(results["async_live_after"]["model.0.weight"], results["async_saved"]["model.0.weight"])
        assert results["sync_restored_rng"] and results["async_restored_rng"]
        assert torch.equal(results["sync_rng_loaded"], results["rng_saved"])


def test_a_two_rank_checkpoint_loads_into_one_rank_and_offline(two_ranks):
    url, options, ranks = two_ranks
    assert ranks[0]["alone_restored_rng"] is False  # another world size: per-rank RNG is not restored
    assert_bit_equal(ranks[0]["alone_loaded"], ranks[0]["sync_full"])
    weights = load_model_weights(join(url, "sync"), storage_options=options)
    expected = {k[len("model.") :]: v for k, v in ranks[0]["sync_full"].items() if k.startswith("model.")}
    assert_bit_equal(weights, expected)


# -- in this process ----------------------------------------------------------------------------------


def _save(url: str, state: dict, options: dict) -> dict:
    writer = checksumming_writer(url, options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "torch.distributed is disabled ... single process"
        dcp.save(state, storage_writer=writer, no_dist=True)
    return writer.fs.records


def _load(url: str, state: dict, options: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=SafeFileSystemReader(url, options), planner=SafeLoadPlanner(), no_dist=True)


class _Planted:
    """Unpickling this (as stock DCP would) creates a file: a stand-in for any code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_planted_pickles_on_s3_are_refused_not_run(s3_store, tmp_path, capsys):
    url, options = s3_store
    storage = open_storage(url, options)
    marker = tmp_path / "pwned"
    # in an item: torch.load(weights_only=True) refuses it
    _save(join(url, "item"), {"w": torch.ones(2), "evil": _Planted(str(marker))}, options)
    with pytest.raises(BaseException) as error:  # DCP wraps each rank's error in its CheckpointException
        _load(join(url, "item"), {"w": torch.zeros(2), "evil": None}, options)
    assert root_cause(error.value).startswith("rank 0: UnpicklingError: Weights only load failed")
    # in .metadata: the restricted unpickler refuses it, on every path that reads it
    actor = join(url, "global_step_1", "actor")
    _save(actor, {"model": {"w": torch.ones(2)}}, options)
    storage.write_bytes(join(actor, ".metadata"), pickle.dumps(_Planted(str(marker))))
    refusal = "checkpoint metadata refers to io.open, which a DCP .metadata never needs"
    with pytest.raises(UnsafeMetadataError, match=refusal):
        read_metadata(actor, options)
    with pytest.raises(BaseException) as error:
        _load(actor, {"model": {"w": torch.zeros(2)}}, options)
    assert refusal in root_cause(error.value)
    with pytest.raises(UnsafeMetadataError, match=refusal):
        load_model_weights(join(url, "global_step_1"), storage_options=options)
    tool = load_toolkit("convert_dcp_to_state_dict")
    assert tool.main(["--dcp_path", actor, "--output_path", str(tmp_path / "w.pt")]) == 2
    assert capsys.readouterr().err.strip() == f"convert_dcp_to_state_dict: error: {refusal}"
    assert not marker.exists()


class _Exploding:
    def __reduce__(self):
        raise RuntimeError("the disk went away")


def test_a_write_that_fails_halfway_leaves_no_object(s3_store):
    import boto3

    url, options = s3_store
    options = {**options, "default_block_size": 5 << 20}  # so the 6 MB item starts a multipart upload
    storage = open_storage(url, options)
    state = {"first": os.urandom(6 << 20), "then": _Exploding()}  # written in this order into __0_0.distcp
    with pytest.raises(BaseException) as error:
        _save(url, state, options)
    assert "the disk went away" in root_cause(error.value)
    assert storage.walk(url) == {}  # neither the shard nor .metadata
    client = boto3.client("s3", endpoint_url=options["client_kwargs"]["endpoint_url"], region_name="us-east-1")
    bucket, prefix = url[len("s3://") :].split("/", 1)
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []  # aborted


def test_the_converters_read_an_s3_checkpoint(s3_store, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from rlrunner.models.loading import build_hf_config, build_model
    from rlrunner.models.tokenizer import build_char_tokenizer

    url, options = s3_store
    storage = open_storage(url, options)
    tokenizer = build_char_tokenizer()
    model = build_model(TINY_MODEL_CFG, tokenizer, seed=0)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    checkpoint = join(url, "global_step_1")
    _save(join(checkpoint, "actor"), {"model": model.state_dict()}, options)
    hf_local = tmp_path / "hf-files"
    build_hf_config(TINY_MODEL_CFG, tokenizer).save_pretrained(hf_local)
    tokenizer.save_pretrained(hf_local)
    for path in hf_local.iterdir():
        storage.put_file(str(path), join(checkpoint, "actor", "huggingface", path.name))

    assert_bit_equal(load_model_weights(checkpoint, storage_options=options), weights)

    # credentials and endpoint from the AWS_* variables alone (s3_store sets them)
    state_tool, hf_tool = load_toolkit("convert_dcp_to_state_dict"), load_toolkit("convert_dcp_to_hf")
    assert state_tool.main(["--dcp_path", checkpoint, "--output_path", str(tmp_path / "w.pt")]) == 0
    assert_bit_equal(torch.load(tmp_path / "w.pt", weights_only=True), weights)
    argv = ["--ckpt_path", checkpoint, "--output_path", str(tmp_path / "hf"), "--storage_options", json.dumps(options)]
    assert hf_tool.main(argv) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert_bit_equal({k: v for k, v in exported.state_dict().items() if k in weights}, weights)
    capsys.readouterr()

    # a protocol whose package is missing, bad options, a remote output: one line each, exit status 2
    assert state_tool.main(["--dcp_path", "gs://bucket/ckpt", "--output_path", str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "gs://bucket/ckpt" in err and "pip install gcsfs" in err
    assert hf_tool.main(["--ckpt_path", checkpoint, "--output_path", join(url, "out")]) == 2
    assert "the output must be a local folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        state_tool.main(["--dcp_path", checkpoint, "--output_path", join(url, "w.pt")])
    assert exited.value.code == 2 and "--output_path must be a local file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        hf_tool.main(["--ckpt_path", checkpoint, "--output_path", str(tmp_path / "y"), "--storage_options", "{key: 1}"])
    assert exited.value.code == 2 and "--storage_options: not valid JSON" in capsys.readouterr().err
