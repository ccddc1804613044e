"""Weight sync from FSDP2 actor ranks to rollout workers: packing units, real gloo processes, and real Ray groups."""

from __future__ import annotations

import multiprocessing
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

from rlrunner.backends.fsdp.weights import FSDPWeightSource, local_block
from rlrunner.rollout.hf import ModuleSink
from rlrunner.weight_sync.plan import (
    Assembler,
    Piece,
    TensorSpec,
    WeightSyncError,
    check_coverage,
    pack_bucket,
    plan_buckets,
    shard_rows,
)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that equality is bit for bit (signed zeros, NaN payloads included)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(ints[tensor.element_size()]) if tensor.is_floating_point() else tensor


def assert_bit_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        assert got[name].shape == expected[name].shape, name
        assert torch.equal(bits(got[name]), bits(expected[name])), f"{name} differs"


# -- units -----------------------------------------------------------------------------------------


def test_shard_rows_is_torch_chunk_with_empty_shards():
    for dim0 in range(0, 10):
        for shards in range(1, 5):
            chunks = list(torch.chunk(torch.arange(dim0), shards)) if dim0 else []
            for index in range(shards):
                start, stop = shard_rows(dim0, shards, index)
                expected = chunks[index].tolist() if index < len(chunks) else []
                assert list(range(start, stop)) == expected, (dim0, shards, index)
    assert shard_rows(4, 3, 2) == (4, 4)  # 4 rows over 3 ranks: 2, 2, 0 (not 2, 1, 1)


def test_plan_buckets_boundaries_alignment_and_oversized_pieces():
    f32, bf16 = torch.float32, torch.bfloat16
    pieces = [Piece("a", (3,), 0, 0, 3, bf16), Piece("b", (10,), 0, 0, 10, f32), Piece("c", (2,), 0, 1, 2, bf16)]
    buckets = plan_buckets(pieces, 16)
    # a: 6 bytes at 0; b starts at 8 (4-byte aligned): 2 elements fit, then 4 + 4 in the next buckets; c after them.
    layout = [[(s.piece, s.start, s.stop, s.offset) for s in b.segments] for b in buckets]
    assert layout == [
        [(0, 0, 3, 0), (1, 0, 2, 8)],
        [(1, 2, 6, 0)],
        [(1, 6, 10, 0)],
        [(2, 0, 1, 0)],
    ]
    assert [b.nbytes for b in buckets] == [16, 16, 16, 2]
    assert all(b.nbytes <= 16 for b in buckets)
    # one bucket holds everything when it is big enough
    assert len(plan_buckets(pieces, 1 << 20)) == 1
    assert plan_buckets([], 16) == []
    with pytest.raises(ValueError, match="smaller than one"):
        plan_buckets([Piece("b", (1,), 0, 0, 1, f32)], 3)


class DictSink:
    """A sink that assembles into tensors of its own and records what it was handed, in order."""

    def __init__(self, layout: list[TensorSpec], in_place: bool):
        self.specs = layout
        self.tensors = {spec.name: torch.zeros(spec.shape, dtype=spec.dtype) for spec in layout}
        self.in_place = in_place
        self.loaded: list[str] = []
        self.finished = 0

    def layout(self) -> list[TensorSpec]:
        return self.specs

    def target(self, spec: TensorSpec) -> torch.Tensor:
        return self.tensors[spec.name] if self.in_place else torch.full(spec.shape, 7, dtype=spec.dtype)

    def load(self, name: str, tensor: torch.Tensor) -> None:
        self.loaded.append(name)
        if not self.in_place:
            self.tensors[name] = tensor.clone()

    def finish(self) -> None:
        self.finished += 1


def test_pack_unpack_row_and_column_blocks_uneven_and_empty_cast_like_load_state_dict():
    """Full tensors split over 3 'ranks' by rows (4 rows -> 2, 2, 0) or by columns (a tensor-parallel row-parallel
    weight), sent in tiny buckets, land bit-exact, whether the sink offers its own tensors or takes new ones."""
    gen = torch.Generator().manual_seed(0)
    full = {
        "w": torch.randn(4, 3, generator=gen),       # rows 2, 2, 0
        "e": torch.randn(7, 5, generator=gen) * 100,  # rows 3, 3, 1
        "cols": torch.randn(5, 6, generator=gen),    # columns 2, 2, 2 (dim 1: not one run of elements)
        "one": torch.randn(1, 6, generator=gen),     # rows 1, 0, 0
        "ties": torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, float("inf"), -0.0]),
        "steps": torch.tensor([3, 4, 5]),             # an int64 buffer, sent by rank 0 as is
    }
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        layout = [TensorSpec(n, tuple(t.shape), dtype if t.is_floating_point() else t.dtype) for n, t in full.items()]
        pieces_by_rank, blocks_by_rank = [], []
        for rank in range(3):
            pieces, blocks = [], []
            for spec in layout:
                tensor = full[spec.name]
                if spec.name == "cols":
                    dim, (start, stop) = 1, (2 * rank, 2 * rank + 2)
                elif tensor.dim() >= 2:
                    dim, (start, stop) = 0, shard_rows(tensor.shape[0], 3, rank)
                elif rank == 0:
                    dim, start, stop = 0, 0, tensor.shape[0]
                else:
                    continue
                if stop > start:
                    pieces.append(Piece(spec.name, spec.shape, dim, start, stop, spec.dtype))
                    blocks.append(tensor.narrow(dim, start, stop - start).reshape(-1))
            pieces_by_rank.append(pieces)
            blocks_by_rank.append(blocks)
        check_coverage(layout, pieces_by_rank)
        expected = {n: t.to(dtype) if t.is_floating_point() else t for n, t in full.items()}
        for in_place in (True, False):
            sink = DictSink(layout, in_place)
            assembler = Assembler(layout, pieces_by_rank, sink)
            for rank, (pieces, blocks) in enumerate(zip(pieces_by_rank, blocks_by_rank)):
                for bucket in plan_buckets(pieces, 10):  # smaller than several pieces: they split across buckets
                    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
                    pack_bucket(bucket, blocks, buffer)
                    assembler.unpack(rank, bucket, buffer.clone())
            assembler.finish()
            assert_bit_equal(sink.tensors, expected)
            assert sorted(sink.loaded) == sorted(full) and sink.finished == 1  # each tensor handed over once, whole
        # the same bits as the old path: load_state_dict of the float32 tensors into tensors of `dtype`
        module = torch.nn.Module()
        for name, tensor in expected.items():
            module.register_buffer(name, torch.zeros_like(tensor))
        module.load_state_dict(full)
        assert_bit_equal(dict(module.state_dict()), expected)
    assert expected["ties"].to(torch.bfloat16)[0] == 1.0  # a tie rounds to even


def test_an_incomplete_sync_is_an_error_not_a_partial_load():
    layout = [TensorSpec("a", (2, 2), torch.float32)]
    pieces = [[Piece("a", (2, 2), 0, 0, 2, torch.float32)]]
    sink = DictSink(layout, in_place=False)
    assembler = Assembler(layout, pieces, sink)
    bucket = plan_buckets(pieces[0], 8)[0]  # the first half only
    buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
    pack_bucket(bucket, [torch.ones(4)], buffer)
    assembler.unpack(0, bucket, buffer)
    with pytest.raises(WeightSyncError, match="incomplete"):
        assembler.finish()
    assert sink.loaded == [] and sink.finished == 0


def test_coverage_and_layout_checks():
    f32 = torch.float32
    layout = [TensorSpec("a", (2, 2), f32), TensorSpec("b", (3,), f32)]
    good = [[Piece("a", (2, 2), 0, 0, 1, f32), Piece("b", (3,), 0, 0, 3, f32)], [Piece("a", (2, 2), 0, 1, 2, f32)]]
    check_coverage(layout, good)
    check_coverage(layout, [[Piece("a", (2, 2), 1, 0, 1, f32), Piece("b", (3,), 0, 0, 3, f32)], [Piece("a", (2, 2), 1, 1, 2, f32)]])
    with pytest.raises(WeightSyncError, match="do not tile"):
        check_coverage(layout, [[Piece("a", (2, 2), 0, 0, 2, f32), Piece("b", (3,), 0, 0, 3, f32)], [Piece("a", (2, 2), 0, 1, 2, f32)]])
    with pytest.raises(WeightSyncError, match="send 1 of its 2 rows"):
        check_coverage(layout, [good[0]])
    with pytest.raises(WeightSyncError, match="rollout model has"):
        check_coverage(layout, [[Piece("a", (2, 2), 0, 0, 2, torch.bfloat16), Piece("b", (3,), 0, 0, 3, f32)]])
    with pytest.raises(WeightSyncError, match="does not have"):
        check_coverage(layout, [[*good[0], Piece("c", (1,), 0, 0, 1, f32)], good[1]])
    with pytest.raises(WeightSyncError, match="different dimensions"):
        check_coverage(layout, [[Piece("a", (2, 2), 0, 0, 1, f32), Piece("b", (3,), 0, 0, 3, f32)], [Piece("a", (2, 2), 1, 1, 2, f32)]])
    # tied weights are one tensor, wanted once under its first name
    tied = torch.nn.ModuleDict({"emb": torch.nn.Embedding(2, 2), "head": torch.nn.Linear(2, 2)})
    tied["head"].weight = tied["emb"].weight
    assert [spec.name for spec in ModuleSink(tied).layout()] == ["emb.weight", "head.bias"]
    assert [block.name for block in FSDPWeightSource(tied).blocks()] == ["emb.weight", "head.bias"]


# -- one process, members in threads: protocol checks and bounded waits --------------------------------


def _in_threads(*calls):
    """Run the calls side by side (members of one collective); their results, or the exceptions they raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        results = []
        for future in futures:
            try:
                results.append(future.result(timeout=60))
            except Exception as exc:
                results.append(exc)
        return results


def test_join_without_peers_times_out():
    from rlrunner.weight_sync.channels import connect_store, serve_store
    from rlrunner.weight_sync.transport import WeightSender

    server = serve_store("127.0.0.1")
    started = time.monotonic()
    source = FSDPWeightSource(torch.nn.Linear(2, 2))
    with pytest.raises(WeightSyncError, match="no layout from rollout worker 0 within 1s"):
        WeightSender(connect_store("127.0.0.1", server.port, 1.0), 0, 1, 1, source, torch.device("cpu"), 1.0, "127.0.0.1")
    assert time.monotonic() - started < 10


def test_mismatched_bucket_size_is_caught_and_breaks_the_channels():
    from rlrunner.weight_sync.channels import connect_store, serve_store
    from rlrunner.weight_sync.transport import WeightReceiver, WeightSender

    server = serve_store("127.0.0.1")
    actor_model, rollout_model = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3).to(torch.bfloat16)
    cpu = torch.device("cpu")
    actor, rollout = _in_threads(
        lambda: WeightSender(connect_store("127.0.0.1", server.port, 2), 0, 1, 1, FSDPWeightSource(actor_model), cpu, 2,
                             "127.0.0.1"),
        lambda: WeightReceiver(connect_store("127.0.0.1", server.port, 2), 0, 1, 1, ModuleSink(rollout_model), cpu, 2,
                               "127.0.0.1"),
    )
    assert actor.backend == "gloo" and rollout.backends == ["gloo"]
    sent, received = _in_threads(lambda: actor.send(16), lambda: rollout.receive(16))
    assert sent["bytes"] == received["bytes"] == 30 and received["buckets"] == 2  # 16 + 14 bytes
    assert_bit_equal(dict(rollout_model.state_dict()), {n: t.to(torch.bfloat16) for n, t in actor_model.state_dict().items()})
    started = time.monotonic()
    _, received = _in_threads(lambda: actor.send(16), lambda: rollout.receive(64))
    assert time.monotonic() - started < 2 + 5  # the actor, whose buckets nobody takes, gives up after its timeout
    assert isinstance(received, WeightSyncError) and "expected [22355, 1, 64, 1]" in str(received), received
    with pytest.raises(WeightSyncError, match="broke in an earlier sync"):
        rollout.receive(16)
    actor.close()
    rollout.close()


# -- real processes, real gloo, real FSDP2 (no Ray) ------------------------------------------------

NUM_ACTORS, NUM_ROLLOUTS, TIMEOUT_S = 3, 2, 20.0


class Toy(torch.nn.Module):
    """Uneven and empty shards over 3 ranks, a tied weight, float and int buffers."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(7, 3)          # rows 3, 3, 1
        self.small = torch.nn.Linear(3, 4)           # weight rows 2, 2, 0; bias 2, 2, 0
        self.one = torch.nn.Parameter(torch.randn(1, 5))  # 1, 0, 0
        self.big = torch.nn.Parameter(torch.randn(9, 11) * 3)
        self.head = torch.nn.Linear(3, 7, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.randn(3))
        self.register_buffer("count", torch.tensor([2, 3]))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def _child(role: str, index: int, port: int, out_dir: str, dtype_name: str) -> None:
    try:
        _child_body(role, index, port, Path(out_dir), getattr(torch, dtype_name))
    except BaseException:
        (Path(out_dir) / f"{role}{index}.error").write_text(traceback.format_exc())
        raise


def _child_body(role: str, index: int, port: int, out: Path, dtype: torch.dtype) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from rlrunner.weight_sync.channels import connect_store
    from rlrunner.weight_sync.transport import WeightReceiver, WeightSender

    torch.set_num_threads(1)
    store = connect_store("127.0.0.1", port, TIMEOUT_S)
    if role == "actor":
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", store=dist.PrefixStore("fsdp/", store), rank=index, world_size=NUM_ACTORS,
                                timeout=timedelta(seconds=TIMEOUT_S))
        model = fully_shard(Toy(seed=1))
        # FSDP2's chunk boundaries (rows), checked against the full tensors
        boundaries = {}
        for name, tensor in model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            block = local_block(name, tensor)
            if block is not None:
                assert block.dim == 0 and torch.equal(full[block.start : block.stop], block.tensor), name
                boundaries[name] = (block.start, block.stop)
        sync = WeightSender(store, index, NUM_ACTORS, NUM_ROLLOUTS, FSDPWeightSource(model), torch.device("cpu"), TIMEOUT_S,
                            "127.0.0.1")
        results = {"boundaries": boundaries, "full": []}
        for step in range(2):
            full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t.clone() for n, t in model.state_dict().items()}
            results["full"].append(full)
            results[f"stats{step}"] = sync.send(bucket_bytes=40)
            with torch.no_grad():  # an 'update': every shard changes
                for param in model.parameters():
                    param.to_local().mul_(1.5).add_(0.01 * (index + 1))
                model.scale.add_(1)
        # a rollout worker is gone: the send must fail, not hang
        started = time.monotonic()
        try:
            sync.send(bucket_bytes=40)
            results["third"] = "sent"
        except Exception as exc:
            results["third"] = f"{type(exc).__name__}: {exc}"
        results["third_s"] = time.monotonic() - started
        torch.save(results, out / f"actor{index}.pt")
        dist.destroy_process_group()
    else:
        model = Toy(seed=100 + index).to(dtype)
        sync = WeightReceiver(store, index, NUM_ACTORS, NUM_ROLLOUTS, ModuleSink(model), torch.device("cpu"), TIMEOUT_S,
                              "127.0.0.1")
        results = {"states": [], "layout": [spec.name for spec in sync.layout]}  # plain: weights_only
        for _ in range(2):
            results["stats"] = sync.receive(bucket_bytes=40)
            results["states"].append({n: t.clone() for n, t in model.state_dict().items()})
        if index == 0:
            torch.save(results, out / f"rollout{index}.pt")
            return  # leaves: the third sync must fail on the other members
        started = time.monotonic()
        try:
            sync.receive(bucket_bytes=40)
            results["third"] = "received"
        except Exception as exc:
            results["third"] = f"{type(exc).__name__}: {exc}"
        results["third_s"] = time.monotonic() - started
        torch.save(results, out / f"rollout{index}.pt")


def test_fsdp2_shards_to_rollouts_over_gloo_processes(tmp_path):
    from rlrunner.weight_sync.channels import serve_store

    dtype = "bfloat16"

    server = serve_store("127.0.0.1", TIMEOUT_S)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_child, args=("actor", r, server.port, str(tmp_path), dtype)) for r in range(NUM_ACTORS)]
    procs += [ctx.Process(target=_child, args=("rollout", i, server.port, str(tmp_path), dtype)) for i in range(NUM_ROLLOUTS)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 120
    for proc in procs:
        proc.join(max(1.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.kill()
    errors = {p.name: p.read_text() for p in tmp_path.glob("*.error")}
    assert not errors, errors
    assert not alive, "a process hung"

    actors = [torch.load(tmp_path / f"actor{r}.pt", weights_only=True) for r in range(NUM_ACTORS)]
    rollouts = [torch.load(tmp_path / f"rollout{i}.pt", weights_only=True) for i in range(NUM_ROLLOUTS)]
    # FSDP2 split 7 rows as 3, 3, 1, 4 rows as 2, 2, 0, and 1 row as 1, 0, 0: every kind of shard was sent
    assert [a["boundaries"].get("emb.weight") for a in actors] == [(0, 3), (3, 6), (6, 7)]
    assert [a["boundaries"].get("small.weight") for a in actors] == [(0, 2), (2, 4), None]
    assert [a["boundaries"].get("one") for a in actors] == [(0, 1), None, None]
    assert "emb.weight" in rollouts[0]["layout"] and "head.weight" not in rollouts[0]["layout"]  # tied: sent once
    for step in range(2):
        full = actors[0]["full"][step]
        expected = {n: t.to(getattr(torch, dtype)) if t.is_floating_point() else t for n, t in full.items()}
        for rollout in rollouts:
            assert_bit_equal(rollout["states"][step], expected)
    assert rollouts[0]["stats"]["buckets"] > NUM_ACTORS  # 40-byte buckets: pieces were split
    # the third sync, with rollout worker 0 gone: every remaining member failed within the timeout
    for member in [*actors, rollouts[1]]:
        assert member["third"] not in ("sent", "received"), member["third"]
        assert member["third_s"] < TIMEOUT_S + 5


# -- real Ray groups: FSDPActorWorker (FSDP2, 2 ranks) -> RolloutWorker (2 workers) ------------------------


def _update_shards(cfg, num_ranks: int) -> list[dict[str, torch.Tensor]]:
    """A small actor batch built and sharded the way Trainer.train_step does (synthetic samples)."""
    from rlrunner.algorithms.grpo import group_advantages
    from rlrunner.models.loading import build_tokenizer, token_ids
    from rlrunner.runner.batching import build_actor_batch, shard_actor_batch

    tokenizer = build_tokenizer(cfg.model)
    ids = token_ids(cfg.model, tokenizer)
    samples, rewards = [], []
    for i in range(cfg.data.batch_size * cfg.algorithm.group_size):
        samples.append({"prompt_ids": tokenizer.encode(f"What is {i % 5}+2? "), "response_ids": tokenizer.encode(str(i % 7)) + [ids.eos[0]]})
        rewards.append(float(i % 2))
    advantages = group_advantages(torch.tensor(rewards), cfg.algorithm.group_size, cfg.algorithm.norm_adv_by_std)
    return shard_actor_batch(build_actor_batch(samples, advantages, ids.pad), num_ranks, 1)


def _rollout_state(worker) -> dict[str, torch.Tensor]:
    """Runs in a rollout worker: its model's state dict, on CPU."""
    return {name: tensor.detach().cpu().clone() for name, tensor in worker.engine.model.state_dict().items()}


def test_ray_groups_sync_bit_exact_and_fail_fast(ray_session, tmp_path):
    import ray
    from omegaconf import OmegaConf
    from ray import cloudpickle

    from conftest import run_config
    from rlrunner.cluster.worker_group import WorkerGroup
    from rlrunner.weight_sync.driver import connect_weight_sync, sync_weights
    from rlrunner.backends.fsdp.worker import FSDPActorWorker
    from rlrunner.rollout.worker import RolloutWorker

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this module by name
    cfg = run_config(tmp_path, "actor.num_workers=2")
    plain = lambda node: OmegaConf.to_container(node, resolve=True)  # noqa: E731
    actor_kwargs = {
        "model_cfg": plain(cfg.model), "actor_cfg": plain(cfg.actor), "algorithm_cfg": plain(cfg.algorithm),
        "init_seed": 1, "total_optimizer_steps": 10,
    }
    groups = []
    try:
        actors = WorkerGroup("actor", FSDPActorWorker, 2, worker_kwargs=actor_kwargs, cpus_per_worker=0.5, distributed=True,
                             call_timeout_s=60, wait=False)
        groups.append(actors)
        rollouts = {}
        for dtype in ("float32", "bfloat16"):
            kwargs = {"model_cfg": {**plain(cfg.model), "dtype": dtype}, "rollout_cfg": plain(cfg.rollout), "group_size": 2,
                      "verifier": "arithmetic", "seed": 7}
            rollouts[dtype] = WorkerGroup(f"rollout-{dtype}", RolloutWorker, 2, worker_kwargs=kwargs, cpus_per_worker=0.25,
                                          call_timeout_s=60, wait=False)
            groups.append(rollouts[dtype])
        for group in groups:
            group.wait_ready()
        actors.call_all("setup")

        def expected(dtype: str) -> dict[str, torch.Tensor]:
            full = actors.call_all("full_state_dict")[0]
            return {n: t.to(getattr(torch, dtype)) for n, t in full.items()}

        def rollout_states(group) -> list[dict[str, torch.Tensor]]:
            return group.get([w.__ray_call__.remote(_rollout_state) for w in group.workers])

        for dtype, group in rollouts.items():
            backends = connect_weight_sync(actors, group, timeout_s=30)
            assert backends == {"actor": ["gloo", "gloo"], "rollout": [["gloo", "gloo"]] * 2}
            stats = sync_weights(actors, group, bucket_bytes=64 << 10)  # several buckets per actor rank
            assert stats["bytes"] == sum(t.numel() for t in expected(dtype).values()) * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
            for state in rollout_states(group):
                assert_bit_equal(state, expected(dtype))

        # after an update the (bfloat16) rollout gets the new weights, on the channels joined above
        actors.call_each("update", [(shard,) for shard in _update_shards(cfg, 2)])
        group = rollouts["bfloat16"]
        before = rollout_states(group)[0]
        sync_weights(actors, group, bucket_bytes=64 << 10)
        after = rollout_states(group)
        assert any(not torch.equal(before[n], after[0][n]) for n in before)
        for state in after:
            assert_bit_equal(state, expected("bfloat16"))

        # a rollout worker killed before the sync: sync_weights raises promptly instead of hanging
        ray.kill(group.workers[1], no_restart=True)
        started = time.monotonic()
        with pytest.raises(Exception) as error:
            sync_weights(actors, group, bucket_bytes=64 << 10, timeout_s=60)
        assert time.monotonic() - started < 30
        assert not isinstance(error.value, TimeoutError), error.value
    finally:
        for group in groups:
            group.shutdown()
