"""DistributedAdamW (AdamW sharded over data parallelism) is AdamW + clip_grad_norm_ on the whole model, with real
gloo process groups laid out Megatron's way (global rank = dp_rank * tp + tp_rank), one process per rank.

The model is four plain parameters: a column-parallel weight and bias (split on dim 0 over TP), a row-parallel
weight (split on dim 1) and a replicated norm weight. The loss is elementwise in the parameters, so each TP
rank's loss over its own shard gives exactly its shard of the whole model's gradient, and the replicated
parameter's whole gradient on every TP rank; DP rank d trains on its own targets.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from ports import free_port
from spawned_ranks import spawn_ranks

from rlrunner.backends.megatron.distrib_optim import DistributedAdamW
from rlrunner.backends.megatron.moment_files import SlicedMoments, moment_slice_state

from conftest import assert_bit_equal

SHAPES = {"col.weight": (6, 5), "col.bias": (6,), "row.weight": (3, 6), "norm.weight": (5,)}
SPLIT_DIM = {"col.weight": 0, "col.bias": 0, "row.weight": 1}  # the rest is replicated
REPLICATED = {"norm.weight"}
# local sizes 27 + 5 (tp=2) and 54 + 5 (tp=1): both odd, so a DP size of 2 pads the flat space
LR, BETAS, WEIGHT_DECAY, MAX_NORM = 0.1, (0.9, 0.95), 0.1, 10.0
LOSS_SCALE = (1.0, 0.05, 1.0)  # per step: the first and last steps are clipped, the middle one is not
LR_FACTOR = (1.0, 0.5, 0.25)  # a LambdaLR on the inner optimizer, as the actor builds one


# --- the model, the loss and the reference -------------------------------------------------------------------


def _full_init() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) * 0.5 for name, shape in SHAPES.items()}


def _targets(step: int, dp_rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(weight, target) per parameter for DP rank `dp_rank` at `step`: its data."""
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    return {
        name: (torch.rand(shape, generator=gen) + 0.5, torch.randn(shape, generator=gen) * 3)
        for name, shape in SHAPES.items()
    }


def _shard(name: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    if name not in SPLIT_DIM:
        return full.clone()
    return full.chunk(tp, dim=SPLIT_DIM[name])[tp_rank].clone()


def _loss(params: dict[str, torch.Tensor], step: int, dp_rank: int, tp: int, tp_rank: int) -> torch.Tensor:
    """0.5 * sum c * (w - t)^2 over the given (local) parameters: elementwise, so shards add up to the whole."""
    loss = torch.zeros(())
    for name, (weight, target) in _targets(step, dp_rank).items():
        c, t = _shard(name, weight, tp, tp_rank), _shard(name, target, tp, tp_rank)
        loss = loss + 0.5 * (c * (params[name] - t).square()).sum()
    return loss * LOSS_SCALE[step]


def _lambda(step: int) -> float:
    return LR_FACTOR[min(step, len(LR_FACTOR) - 1)]


def _reference(dp: int, steps: int) -> tuple[dict[str, torch.nn.Parameter], torch.optim.AdamW, list[float]]:
    """The whole model on one process: AdamW + clip_grad_norm_ on the gradient averaged over the DP ranks."""
    params = {name: torch.nn.Parameter(t) for name, t in _full_init().items()}
    optimizer = torch.optim.AdamW(params.values(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lambda)
    norms = []
    for step in range(steps):
        grads = [torch.autograd.grad(_loss(params, step, d, 1, 0), list(params.values())) for d in range(dp)]
        for param, *per_rank in zip(params.values(), *grads):
            param.grad = torch.stack(per_rank).mean(0)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params.values(), MAX_NORM)))
        optimizer.step()
        scheduler.step()
    return params, optimizer, norms


# --- the distributed side ------------------------------------------------------------------------------------


class Rank:
    """This process's place in the dp x tp layout and its groups (every rank builds every group, in one order)."""

    def __init__(self, dp: int, tp: int, shard_gradients: bool = True):
        rank = dist.get_rank()
        self.dp, self.tp, self.shard_gradients = dp, tp, shard_gradients
        self.dp_rank, self.tp_rank = divmod(rank, tp)
        tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
        dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
        self.tp_group, self.dp_group = tp_groups[self.dp_rank], dp_groups[self.tp_rank]
        # one rank alone: for an optimizer at DP size 1 beside the DP size 2 one
        self.alone = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]

    def params(self, full: dict[str, torch.Tensor] | None = None) -> dict[str, torch.nn.Parameter]:
        full = _full_init() if full is None else full
        return {name: torch.nn.Parameter(_shard(name, t, self.tp, self.tp_rank)) for name, t in full.items()}

    def optimizer(self, params: dict[str, torch.nn.Parameter], dp_group=None) -> DistributedAdamW:
        dp_group = self.dp_group if dp_group is None else dp_group
        # chunks of 5 elements: every slice is stepped in several chunks, some cut inside a parameter; gradient buckets
        # of 12: col.weight (15 elements at tp 2, 30 at tp 1) goes straight to its owners, the rest are bucketed, the
        # bucket flushed when full and at the end of backward
        return DistributedAdamW(
            list(params.items()),
            dp_group,
            self.tp_group,
            REPLICATED,
            LR,
            BETAS,
            WEIGHT_DECAY,
            step_chunk_elements=5,
            shard_gradients=self.shard_gradients,
            bucket_elements=12,
        )

    def backward(self, params: dict[str, torch.nn.Parameter], step: int) -> None:
        _loss(params, step, self.dp_rank, self.tp, self.tp_rank).backward()


def _train(rank: Rank, params, opt: DistributedAdamW, steps: range, scheduler=None) -> list[float]:
    scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(opt.optimizer, _lambda)
    norms = []
    for step in steps:
        opt.zero_grad()
        rank.backward(params, step)
        _assert_gradients_sharded(rank, params, opt)
        opt.reduce_gradients()
        assert opt.grad_norm() == opt.grad_norm()  # no side effect, and the same value again
        norms.append(opt.clip_and_step(MAX_NORM))
        scheduler.step()
    return norms


def _assert_gradients_sharded(rank: Rank, params, opt: DistributedAdamW) -> None:
    """After backward a rank holds the gradient of its own slice only: above DP size 1 no parameter keeps a `.grad`
    (each was reduced onto its owners and dropped) and the gradient buffer is the slice, 1/dp of the shard. With
    whole gradients (or at DP size 1) every `.grad` is a view of the whole buffer."""
    if opt.space.dp_size == 1 or not rank.shard_gradients:
        assert all(
            p.grad is not None and p.grad.data_ptr() == view.data_ptr()
            for p, view in zip(params.values(), opt.space.views(opt.grads.buffer))
        )
        assert opt.grads.buffer.numel() >= opt.space.numel
        return
    assert all(p.grad is None for p in params.values())
    assert opt.grads.buffer.numel() == -(-opt.space.numel // rank.dp) < opt.space.numel


def _snapshot(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in params.items()}


def _assert_states_equal(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] and type(a["step"]) is int
    for key in ("exp_avg", "exp_avg_sq"):
        assert_bit_equal(a[key], b[key])


def _assert_dp_identical(rank: Rank, tensors: dict[str, torch.Tensor]) -> None:
    """Every DP replica of this TP rank holds these very bits."""
    for name, tensor in tensors.items():
        gathered = [torch.empty_like(tensor) for _ in range(rank.dp)]
        dist.all_gather(gathered, tensor.contiguous(), group=rank.dp_group)
        assert all(torch.equal(g, tensor) for g in gathered), name


def _gathered_slices(rank: Rank, opt: DistributedAdamW, dp_group=None) -> list[dict]:
    """What every DP rank of this TP rank writes to a checkpoint (`own_slice`), in DP rank order (gathered here only
    to read them back as the files would be)."""
    group = rank.dp_group if dp_group is None else dp_group
    slices = [None] * dist.get_world_size(group)
    dist.all_gather_object(slices, opt.own_slice(copy=True), group=group)
    return slices


def _saved_files(rank: Rank, opt: DistributedAdamW, dp_group=None) -> SlicedMoments:
    """The DP ranks' slice files of this TP rank, as a load reads them back (`moment_files.SlicedMoments`)."""
    slices = _gathered_slices(rank, opt, dp_group)
    states = [
        moment_slice_state(
            1, rank.tp, len(slices), d, s["step"], opt.layout(), s["start"], s["stop"], s["exp_avg"], s["exp_avg_sq"]
        )
        for d, s in enumerate(slices)
    ]
    return SlicedMoments(states[0], states.__getitem__, "test")


# --- scenarios (one per spawn) -------------------------------------------------------------------------------


def _check_training(rank: Rank) -> None:
    """dp x tp training equals the reference, is deterministic, keeps replicas identical and resumes exactly."""
    ref_params, ref_opt, ref_norms = _reference(rank.dp, 3)
    assert ref_norms[0] > MAX_NORM > ref_norms[1] and ref_norms[2] > MAX_NORM  # both branches of clipping run

    params = rank.params()
    opt = rank.optimizer(params)
    norms = _train(rank, params, opt, range(3))
    for norm, ref in zip(norms, ref_norms):
        assert abs(norm - ref) <= 1e-6 * ref, (norms, ref_norms)
    state = opt.full_state()
    assert state["step"] == 3
    for name, param in params.items():
        expected = _shard(name, ref_params[name].detach(), rank.tp, rank.tp_rank)
        assert torch.allclose(param.detach(), expected, rtol=0, atol=1e-6), (name, (param - expected).abs().max())
        # the state is per name, shaped like this rank's shard: the reference's moments split by TP
        for key in ("exp_avg", "exp_avg_sq"):
            moment = _shard(name, ref_opt.state[ref_params[name]][key], rank.tp, rank.tp_rank)
            assert state[key][name].dtype == torch.float32 and state[key][name].device.type == "cpu"
            assert torch.allclose(state[key][name], moment, rtol=1e-5, atol=1e-7), (name, key)
    assert opt.param_groups_state() == {
        "lr": LR * LR_FACTOR[2],
        "betas": BETAS,
        "eps": 1e-8,
        "weight_decay": WEIGHT_DECAY,
        "step": 3,
    }
    _assert_dp_identical(rank, _snapshot(params))
    _assert_dp_identical(rank, {"exp_avg." + k: v for k, v in state["exp_avg"].items()})  # returned on every DP rank
    # a checkpoint gathers nothing: each DP rank writes its own slice of the flat moments, and the slices of the DP
    # ranks, in order, tile the whole state
    slices = _gathered_slices(rank, opt)
    names = [name for name, _ in opt.layout()]
    assert names == list(params) and slices[0]["start"] == 0 and slices[-1]["stop"] == opt.space.numel
    assert all(a["stop"] == b["start"] for a, b in zip(slices, slices[1:]))
    assert all(
        s["stop"] - s["start"] == -(-opt.space.numel // rank.dp) for s in slices[:-1]
    )  # the padding is not saved
    for key in ("exp_avg", "exp_avg_sq"):
        flat = torch.cat([s[key] for s in slices])
        assert torch.equal(flat, torch.cat([state[key][name].reshape(-1) for name in names]))

    # run after run: the same bits
    again = rank.params()
    assert _train(rank, again, rank.optimizer(again), range(3)) == norms
    assert_bit_equal(_snapshot(again), _snapshot(params))

    # resume: state saved after two steps, loaded into a fresh optimizer, takes the third step bit for bit
    resumed = rank.params()
    first = rank.optimizer(resumed)
    scheduler = torch.optim.lr_scheduler.LambdaLR(first.optimizer, _lambda)
    _train(rank, resumed, first, range(2), scheduler)
    saved, lr_state = first.full_state(), scheduler.state_dict()
    files = _saved_files(rank, first)
    # the weights carried over into new parameters, as a load into a fresh model does (an optimizer's gradient hooks
    # are its parameters' own: one optimizer per set of parameters)
    resumed = {name: torch.nn.Parameter(param.detach().clone()) for name, param in resumed.items()}
    fresh = rank.optimizer(resumed)
    fresh.load_full_state(saved)
    _assert_states_equal(fresh.full_state(), saved)
    from_files = rank.optimizer(rank.params())  # the same state from the DP ranks' slice files: only its own slice read
    from_files.load_flat_state(files.step, files.layout, files.flat)
    _assert_states_equal(from_files.full_state(), saved)
    scheduler = torch.optim.lr_scheduler.LambdaLR(fresh.optimizer, _lambda)
    scheduler.load_state_dict(lr_state)
    fresh.optimizer.param_groups[0]["lr"] = scheduler.get_last_lr()[0]  # a LambdaLR's load leaves the LR alone
    _train(rank, resumed, fresh, range(2, 3), scheduler)
    assert_bit_equal(_snapshot(resumed), _snapshot(params))
    _assert_states_equal(fresh.full_state(), state)

    # an in-memory snapshot has no gradients: loading one clears what an interrupted step left behind
    rank.backward(params, 0)
    assert opt.grads.buffer.any()
    opt.load_local_state(
        {key: value.clone() if torch.is_tensor(value) else value for key, value in opt.local_state().items()}
    )
    assert not opt.grads.buffer.any() and all(p.grad is None or not p.grad.any() for p in params.values())
    _assert_states_equal(opt.full_state(), state)


def _check_non_finite(rank: Rank) -> None:
    """An inf or nan anywhere (one rank's shard, a replicated weight) skips the step on every rank alike."""
    params = rank.params()
    opt = rank.optimizer(params)
    _train(rank, params, opt, range(1))
    before, state = _snapshot(params), opt.full_state()
    for name, bad, culprit in (("col.weight", float("inf"), 0), ("norm.weight", float("nan"), rank.tp)):
        opt.zero_grad()
        rank.backward(params, 1)
        if dist.get_rank() == culprit:  # one process (rank tp: DP rank 1, TP rank 0); the rest learn of it via DP, TP
            grad = params[name].grad  # whole gradients: the view backward accumulated into
            if grad is None:  # sharded: backward has reduced and dropped it already; a `.grad` set now is reduced by
                # reduce_gradients, on every DP rank alike (the others' count as zeros)
                grad = params[name].grad = torch.zeros_like(params[name])
            grad.view(-1)[1] = bad
        opt.reduce_gradients()
        norm = opt.clip_and_step(MAX_NORM)
        assert (norm == float("inf")) if bad == float("inf") else (norm != norm), (name, norm)
        assert_bit_equal(_snapshot(params), before)
        _assert_states_equal(opt.full_state(), state)
    # the next finite step is taken
    opt.zero_grad()
    rank.backward(params, 1)
    opt.reduce_gradients()
    assert opt.clip_and_step(MAX_NORM) < float("inf") and opt.param_groups_state()["step"] == 2
    assert not torch.equal(params["col.weight"].detach(), before["col.weight"])


def _check_dp_resharding(rank: Rank) -> None:
    """State saved at DP size 2 loads at DP size 1 and the next step is the DP size 2 run's, bit for bit."""
    params = rank.params()
    opt = rank.optimizer(params)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, _lambda)
    _train(rank, params, opt, range(1), scheduler)
    saved, weights, files = opt.full_state(), _snapshot(params), _saved_files(rank, opt)
    _train(rank, params, opt, range(1, 2), scheduler)
    expected = opt.full_state()

    # a fresh DP size 1 optimizer; the saved weights are copied into its model afterwards, as a checkpoint load
    # does, and its step must start from them
    alone = rank.params({name: torch.zeros(shape) for name, shape in SHAPES.items()})  # TP size is 1 here
    single = rank.optimizer(alone, dp_group=rank.alone)
    with torch.no_grad():
        for name, param in alone.items():
            param.copy_(weights[name])
    single.load_full_state(saved)
    from_files = rank.optimizer(
        rank.params({name: torch.zeros(shape) for name, shape in SHAPES.items()}), dp_group=rank.alone
    )
    from_files.load_flat_state(files.step, files.layout, files.flat)  # the DP size 2 run's slice files, at DP size 1
    _assert_states_equal(from_files.full_state(), saved)
    grads = [torch.autograd.grad(_loss(alone, 1, d, 1, 0), list(alone.values())) for d in range(rank.dp)]
    for param, *per_rank in zip(alone.values(), *grads):
        param.grad = sum(per_rank) / rank.dp  # what the DP all_reduce (a sum) and the division give
    single.reduce_gradients()  # DP size 1: a no-op
    scheduler = torch.optim.lr_scheduler.LambdaLR(single.optimizer, _lambda)
    scheduler.step()  # the second step's LR, as the DP size 2 run had
    single.clip_and_step(MAX_NORM)
    assert_bit_equal(_snapshot(alone), _snapshot(params))
    _assert_states_equal(single.full_state(), expected)
    # a synchronous save writes the live moments (no copy), a background one a copy of its own
    live_moments = single.moments
    for copy in (False, True):
        own = single.own_slice(copy=copy)
        assert (own["start"], own["stop"], own["step"]) == (0, single.space.numel, 2)
        for key in ("exp_avg", "exp_avg_sq"):
            shares = own[key].untyped_storage().data_ptr() == live_moments[key].untyped_storage().data_ptr()
            assert shares == (not copy), (key, copy)
    # DP size 1's file loads at DP size 2: each rank reads its own slice of it
    back = rank.optimizer(rank.params())
    files = _saved_files(rank, single, dp_group=rank.alone)
    back.load_flat_state(files.step, files.layout, files.flat)
    _assert_states_equal(back.full_state(), expected)

    # and back: the DP size 1 state loads at DP size 2, given as dicts or as (name, tensor) pairs read one at a time
    # (what a load that reshards over TP sizes streams)
    whole = single.full_state()
    for given in (whole, {**whole, **{key: iter(whole[key].items()) for key in ("exp_avg", "exp_avg_sq")}}):
        back = rank.optimizer(rank.params())
        back.load_full_state(given)
        _assert_states_equal(back.full_state(), expected)


def _check_bad_state(rank: Rank) -> None:
    """A state that does not fit is refused with its key named, and nothing is loaded."""
    params = rank.params()
    opt = rank.optimizer(params)
    _train(rank, params, opt, range(1))
    good = opt.full_state()
    missing = {**good, "exp_avg": {k: v for k, v in good["exp_avg"].items() if k != "row.weight"}}
    reshaped = {**good, "exp_avg_sq": {**good["exp_avg_sq"], "norm.weight": torch.zeros(4)}}
    unknown = {**good, "exp_avg": {**good["exp_avg"], "extra.weight": torch.zeros(2)}}
    cases = [
        (missing, "exp_avg lacks parameter 'row.weight'"),
        (reshaped, r"exp_avg_sq\['norm.weight'\] has shape \(4,\), expected \(5,\)"),
        (unknown, "exp_avg has unknown parameter 'extra.weight'"),
        ({k: v for k, v in good.items() if k != "step"}, "lacks 'step'"),
    ]
    fresh = rank.optimizer(rank.params())
    for state, message in cases:
        with pytest.raises(ValueError, match=message):
            fresh.load_full_state(state)
        assert fresh.param_groups_state()["step"] == 0
        assert all(not moment.any() for moment in fresh.moments.values())
    # given as pairs, the same faults are named as they are read (the step is never set)
    for state, message in cases[:3]:
        pairs = {**state, **{key: iter(state[key].items()) for key in ("exp_avg", "exp_avg_sq")}}
        with pytest.raises(ValueError, match=message):
            fresh.load_full_state(pairs)
        assert fresh.param_groups_state()["step"] == 0
    # slice files saved for other parameters are refused before anything is loaded
    files, fresh = _saved_files(rank, opt), rank.optimizer(rank.params())
    layout = [(name, (4,) if name == "norm.weight" else shape) for name, shape in files.layout]
    with pytest.raises(ValueError, match=r"saved for other parameters: 'norm.weight' \(5,\) saved as \(4,\)"):
        fresh.load_flat_state(files.step, layout, files.flat)
    with pytest.raises(ValueError, match="saved for other parameters"):
        fresh.load_flat_state(files.step, files.layout[::-1], files.flat)
    assert fresh.param_groups_state()["step"] == 0 and all(not moment.any() for moment in fresh.moments.values())
    with pytest.raises(ValueError, match="replicated parameter 'norm.wieght'"):
        DistributedAdamW(list(params.items()), rank.dp_group, rank.tp_group, {"norm.wieght"}, LR, BETAS, 0.0)


SCENARIOS = {
    "training": [_check_training, _check_non_finite],
    "resharding": [_check_dp_resharding, _check_bad_state],
}


def _worker(rank: int, world: int, port: int, dp: int, tp: int, scenario: str, shard_gradients: bool = True) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        layout = Rank(dp, tp, shard_gradients)
        for check in SCENARIOS[scenario]:
            check(layout)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shard_gradients", [True, False], ids=["sharded_gradients", "whole_gradients"])
def test_dp2_tp2_matches_adamw_with_clipping_deterministic_resumable_and_skips_non_finite(shard_gradients) -> None:
    spawn_ranks(
        _worker, args=(4, free_port(), 2, 2, "training", shard_gradients), nprocs=4
    )  # raises with the rank's traceback


def test_dp2_state_reshards_to_dp1_bitwise_and_bad_state_is_named() -> None:
    spawn_ranks(_worker, args=(2, free_port(), 2, 1, "resharding"), nprocs=2)


def test_the_gradient_norm_s_squares_are_summed_a_chunk_at_a_time_in_fp64() -> None:
    from rlrunner.backends.megatron.grad_reducer import _square_sum

    values = torch.arange(1, 1001, dtype=torch.float32).reshape(10, 100)
    whole = values.double().square().sum()
    for chunk in (1, 7, 64, 1000, 5000):
        got = _square_sum(values, chunk)
        assert got.dtype == torch.float64 and got.item() == whole.item() == sum(i * i for i in range(1, 1001)), chunk
    assert _square_sum(values.t(), 64).item() == whole.item()  # a non-contiguous view
    assert _square_sum(torch.empty(0), 64).item() == 0.0
