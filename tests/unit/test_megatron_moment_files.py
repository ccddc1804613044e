"""The Megatron backend's optimizer-moment files: one per data-parallel rank, read back as one flat vector or per
parameter, checked for gaps and strays; the earlier one-file layout still read the same way. Real files."""

from __future__ import annotations

import math

import pytest
import torch

from rlrunner.backends.megatron import files as mf
from rlrunner.backends.megatron.moment_files import (
    LEGACY_FORMAT,
    legacy_moment_file,
    moment_file,
    moment_slice_state,
    read_moments,
)
from rlrunner.storage import open_storage

LAYOUT = [("a.weight", (3, 4)), ("b.bias", (5,)), ("c.weight", (2, 3))]  # 12 + 5 + 6 = 23 elements: odd
NUMEL = 23


def _flat(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


MOMENTS = {"exp_avg": _flat(1), "exp_avg_sq": _flat(2).abs()}


def _write_slices(root: str, dp: int, iteration: int = 5, tp_rank: int = 0, step: int = 7) -> None:
    """What `dp` data-parallel ranks write: ceil(23 / dp) elements each, the last one shorter (no padding saved)."""
    storage = open_storage(root)
    size = -(-NUMEL // dp)
    for dp_rank in range(dp):
        start, stop = min(dp_rank * size, NUMEL), min((dp_rank + 1) * size, NUMEL)
        state = moment_slice_state(iteration, 1, dp, dp_rank, step, LAYOUT, start, stop,
                                   MOMENTS["exp_avg"][start:stop], MOMENTS["exp_avg_sq"][start:stop])
        mf.write_state_file(storage, root, moment_file(iteration, tp_rank, dp_rank), state)


def _per_parameter(flat: torch.Tensor) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, shape in LAYOUT:
        out[name] = flat[offset : offset + math.prod(shape)].view(shape)
        offset += math.prod(shape)
    return out


def test_names() -> None:
    assert moment_file(50, 1, 2) == "iter_0000050/mp_rank_01/distrib_optim_dp_002.pt"
    assert legacy_moment_file(50, 1) == "iter_0000050/mp_rank_01/distrib_optim.pt"


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
        for name, tensor in expected.items():
            assert torch.equal(lazy[name], tensor) and torch.equal(moments.tensor(key, name), tensor)


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
    assert torch.equal(read_moments(open_storage(root), root, 5, 0, dp_rank=1).flat("exp_avg", 8, 16),
                       MOMENTS["exp_avg"][8:16])


def test_the_earlier_single_file_layout_is_read_the_same_way(tmp_path) -> None:
    root = str(tmp_path)
    storage = open_storage(root)
    legacy = {"format": LEGACY_FORMAT, "iteration": 5, "tensor_model_parallel_size": 1, "data_parallel_size": 2,
              "step": 7, **{key: _per_parameter(flat.clone()) for key, flat in MOMENTS.items()}}
    mf.write_state_file(storage, root, legacy_moment_file(5, 0), legacy)
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

    with pytest.raises(FileNotFoundError, match="distrib_optim_dp_000.pt is missing"):
        read_moments(storage, str(tmp_path / "empty"), 5, 0)

    root = case("missing")
    (tmp_path / "missing" / moment_file(5, 0, 2)).unlink()
    moments = read_moments(storage, root, 5, 0)
    assert torch.equal(moments.flat("exp_avg", 0, 16), MOMENTS["exp_avg"][:16])  # ranks 0 and 1 need only theirs
    assert sorted(moments.opened) == [0, 1]
    with pytest.raises(FileNotFoundError, match=r"distrib_optim_dp_002.pt is missing \(saved at data-parallel size 3\)"):
        moments.flat("exp_avg", 15, 17)

    root = case("stray")  # another run's slice (another data-parallel size) in place of rank 1's
    state = moment_slice_state(5, 1, 2, 1, 7, LAYOUT, 12, 23, MOMENTS["exp_avg"][12:], MOMENTS["exp_avg_sq"][12:])
    mf.write_state_file(storage, root, moment_file(5, 0, 1), state)
    with pytest.raises(ValueError, match="data-parallel rank 1: the file says rank 1 of 2, not 1 of 3"):
        read_moments(storage, root, 5, 0).tensor("exp_avg", "b.bias")

    root = case("step")
    state = moment_slice_state(5, 1, 3, 1, 8, LAYOUT, 8, 16, MOMENTS["exp_avg"][8:16], MOMENTS["exp_avg_sq"][8:16])
    mf.write_state_file(storage, root, moment_file(5, 0, 1), state)
    with pytest.raises(ValueError, match="data-parallel rank 1: its step or parameters differ"):
        read_moments(storage, root, 5, 0).flat("exp_avg_sq", 0, NUMEL)

    root = case("gap")
    state = moment_slice_state(5, 1, 3, 1, 7, LAYOUT, 9, 16, MOMENTS["exp_avg"][9:16], MOMENTS["exp_avg_sq"][9:16])
    mf.write_state_file(storage, root, moment_file(5, 0, 1), state)
    with pytest.raises(ValueError, match="holds elements 9:16, expected 8:16"):
        read_moments(storage, root, 5, 0).flat("exp_avg", 8, 9)
    with pytest.raises(ValueError, match=r"elements 20:24 are outside the 23 saved"):
        read_moments(storage, root, 5, 0).flat("exp_avg", 20, 24)

    root = case("other")  # not a moments file at all
    mf.write_state_file(storage, root, moment_file(5, 0, 0), {"format": "something else"})
    with pytest.raises(ValueError, match="not a distributed-optimizer file of format rlrunner.distrib_optim/2"):
        read_moments(storage, root, 5, 0)

    with pytest.raises(ValueError, match=r"exp_avg has shape \(3,\) for elements 0:4"):
        moment_slice_state(5, 1, 1, 0, 7, LAYOUT, 0, 4, torch.zeros(3), torch.zeros(4))
