"""Whether a group of workers fits the Ray cluster's resources, and what it lacks, in one line."""

from __future__ import annotations

import ray


def fits_cluster(num_workers: int, bundle: dict[str, float]) -> bool:
    """Whether the cluster's resources, free or not, hold `num_workers` x `bundle`."""
    total = ray.cluster_resources()
    return all(value * num_workers <= total.get(key, 0) + 1e-9 for key, value in bundle.items())


def missing_resources(num_workers: int, bundle: dict[str, float]) -> str:
    """What the group needs beyond what is free now, with the cluster's total and free amounts."""
    total = ray.cluster_resources()
    free = ray.available_resources()
    wanted = {key: value * num_workers for key, value in bundle.items()}
    short = [
        f"{key} {wanted[key]:g} (cluster has {total.get(key, 0):g}, {free.get(key, 0):g} free)"
        for key in wanted
        if wanted[key] > free.get(key, 0) + 1e-9
    ]
    return "; ".join(short) or "resources held by other placement groups"


def describe_missing_resources(name: str, num_workers: int, bundle: dict[str, float], waited_s: float) -> str:
    """One line: what the group asked for and what the cluster has in total and free."""
    per_worker = ", ".join(f"{k}={v:g}" for k, v in bundle.items())
    return (
        f"cannot place the {name} group ({num_workers} workers x {{{per_worker}}}) after waiting {waited_s:g}s: "
        f"needs {missing_resources(num_workers, bundle)}"
    )


def free_covers(requests: list[tuple[int, dict[str, float], str]]) -> bool:
    """Whether the cluster's free resources, summed over its nodes, cover the requests (as `placeable` takes them): a
    quick answer, no placement tried; true does not mean the nodes can place them."""
    free = ray.available_resources()
    wanted: dict[str, float] = {}
    for count, bundle, _ in requests:
        for key, value in bundle.items():
            wanted[key] = wanted.get(key, 0.0) + value * count
    return all(value <= free.get(key, 0.0) + 1e-9 for key, value in wanted.items())


def placeable(requests: list[tuple[int, dict[str, float], str]], timeout_s: float = 1.0) -> bool:
    """Whether the cluster places, within `timeout_s`, every request at once: (bundles, one bundle's resources,
    placement strategy), as the worker groups ask. Tried with placement groups of Ray's own, removed afterwards: Ray
    judges the nodes' free resources and the strategies, not a sum over the cluster."""
    from ray.util.placement_group import placement_group, remove_placement_group

    groups = [placement_group([dict(bundle) for _ in range(n)], strategy=s) for n, bundle, s in requests if n > 0]
    if not groups:
        return True
    try:
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
        return len(ready) == len(groups)
    finally:
        for group in groups:
            try:
                remove_placement_group(group)
            except Exception:  # the cluster went while asking: nothing of it to free
                pass
