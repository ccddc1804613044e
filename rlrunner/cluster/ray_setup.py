"""Connecting the driver to Ray: a given address, a running `ray start` cluster, or an embedded local one."""

from __future__ import annotations

import logging
import os

import ray

logger = logging.getLogger(__name__)


def init_ray(ray_address: str | None, num_cpus: int | None) -> str:
    """Initialise Ray once per process and say how; returns "existing", "connected" or "embedded".

    Token authentication stays as Ray configures it (on by default): connecting to a cluster uses
    the token Ray keeps for it, and the embedded cluster generates its own.
    """
    if ray.is_initialized():
        return "existing"
    quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
    address = ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **quiet)
        logger.info("connected to the Ray cluster at %s", address)
        return "connected"
    try:
        ray.init(address="auto", **quiet)
        logger.info("connected to the running Ray cluster on this machine")
        return "connected"
    except ConnectionError:
        pass
    ray.init(num_cpus=num_cpus, include_dashboard=False, **quiet)
    logger.info("no Ray cluster found: started an embedded local one (%s CPUs)", ray.cluster_resources().get("CPU", 0))
    return "embedded"
