"""`actor.layout_invariant`: the FSDP backend's update gives the same weights, optimizer state and metrics, bit for bit,
at data-parallel sizes 1, 2 and 4 (real gloo ranks of the real actor worker, no Ray);
a rank's state resharded from another size's snapshot parts is the state that size's own ranks hold; and a checkpoint
saved at dp 2 and resumed at dp 4 gives the same next step."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from spawned_ranks import spawn_ranks

from rlrunner.config import load_config

from conftest import TINY_MODEL, actor_worker_kwargs, assert_bit_equal

STEPS = 2
ROWS = 16  # 4 prompts x 4 samples: one mini-batch of 4 logical micro-batches of 4 rows (actor.micro_batch_size=4)


def _config(invariant: bool):
    return load_config(
        [
            "actor.micro_batch_size=4",
            f"actor.layout_invariant={str(invariant).lower()}",
            "actor.grad_clip=0.05",  # every step clips: the norm's bits decide the update
            "algorithm.entropy_coef=0.01",
            *TINY_MODEL,
        ]
    )


def _batch(step: int) -> dict[str, torch.Tensor]:
    from rlrunner.runner.batching import build_actor_batch

    gen = torch.Generator().manual_seed(step)
    samples = []
    for row in range(ROWS):
        prompt = torch.randint(3, 50, (4 + row % 3,), generator=gen).tolist()
        response = torch.randint(3, 50, (2 + row % 5,), generator=gen).tolist()
        logprobs = (-torch.rand(len(response), generator=gen)).tolist()
        samples.append({"prompt_ids": prompt, "response_ids": response, "logprobs": logprobs})
    return build_actor_batch(samples, torch.randn(ROWS, generator=gen), pad_id=0)


def _flat(state, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested state by path (the RNG part left out: a rank's own, not the training's)."""
    if isinstance(state, dict):
        return {k: v for key in state if key != "rng" for k, v in _flat(state[key], f"{prefix}{key}.").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in _flat(value, f"{prefix}{i}.").items()}
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    return {prefix: torch.tensor(float(state))} if isinstance(state, (int, float)) else {}


def _rank(
    rank: int,
    world: int,
    port: int,
    invariant: bool,
    out: str,
    reshard_from: str | None = None,
    checkpoint: tuple[str, str] | None = None,
) -> None:
    from rlrunner.backends.fsdp.snapshot_reshard import resharded_state
    from rlrunner.backends.fsdp.worker import FSDPActorWorker
    from rlrunner.runner.batching import shard_actor_batch
    from rlrunner.utils.tensors import map_tensors

    cfg = _config(invariant)
    kwargs = actor_worker_kwargs(cfg)
    kwargs["actor_cfg"]["layout_invariant"] = invariant
    worker = FSDPActorWorker(rank, world, **kwargs)
    worker.init_process_group("127.0.0.1", port, 60)
    worker.setup()
    results = []
    first = 1
    if checkpoint is not None and checkpoint[0] == "load":  # the DCP checkpoint of step 1, saved at another size
        worker.load_checkpoint(checkpoint[1], None)
        first = 2
    for step in range(first, STEPS + 1):
        shards = shard_actor_batch(_batch(step), world, 1, 4, None, invariant_min_count=4 if invariant else None)
        results.append(worker.update(shards[rank]))
        if checkpoint is not None and checkpoint[0] == "save" and step == 1:
            worker.start_checkpoint(checkpoint[1], step, False, None)
            worker.finish_checkpoint()
    weights = worker.full_state_dict()
    state = map_tensors(worker.rank_state().state_dict(), lambda t: t.to_local() if hasattr(t, "to_local") else t)
    resharded = None
    if reshard_from is not None:  # the other size's parts, as a snapshot holds them, loaded at this size
        old = sorted(Path(reshard_from).glob("rank*.pt"))
        parts = ((q, torch.load(path, weights_only=True)["state"]) for q, path in enumerate(old))
        resharded = resharded_state(worker.rank_state().state_dict(), parts, len(old), rank, world)
    torch.save(
        {"results": results, "weights": weights, "state": state, "resharded": resharded}, Path(out) / f"rank{rank}.pt"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _train(
    world: int,
    invariant: bool,
    out: Path,
    reshard_from: Path | None = None,
    checkpoint: tuple[str, str] | None = None,
) -> tuple[dict, list[dict]]:
    """The policy's weights after STEPS updates at `world` ranks, and the driver's actor metrics of each step; with
    `reshard_from` (a run at another size), each rank's state resharded from that run's parts equals its own."""
    from rlrunner.algorithms.objective import PolicyObjective
    from rlrunner.runner.metrics import actor_metrics

    out.mkdir()
    other = None if reshard_from is None else str(reshard_from)
    spawn_ranks(_rank, args=(world, _free_port(), invariant, str(out), other, checkpoint), nprocs=world)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]
    for rank in ranks if reshard_from is not None else []:
        assert_bit_equal(_flat(rank["resharded"]), _flat(rank["state"]))
    objective = PolicyObjective(_config(invariant).algorithm)
    steps = len(ranks[0]["results"])
    metrics = [actor_metrics([r["results"][step] for r in ranks], objective) for step in range(steps)]
    return ranks[0]["weights"], metrics


def _metric_bits(metrics: list[dict]) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": torch.tensor(v, dtype=torch.float64) for i, m in enumerate(metrics) for k, v in m.items()}


@pytest.fixture(scope="module")
def invariant_runs(tmp_path_factory) -> dict[int, tuple[dict, list[dict]]]:
    root = tmp_path_factory.mktemp("invariant")
    # 4, then 1 from 4's snapshot parts (shrunk), then 2 from 1's (grown)
    runs = {4: _train(4, True, root / "dp4")}
    runs[1] = _train(1, True, root / "dp1", reshard_from=root / "dp4")
    runs[2] = _train(2, True, root / "dp2", reshard_from=root / "dp1", checkpoint=("save", str(root / "ckpt")))
    # step 1's checkpoint, written at 2 ranks, resumed at 4 (DCP reshards it) for step 2
    runs["4 from 2"] = _train(4, True, root / "dp4-resumed", checkpoint=("load", str(root / "ckpt")))
    return runs


def test_the_same_weights_and_metrics_at_every_data_parallel_size(invariant_runs):
    weights, metrics = invariant_runs[1]
    assert metrics[0]["actor/grad_norm"] > 0.05  # clipped: the norm's bits reached the weights
    for world in (2, 4):
        got_weights, got_metrics = invariant_runs[world]
        assert_bit_equal(got_weights, weights)
        assert_bit_equal(_metric_bits(got_metrics), _metric_bits(metrics))
    resumed_weights, resumed_metrics = invariant_runs["4 from 2"]
    assert_bit_equal(resumed_weights, weights)  # a checkpoint saved at dp 2, resumed at dp 4
    assert_bit_equal(_metric_bits(resumed_metrics), _metric_bits(metrics[1:]))
