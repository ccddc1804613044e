"""The weight sync's plan (pieces, buckets, coverage, assembly) and its protocol between members in threads of one
process: no Ray, no subprocesses."""

from __future__ import annotations

import time

import pytest
import torch

from rlrunner.backends.fsdp.weights import FSDPWeightSource, shard_rows
from rlrunner.rollout.hf import ModuleSink
from rlrunner.weight_sync.plan import (
    Assembler,
    Piece,
    TensorSpec,
    WeightSyncError,
    channel_bucket_bytes,
    check_coverage,
    pack_bucket,
    plan_buckets,
)

from conftest import assert_bit_equal


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


def test_a_channel_s_buckets_are_a_32nd_of_what_its_rank_sends_within_4_mib_and_the_cap():
    f32, bf16 = torch.float32, torch.bfloat16
    mib = 1 << 20
    rows = lambda n, dtype: Piece("w", (n, 1024), 0, 0, n, dtype)  # noqa: E731 (n rows of 1024 elements)
    assert channel_bucket_bytes([rows(80 * 1024, f32)], 64 * mib) == 10 * mib  # 320 MiB sent: 32 buckets of 10 MiB
    assert channel_bucket_bytes([rows(80 * 1024, bf16), rows(80 * 1024, bf16)], 64 * mib) == 10 * mib  # the sum
    assert channel_bucket_bytes([rows(1024 * 1024, f32)], 64 * mib) == 64 * mib  # 4 GiB: the cap
    assert channel_bucket_bytes([rows(1024, f32)], 64 * mib) == 4 * mib  # 4 MiB sent: no smaller than 4 MiB
    assert channel_bucket_bytes([], 64 * mib) == 4 * mib
    assert channel_bucket_bytes([rows(1024, f32)], 16) == 16  # a cap below 4 MiB is the size
    odd = channel_bucket_bytes([Piece("v", (200 * mib + 8,), 0, 0, 200 * mib + 8, f32)], 64 * mib)
    assert odd % 64 == 0 and odd - 64 < (800 * mib + 32) / 32 <= odd  # rounded up to 64 bytes


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
        "w": torch.randn(4, 3, generator=gen),  # rows 2, 2, 0
        "e": torch.randn(7, 5, generator=gen) * 100,  # rows 3, 3, 1
        "cols": torch.randn(5, 6, generator=gen),  # columns 2, 2, 2 (dim 1: not one run of elements)
        "one": torch.randn(1, 6, generator=gen),  # rows 1, 0, 0
        "ties": torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, float("inf"), -0.0]),
        "steps": torch.tensor([3, 4, 5]),  # an int64 buffer, sent by rank 0 as is
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
    check_coverage(
        layout, [[Piece("a", (2, 2), 1, 0, 1, f32), Piece("b", (3,), 0, 0, 3, f32)], [Piece("a", (2, 2), 1, 1, 2, f32)]]
    )
    with pytest.raises(WeightSyncError, match="do not tile"):
        check_coverage(
            layout,
            [[Piece("a", (2, 2), 0, 0, 2, f32), Piece("b", (3,), 0, 0, 3, f32)], [Piece("a", (2, 2), 0, 1, 2, f32)]],
        )
    with pytest.raises(WeightSyncError, match="send 1 of its 2 rows"):
        check_coverage(layout, [good[0]])
    with pytest.raises(WeightSyncError, match="rollout model has"):
        check_coverage(layout, [[Piece("a", (2, 2), 0, 0, 2, torch.bfloat16), Piece("b", (3,), 0, 0, 3, f32)]])
    with pytest.raises(WeightSyncError, match="does not have"):
        check_coverage(layout, [[*good[0], Piece("c", (1,), 0, 0, 1, f32)], good[1]])
    with pytest.raises(WeightSyncError, match="different dimensions"):
        check_coverage(
            layout,
            [[Piece("a", (2, 2), 0, 0, 1, f32), Piece("b", (3,), 0, 0, 3, f32)], [Piece("a", (2, 2), 1, 1, 2, f32)]],
        )
    # tied weights are one tensor, wanted once under its first name
    tied = torch.nn.ModuleDict({"emb": torch.nn.Embedding(2, 2), "head": torch.nn.Linear(2, 2)})
    tied["head"].weight = tied["emb"].weight
    assert [spec.name for spec in ModuleSink(tied).layout()] == ["emb.weight", "head.bias"]
    assert [block.name for block in FSDPWeightSource(tied).blocks()] == ["emb.weight", "head.bias"]


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
        WeightSender(
            connect_store("127.0.0.1", server.port, 1.0), 0, 1, 1, source, torch.device("cpu"), 1.0, "127.0.0.1"
        )
    assert time.monotonic() - started < 10


def test_mismatched_bucket_size_is_caught_and_breaks_the_channels():
    from rlrunner.weight_sync.channels import connect_store, serve_store
    from rlrunner.weight_sync.transport import WeightReceiver, WeightSender

    server = serve_store("127.0.0.1")
    actor_model, rollout_model = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3).to(torch.bfloat16)
    cpu = torch.device("cpu")
    actor, rollout = _in_threads(
        lambda: WeightSender(
            connect_store("127.0.0.1", server.port, 2), 0, 1, 1, FSDPWeightSource(actor_model), cpu, 2, "127.0.0.1"
        ),
        lambda: WeightReceiver(
            connect_store("127.0.0.1", server.port, 2), 0, 1, 1, ModuleSink(rollout_model), cpu, 2, "127.0.0.1"
        ),
    )
    assert actor.backend == "gloo" and rollout.backends == ["gloo"]
    sent, received = _in_threads(lambda: actor.send(16), lambda: rollout.receive(16))
    assert sent["bytes"] == received["bytes"] == 30 and received["buckets"] == 2  # 16 + 14 bytes
    assert_bit_equal(
        dict(rollout_model.state_dict()), {n: t.to(torch.bfloat16) for n, t in actor_model.state_dict().items()}
    )
    started = time.monotonic()
    _, received = _in_threads(lambda: actor.send(16), lambda: rollout.receive(64))
    assert time.monotonic() - started < 2 + 5  # the actor, whose buckets nobody takes, gives up after its timeout
    assert isinstance(received, WeightSyncError) and "expected [22355, 1, 64, 1]" in str(received), received
    with pytest.raises(WeightSyncError, match="broke in an earlier sync"):
        rollout.receive(16)
    actor.close()
    rollout.close()


def test_a_kept_copy_is_whole_before_the_send_and_outlives_a_failed_one():
    """An overlapped run's sync keeps a copy of what it sends (`copy_blocks`): the next update, already queued behind
    the sync, may change the live weights before a rollout repair pushes the copy (`send_copy`) again."""
    from rlrunner.weight_sync.channels import connect_store, serve_store
    from rlrunner.weight_sync.transport import WeightReceiver, WeightSender

    actor_model, rollout_model = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3).to(torch.bfloat16)
    cpu = torch.device("cpu")

    def members():  # a join: a new rendezvous store, as `connect_weight_sync` gets at every join
        server = serve_store("127.0.0.1")
        return server, *_in_threads(
            lambda: WeightSender(
                connect_store("127.0.0.1", server.port, 2), 0, 1, 1, FSDPWeightSource(actor_model), cpu, 2, "127.0.0.1"
            ),
            lambda: WeightReceiver(
                connect_store("127.0.0.1", server.port, 2), 0, 1, 1, ModuleSink(rollout_model), cpu, 2, "127.0.0.1"
            ),
        )

    _, actor, rollout = members()
    sent_weights = {n: t.to(torch.bfloat16) for n, t in actor_model.state_dict().items()}
    copy = actor.copy_blocks()
    assert [t.dtype for t in copy] == [torch.bfloat16, torch.bfloat16]
    rollout.close()  # the receiver is lost: the send fails, the copy stays whole
    assert isinstance(_in_threads(lambda: actor.send_copy(16, copy))[0], Exception)
    with torch.no_grad():
        actor_model.weight.add_(1.0)  # the next update changes the live weights
    _, actor, rollout = members()  # the repair joins again and pushes the copy, not the live weights
    _in_threads(lambda: actor.send_copy(16, copy), lambda: rollout.receive(16))
    assert_bit_equal(dict(rollout_model.state_dict()), sent_weights)
    with pytest.raises(WeightSyncError, match="does not fit"):
        actor.send_copy(16, copy[:1])
    actor.close()
    rollout.close()
