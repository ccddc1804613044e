"""How a run's two worker groups are placed and built: the WorkerGroup arguments of the actor and rollout groups."""

from __future__ import annotations

from typing import Any, Callable

from omegaconf import OmegaConf

from rlrunner.cluster import parked_groups
from rlrunner.cluster.resources import fits_cluster, free_covers, placeable
from rlrunner.cluster.spares import SparePool
from rlrunner.rollout.worker import RolloutWorker
from rlrunner.runner.context import RunContext
from rlrunner.runner.elastic import Layout
from rlrunner.utils.seeding import derive_seed

START_TIMEOUT_S = 300.0  # bound on starting workers (imports, model build), whatever the step timeout


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True)


def group_specs(ctx: RunContext, placement_timeout_s: float, abandon: Callable[[], bool]) -> tuple[dict, dict]:
    """The keyword arguments of `WorkerGroup` for the actor group and for the rollout group. Both start without
    waiting (`wait=False`), so that they start side by side; `abandon()` turning true ends a wait for resources."""
    cfg = ctx.cfg
    cluster, recovery = cfg.cluster, cfg.runner.recovery
    common = {"threads": cluster.threads_per_worker, "use_gpu": cluster.gpus_per_worker > 0}
    placement = {
        "gpus_per_worker": cluster.gpus_per_worker,
        "placement_strategy": cluster.placement_strategy,
        "placement_timeout_s": placement_timeout_s,
        "call_timeout_s": recovery.step_timeout_s,
        # a collective inside a save or load may wait as long as the slowest rank's I/O
        "dist_timeout_s": max(recovery.step_timeout_s, recovery.checkpoint_timeout_s),
        "abandon": abandon,
        "start_timeout_s": START_TIMEOUT_S,
        "wait": False,
        "reuse": cluster.reuse_workers,
    }
    actor = {
        "name": "actor",
        "worker_cls": ctx.backend.worker_class,
        "num_workers": ctx.layout.actor_ranks,
        "worker_kwargs": {
            "model_cfg": _plain(cfg.model),
            "actor_cfg": {**_plain(cfg.actor), "layout_invariant": ctx.layout_invariant},
            "algorithm_cfg": _plain(cfg.algorithm),
            "init_seed": derive_seed(cfg.runner.seed, "model_init"),
            "total_optimizer_steps": ctx.optimizer_steps,
            "samples_per_optimizer_step": ctx.samples_per_optimizer_step,
            "read_weights": ctx.read_weights,
            **common,
        },
        "cpus_per_worker": cluster.cpus_per_actor_worker,
        "distributed": True,
        "workers_per_bundle": ctx.rank_map.tp,  # a tensor-parallel group is one bundle: never split across nodes
        **placement,
    }
    rollout = {
        "name": "rollout",
        "worker_cls": RolloutWorker,
        "num_workers": ctx.layout.rollout_workers,
        "worker_kwargs": {
            "model_cfg": _plain(cfg.model),
            "rollout_cfg": _plain(cfg.rollout),
            "group_size": cfg.algorithm.group_size,
            "reward": ctx.reward,
            "seed": cfg.runner.seed,
            "max_prompt_length": cfg.data.max_prompt_length,
            **common,
            **({"multi_turn": ctx.multi_turn} if ctx.multi_turn is not None else {}),
        },
        "cpus_per_worker": cluster.cpus_per_rollout_worker,
        **placement,
    }
    return actor, rollout


def spare_pools(ctx: RunContext) -> dict[str, SparePool]:
    """The run's pools of warm spares by group name (`cluster.spare_workers`), made once and kept across attempts."""
    if ctx.spare_pools is None:
        actor, rollout = group_specs(ctx, 0.0, lambda: False)
        counts = ctx.cfg.cluster.spare_workers
        ctx.spare_pools = {
            spec["name"]: SparePool(
                spec["name"],
                spec["worker_cls"],
                spec["worker_kwargs"],
                counts[spec["name"]],
                spec["cpus_per_worker"],
                spec["gpus_per_worker"],
            )
            for spec in (actor, rollout)
        }
    return ctx.spare_pools


def _requests(ctx: RunContext, actor_ranks: int, rollout_workers: int) -> list[tuple[int, dict[str, float], str]]:
    """What placing `actor_ranks` actor ranks and `rollout_workers` rollout workers asks of the cluster, as
    `placeable` takes it: a tensor-parallel group is one bundle."""
    cluster, tp = ctx.cfg.cluster, ctx.rank_map.tp
    gpus = {"GPU": cluster.gpus_per_worker} if cluster.gpus_per_worker > 0 else {}
    actor = {"CPU": cluster.cpus_per_actor_worker * tp, **{k: v * tp for k, v in gpus.items()}}
    rollout = {"CPU": cluster.cpus_per_rollout_worker, **gpus}
    strategy = cluster.placement_strategy
    return [(actor_ranks // tp, actor, strategy), (rollout_workers, rollout, strategy)]


def cluster_fits(ctx: RunContext, layout: Layout, beside: Layout | None = None) -> bool:
    """Whether the cluster places groups of `layout` now (with `beside`, the groups of that layout are up: whether it
    places the workers `layout` has beyond them). The groups finished runs left parked give way, as they do to a
    group being placed, unless the layout can never fit the cluster."""
    actor, rollout = layout.actor_ranks, layout.rollout_workers
    if beside is not None:
        actor, rollout = actor - beside.actor_ranks, rollout - beside.rollout_workers
    elif ctx.spare_pools is not None:  # warm spares hold their resources and become ranks of the new groups
        tp = ctx.rank_map.tp
        actor -= min(actor, len(ctx.spare_pools["actor"].spares) // tp * tp)
        rollout -= min(rollout, len(ctx.spare_pools["rollout"].spares))
    requests = _requests(ctx, actor, rollout)
    if free_covers(requests) and placeable(requests):
        return True
    totals = all(fits_cluster(n, bundle) for n, bundle, _ in requests)
    return totals and parked_groups.evict() and placeable(requests)
