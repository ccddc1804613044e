"""The Megatron backend's optimizer-state files: one `distrib_optim.pt` per tensor-parallel rank in megatron-core's
coalesced-bucket layout, written by data-parallel rank 0 from every data-parallel rank's slice (sent a piece at a
time; the ranks are threads here, the transfers queues: tests/integration/test_megatron_distrib_optim_file.py runs
real gloo groups, tests/integration/test_megatron_core.py megatron-core's own loader), read back as one flat vector or
per parameter at any data-parallel size. Older checkpoints' flat file (format 3), per data-parallel rank slice files
(format 2) and whole per-parameter file (format 1) are still read the same way, checked for gaps and strays. Real
files."""

from __future__ import annotations

import io
import math

import pytest
import torch

from rlrunner.backends.megatron import file_writes as mfw
from rlrunner.backends.megatron import files as mf
from rlrunner.backends.megatron.moment_files import (
    BUFFER_KEY,
    COALESCED_FORMAT,
    FLAT_FORMAT,
    LEGACY_FORMAT,
    CoalescedMoments,
    FlatMoments,
    coalesced_offsets_of,
    flat_moments_state,
    moment_file,
    moment_slice_state,
    optimizer_file,
    read_moments,
)
from rlrunner.storage import open_storage

from conftest import assert_bit_equal

LAYOUT = [("a.weight", (3, 4)), ("b.bias", (5,)), ("c.weight", (2, 3))]  # 12 + 5 + 6 = 23 elements: odd
NUMEL = 23


def _flat(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


MOMENTS = {"exp_avg": _flat(1), "exp_avg_sq": _flat(2).abs()}
STATE = {"param": _flat(3), **MOMENTS}  # what the coalesced file holds
# megatron-core's order of the same parameters (another than ours): the file holds c, then a, then b, each 64-aligned
MEGATRON_ORDER = ["b.bias", "a.weight", "c.weight"]
FILE_NUMEL = 128 + 5


def _write_slices(root: str, dp: int, iteration: int = 5, tp_rank: int = 0, step: int = 7) -> None:
    """What `dp` data-parallel ranks wrote before `distrib_optim.pt` came back (format 2, the old writer's files):
    ceil(23 / dp) elements each, the last one shorter (no padding saved)."""
    storage = open_storage(root)
    size = -(-NUMEL // dp)
    for dp_rank in range(dp):
        start, stop = min(dp_rank * size, NUMEL), min((dp_rank + 1) * size, NUMEL)
        state = moment_slice_state(
            iteration,
            1,
            dp,
            dp_rank,
            step,
            LAYOUT,
            start,
            stop,
            MOMENTS["exp_avg"][start:stop],
            MOMENTS["exp_avg_sq"][start:stop],
        )
        mfw.write_state_file(storage, root, moment_file(iteration, tp_rank, dp_rank), state)


def _per_parameter(flat: torch.Tensor) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, shape in LAYOUT:
        out[name] = flat[offset : offset + math.prod(shape)].view(shape)
        offset += math.prod(shape)
    return out


def test_names() -> None:
    assert optimizer_file(50, 1) == "iter_0000050/mp_rank_01/distrib_optim.pt"
    assert moment_file(50, 1, 2) == "iter_0000050/mp_rank_01/distrib_optim_dp_002.pt"  # format 2 (read only)


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_slices_read_back_as_one_flat_vector_and_per_parameter(tmp_path, dp) -> None:
    root = str(tmp_path)
    _write_slices(root, dp)
    moments = read_moments(open_storage(root), root, 5, 0)
    assert moments.step == 7 and moments.layout == LAYOUT and moments.numel == NUMEL
    for key, flat in MOMENTS.items():
        assert torch.equal(moments.flat(key, 0, NUMEL), flat)
        for start, stop in ((0, 0), (3, 9), (5, 17), (11, 23), (22, 23)):  # inside one slice, across slices
            assert torch.equal(moments.flat(key, start, stop), flat[start:stop])
        expected = _per_parameter(flat)
        lazy = moments.tensors(key)
        assert list(lazy) == [name for name, _ in LAYOUT] and len(lazy) == 3
        assert_bit_equal(dict(lazy), expected)
        assert_bit_equal({name: moments.tensor(key, name) for name in lazy}, expected)


def test_a_range_inside_one_file_is_a_view_of_the_mapped_file(tmp_path) -> None:
    root = str(tmp_path)
    _write_slices(root, 2)  # slices 0:12 and 12:23
    moments = read_moments(open_storage(root), root, 5, 0)
    inside, across = moments.flat("exp_avg", 2, 10), moments.flat("exp_avg", 10, 14)
    first = moments.opened[0]["exp_avg"]
    assert inside.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()  # no copy
    assert across.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()


def test_a_rank_opens_its_own_slice_file_first_and_only_what_it_reads(tmp_path) -> None:
    root = str(tmp_path)
    _write_slices(root, 3)  # slices 0:8, 8:16, 16:23
    moments = read_moments(open_storage(root), root, 5, 0, dp_rank=2)  # the same data-parallel size: its own file
    assert sorted(moments.opened) == [2] and moments.step == 7 and moments.layout == LAYOUT
    assert torch.equal(moments.flat("exp_avg", 16, 23), MOMENTS["exp_avg"][16:23])
    assert sorted(moments.opened) == [2]
    assert torch.equal(moments.flat("exp_avg_sq", 6, 23), MOMENTS["exp_avg_sq"][6:23])  # across all three
    assert sorted(moments.opened) == [0, 1, 2]
    # a rank beyond the saved data-parallel size (it grew) starts from file 0
    moments = read_moments(open_storage(root), root, 5, 0, dp_rank=5)
    assert sorted(moments.opened) == [0] and torch.equal(moments.flat("exp_avg", 0, NUMEL), MOMENTS["exp_avg"])
    (tmp_path / moment_file(5, 0, 0)).unlink()  # file 0 is not needed by a rank whose own file is there
    assert torch.equal(
        read_moments(open_storage(root), root, 5, 0, dp_rank=1).flat("exp_avg", 8, 16), MOMENTS["exp_avg"][8:16]
    )


def test_the_earlier_single_file_layout_is_read_the_same_way(tmp_path) -> None:
    root = str(tmp_path)
    storage = open_storage(root)
    legacy = {
        "format": LEGACY_FORMAT,
        "iteration": 5,
        "tensor_model_parallel_size": 1,
        "data_parallel_size": 2,
        "step": 7,
        **{key: _per_parameter(flat.clone()) for key, flat in MOMENTS.items()},
    }
    mfw.write_state_file(storage, root, optimizer_file(5, 0), legacy)
    moments = read_moments(storage, root, 5, 0)
    assert moments.step == 7 and moments.layout == LAYOUT
    for key, flat in MOMENTS.items():
        assert torch.equal(moments.flat(key, 0, NUMEL), flat)
        assert torch.equal(moments.flat(key, 10, 20), flat[10:20])
        assert torch.equal(moments.tensor(key, "b.bias"), flat[12:17])


def test_missing_stray_and_inconsistent_slices_are_named(tmp_path) -> None:
    storage = open_storage(str(tmp_path))

    def case(name: str) -> str:
        root = str(tmp_path / name)
        _write_slices(root, 3)
        return root

    with pytest.raises(FileNotFoundError, match=r"mp_rank_00/distrib_optim.pt is missing \(the optimizer moments"):
        read_moments(storage, str(tmp_path / "empty"), 5, 0)

    root = case("missing")
    (tmp_path / "missing" / moment_file(5, 0, 2)).unlink()
    moments = read_moments(storage, root, 5, 0)
    assert torch.equal(moments.flat("exp_avg", 0, 16), MOMENTS["exp_avg"][:16])  # ranks 0 and 1 need only theirs
    assert sorted(moments.opened) == [0, 1]
    with pytest.raises(
        FileNotFoundError, match=r"distrib_optim_dp_002.pt is missing \(saved at data-parallel size 3\)"
    ):
        moments.flat("exp_avg", 15, 17)

    root = case("stray")  # another run's slice (another data-parallel size) in place of rank 1's
    state = moment_slice_state(5, 1, 2, 1, 7, LAYOUT, 12, 23, MOMENTS["exp_avg"][12:], MOMENTS["exp_avg_sq"][12:])
    mfw.write_state_file(storage, root, moment_file(5, 0, 1), state)
    with pytest.raises(ValueError, match="data-parallel rank 1: the file says rank 1 of 2, not 1 of 3"):
        read_moments(storage, root, 5, 0).tensor("exp_avg", "b.bias")

    root = case("step")
    state = moment_slice_state(5, 1, 3, 1, 8, LAYOUT, 8, 16, MOMENTS["exp_avg"][8:16], MOMENTS["exp_avg_sq"][8:16])
    mfw.write_state_file(storage, root, moment_file(5, 0, 1), state)
    with pytest.raises(ValueError, match="data-parallel rank 1: its step or parameters differ"):
        read_moments(storage, root, 5, 0).flat("exp_avg_sq", 0, NUMEL)

    root = case("gap")
    state = moment_slice_state(5, 1, 3, 1, 7, LAYOUT, 9, 16, MOMENTS["exp_avg"][9:16], MOMENTS["exp_avg_sq"][9:16])
    mfw.write_state_file(storage, root, moment_file(5, 0, 1), state)
    with pytest.raises(ValueError, match="holds elements 9:16, expected 8:16"):
        read_moments(storage, root, 5, 0).flat("exp_avg", 8, 9)
    with pytest.raises(ValueError, match=r"elements 20:24 are outside the 23 saved"):
        read_moments(storage, root, 5, 0).flat("exp_avg", 20, 24)

    root = case("other")  # not a moments file at all
    mfw.write_state_file(storage, root, moment_file(5, 0, 0), {"format": "something else"})
    with pytest.raises(ValueError, match="not a distributed-optimizer file of format rlrunner.distrib_optim/2"):
        read_moments(storage, root, 5, 0)

    with pytest.raises(ValueError, match=r"exp_avg has shape \(3,\) for elements 0:4"):
        moment_slice_state(5, 1, 1, 0, 7, LAYOUT, 0, 4, torch.zeros(3), torch.zeros(4))


# --- distrib_optim.pt (format 4): written by data-parallel rank 0, the other ranks' slices streamed into it ----------


def _own(dp: int, dp_rank: int, step: int = 7) -> dict:
    """`DistributedAdamW.own_slice` of data-parallel rank `dp_rank` of `dp`."""
    size = -(-NUMEL // dp)
    start, stop = min(dp_rank * size, NUMEL), min((dp_rank + 1) * size, NUMEL)
    return {"step": step, "start": start, "stop": stop, **{key: flat[start:stop] for key, flat in STATE.items()}}


def _coalesced(flat: torch.Tensor) -> torch.Tensor:
    """`flat` (our order) as megatron-core's buffer holds it for MEGATRON_ORDER: c at 0, a at 64, b at 128."""
    out = torch.zeros(FILE_NUMEL)
    out[0:6], out[64:76], out[128:133] = flat[17:23], flat[0:12], flat[12:17]
    return out


def _save(root: str, dp: int, chunk: int, rank0_parts=None, rank0_files=None, tp_rank: int = 0) -> list:
    """Save tensor-parallel rank `tp_rank`'s `distrib_optim.pt` from `dp` data-parallel ranks run as threads, each
    transfer a bounded queue (a sender waits until its chunk is taken, as over a process group); the ranks' saves.
    `rank0_parts` wraps rank 0's parts of each tensor, `rank0_files` adds files rank 0 writes first."""
    import queue
    import threading

    from rlrunner.backends.megatron.moment_save import MomentSave
    from rlrunner.backends.megatron.rank_state import MegatronRankState

    channels = [queue.Queue(maxsize=1) for _ in range(dp)]  # sender's rank -> its chunks to rank 0
    offsets, numel = coalesced_offsets_of(LAYOUT, MEGATRON_ORDER, dp)
    assert (offsets, numel) == ([64, 128, 0], FILE_NUMEL)
    saves = [
        MomentSave(
            5,
            2,
            tp_rank,
            LAYOUT,
            offsets,
            numel,
            _own(dp, d),
            chunk_elements=chunk,
            dp=dp,
            dp_rank=d,
            send=lambda tensor, to, d=d: channels[d].put(tensor.clone(), timeout=10),
            receive=lambda into, src: into.copy_(channels[src].get(timeout=10)),
        )
        for d in range(dp)
    ]
    results: list = [None] * dp

    def rank(d: int) -> None:
        files, deferred = saves[d].files()
        if d == 0:
            files = {**(rank0_files or {}), **files}
            if rank0_parts is not None:
                deferred = {key: (lambda produce=produce: rank0_parts(produce())) for key, produce in deferred.items()}
        try:
            results[d] = MegatronRankState(files, deferred, (saves[d].finish,)).write(root, None)
        except Exception as exc:  # noqa: BLE001 (returned)
            results[d] = exc

    threads = [threading.Thread(target=rank, args=(d,)) for d in range(dp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a rank is left waiting in a transfer"
    assert all(save.done == len(save.plan) for save in saves)  # every transfer made, by both sides
    return results


@pytest.mark.parametrize("dp,chunk", [(1, 4), (2, 5), (3, 4), (3, 1 << 20), (4, 3)])
def test_one_file_per_tensor_parallel_rank_from_every_data_parallel_slice(tmp_path, dp, chunk) -> None:
    root = str(tmp_path)
    results = _save(root, dp, chunk, tp_rank=1)
    assert list(results[0]) == [optimizer_file(5, 1)] and all(r == {} for r in results[1:])  # recorded once, by rank 0
    assert sorted(p.name for p in (tmp_path / "iter_0000005" / "mp_rank_01").iterdir()) == ["distrib_optim.pt"]
    path = tmp_path / optimizer_file(5, 1)
    assert results[0][optimizer_file(5, 1)].size == path.stat().st_size
    state = mf.load_file(str(path))  # torch.load(weights_only=True)
    assert state == {
        **state,
        "buckets_coalesced": True,
        "format": COALESCED_FORMAT,
        "iteration": 5,
        "tensor_model_parallel_size": 2,
        "data_parallel_size": dp,
        "step": 7,
        "params": [["a.weight", [3, 4], 64], ["b.bias", [5], 128], ["c.weight", [2, 3], 0]],
    }
    buffer = state[0][BUFFER_KEY]
    assert list(state[0]) == [BUFFER_KEY] and buffer["numel_unpadded"] == FILE_NUMEL
    assert_bit_equal({key: buffer[key] for key in STATE}, {key: _coalesced(flat) for key, flat in STATE.items()})
    plain = io.BytesIO()  # torch.save's own file: the same records in the same places
    torch.save(dict(state), plain)
    assert path.stat().st_size == len(plain.getvalue())

    moments = read_moments(open_storage(root), root, 5, 1)
    assert isinstance(moments, CoalescedMoments) and moments.step == 7 and moments.layout == LAYOUT
    for key, flat in STATE.items():
        for reader_dp in (1, 2, 3, 5):  # each rank of another data-parallel size reads its own slice
            size = -(-NUMEL // reader_dp)
            for d in range(reader_dp):
                start, stop = min(d * size, NUMEL), min((d + 1) * size, NUMEL)
                assert torch.equal(moments.flat(key, start, stop), flat[start:stop])
        assert_bit_equal(dict(moments.tensors(key)), _per_parameter(flat))
    inside = moments.flat("exp_avg", 3, 9)  # a view of the mapped file: no copy
    assert inside.untyped_storage().data_ptr() == moments.buffer["exp_avg"].untyped_storage().data_ptr()
    with pytest.raises(ValueError, match=r"elements 20:24 are outside the 23 saved"):
        moments.flat("exp_avg", 20, 24)


def test_the_earlier_flat_file_is_read_the_same_way(tmp_path) -> None:
    root = str(tmp_path)
    storage = open_storage(root)
    mfw.write_state_file(storage, root, optimizer_file(5, 0), flat_moments_state(5, 1, 7, LAYOUT, **MOMENTS))
    moments = read_moments(storage, root, 5, 0)
    assert isinstance(moments, FlatMoments) and moments.step == 7 and moments.layout == LAYOUT
    for key, flat in MOMENTS.items():
        assert torch.equal(moments.flat(key, 4, 20), flat[4:20])
        assert_bit_equal(dict(moments.tensors(key)), _per_parameter(flat))


def test_a_failed_write_still_takes_every_slice_so_no_rank_is_left_waiting(tmp_path) -> None:
    # rank 0 fails before the moments' file (its other file cannot be saved): it receives and drops them all
    bad = {"other.pt": {"x": object()}}
    results = _save(str(tmp_path / "before"), 3, 4, rank0_files=bad)
    assert isinstance(results[0], TypeError) and results[1:] == [{}, {}]

    def failing(parts):  # rank 0 fails halfway through a moment, after it has taken some chunks
        for index, part in enumerate(parts):
            if index == 3:
                raise OSError("the store went away")
            yield part

    results = _save(str(tmp_path / "during"), 3, 4, rank0_parts=failing)
    assert isinstance(results[0], OSError) and results[1:] == [{}, {}]
    assert not (tmp_path / "during" / optimizer_file(5, 0)).exists()  # nothing half written is left


def test_a_slice_that_is_not_the_rank_s_own_is_refused() -> None:
    from rlrunner.backends.megatron.moment_save import MomentSave

    with pytest.raises(ValueError, match=r"DP rank 1 of 2 owns elements 11:23, expected 12:23 of 23"):
        MomentSave(
            5,
            1,
            0,
            LAYOUT,
            [64, 128, 0],
            FILE_NUMEL,
            {**_own(2, 1), "start": 11},
            dp=2,
            dp_rank=1,
            send=print,
            receive=print,
        )


def test_a_truncated_or_foreign_file_is_named_in_one_line(tmp_path) -> None:
    root = str(tmp_path)
    _save(root, 2, 5)
    path = tmp_path / optimizer_file(5, 0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    for mmap in (True, False):
        with pytest.raises(ValueError) as error:
            read_moments(open_storage(root), root, 5, 0, mmap=mmap)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"{path} cannot be read (truncated or corrupt?): "), message
    mfw.write_state_file(open_storage(root), root, optimizer_file(5, 0), {"format": "something else"})
    with pytest.raises(
        ValueError,
        match="not a distributed-optimizer file of format rlrunner.distrib_optim/4 or rlrunner.distrib_optim/3 or "
        "rlrunner.distrib_optim/1",
    ):
        read_moments(open_storage(root), root, 5, 0)
    state = {
        "format": FLAT_FORMAT,
        "iteration": 5,
        "tensor_model_parallel_size": 1,
        "step": 7,
        "params": [[name, list(shape)] for name, shape in LAYOUT],
        "exp_avg": MOMENTS["exp_avg"][:20],
        "exp_avg_sq": MOMENTS["exp_avg_sq"],
    }
    mfw.write_state_file(open_storage(root), root, optimizer_file(5, 0), state)
    with pytest.raises(
        ValueError, match=r"distrib_optim.pt: exp_avg is torch.float32 \(20,\), not the float32 \(23,\)"
    ):
        read_moments(open_storage(root), root, 5, 0)


def test_from_a_store_a_rank_reads_only_the_ranges_it_looks_up(tmp_path, s3_store, monkeypatch) -> None:
    url, options = s3_store
    _save(str(tmp_path), 3, 4)
    storage = open_storage(url, options)
    storage.put_file(str(tmp_path / optimizer_file(5, 0)), storage.join(url, optimizer_file(5, 0)))
    monkeypatch.setattr(type(storage), "get_file", lambda *a: pytest.fail("the whole file was downloaded"))
    opened = []
    open_read = type(storage).open_read
    monkeypatch.setattr(type(storage), "open_read", lambda self, u: opened.append(u) or open_read(self, u))
    moments = read_moments(storage, url, 5, 0)
    assert isinstance(moments, CoalescedMoments) and moments.step == 7 and moments.layout == LAYOUT
    assert not any(moments.buffer[key].any() for key in STATE)  # the structure only: no tensor bytes fetched
    for key, flat in STATE.items():
        for start, stop in ((0, 8), (8, 16), (16, 23), (5, 5), (0, 23)):
            assert torch.equal(moments.flat(key, start, stop), flat[start:stop])
        assert_bit_equal(dict(moments.tensors(key)), _per_parameter(flat))
    assert len(opened) > 1  # a ranged read per range
    blob = storage.join(url, optimizer_file(5, 0))
    with storage.open_write(blob) as writer:  # truncated on the store
        writer.write((tmp_path / optimizer_file(5, 0)).read_bytes()[:300])
    with pytest.raises(ValueError, match=r"distrib_optim.pt cannot be read \(truncated or corrupt\?\)"):
        read_moments(storage, url, 5, 0)
