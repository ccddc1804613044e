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
