"""Connecting the driver to Ray (a given address, a running `ray start` cluster, or an embedded local one),
and telling when that cluster is gone.

An embedded Ray is private to its driver: only a cluster a user started is joined (`cluster.ray_address`,
`RAY_ADDRESS`, or `ray start` on this machine), never another driver's embedded Ray, which goes down
with that driver.

A lost cluster must end waits at once: with the embedded Ray's raylet dead (the OOM killer's usual
victim) nobody will ever add the resources a restart waits for, and with the head of a joined
cluster gone every GCS call blocks. `cluster_lost()` answers without calling the GCS: for the
embedded cluster it polls the processes this driver started, for a joined one it opens a TCP
connection to the GCS port.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import ray

from rlrunner.errors import RayStartError, describe

logger = logging.getLogger(__name__)

EMBEDDED, CONNECTED, EXISTING = "embedded", "connected", "existing"
_WATCHED_PROCESSES = ("raylet", "gcs_server")  # Ray's process-type names for the node manager and the GCS
_CHECK_EVERY_S = 1.0


class _Connection:
    """How this process is attached to Ray, remembered for the loss checks and an in-job restart."""

    mode: str | None = None
    gcs_address: str | None = None
    num_cpus: int | None = None
    checked_at = 0.0
    lost_reason: str | None = None


_connection = _Connection()


def init_ray(ray_address: str | None, num_cpus: int | None) -> str:
    """Initialise Ray once per process and say how; returns "existing", "connected" or "embedded".

    Joins the cluster at `ray_address`, else at `RAY_ADDRESS`, else the one `ray start` runs on this
    machine (if its head still answers); otherwise starts a new embedded Ray, private to this driver:
    another driver's embedded Ray is never joined (it goes down with that driver). `local` starts a
    new embedded instance even when a cluster runs on this machine.

    Token authentication stays as Ray configures it (on by default): connecting to a cluster uses
    the token Ray keeps for it, and the embedded cluster generates its own.
    """
    if ray.is_initialized():
        if _connection.mode is not None and _current_gcs_address() == _connection.gcs_address:
            return _connection.mode  # called again after an in-job restart of the embedded Ray
        return _remember(EXISTING, num_cpus)
    quiet = {"logging_level": logging.WARNING, "log_to_driver": True}
    address = ray_address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        join = "start it (`ray start --head` on its head node) or set cluster.ray_address / RAY_ADDRESS to its address"
        refused = _unreachable(address) if _is_host_port(address) else None
        if refused is not None:  # Ray itself would retry its GCS for minutes before saying so
            raise RayStartError(f"cannot join the Ray cluster at {address}: nothing answers there ({refused}); {join}")
        try:
            ray.init(address=address, **quiet)
        except Exception as exc:  # Ray's own errors (ConnectionError, its RuntimeErrors, a timeout): one line
            raise RayStartError(f"cannot join the Ray cluster at {address}: {describe(exc)}; {join}") from None
        logger.info("connected to the Ray cluster at %s", address)
        return _remember(CONNECTED, num_cpus)
    if address is None and _ray_start_cluster_answers():
        # address=None, not "auto": both join the cluster `ray start` recorded, but "auto" falls back to ANY
        # Ray GCS process on this machine (Ray's legacy rule), e.g. another driver's embedded Ray, which
        # dies with that driver. Either lets Ray turn token auth on as it does for a cluster found here.
        try:
            ray.init(address=None, **quiet)
            logger.info("connected to the running Ray cluster on this machine")
            return _remember(CONNECTED, num_cpus)
        except ConnectionError:
            pass
    return start_embedded(num_cpus)


def _ray_start_cluster_answers() -> bool:
    """Whether `ray start` recorded a cluster on this machine whose GCS still accepts connections.

    `ray start --head` writes its GCS address to Ray's bootstrap file (/tmp/ray/ray_current_cluster)
    and `ray stop` removes it; an embedded `ray.init` never writes it. A file left by a cluster that
    died without `ray stop` would make `ray.init` retry its GCS for many minutes before giving up:
    a TCP probe tells that at once.
    """
    recorded = ray._private.utils.read_ray_address()
    if not recorded:
        return False
    gone = _gcs_unreachable(recorded)
    if gone is not None:
        logger.warning(
            "not joining the `ray start` cluster recorded on this machine, %s; starting an embedded Ray", gone
        )
        return False
    return True


def start_embedded(num_cpus: int | None) -> str:
    """Start a Ray of this driver's own; RayStartError (one line) when it does not come up."""
    # address="local": a new instance even while another one's GCS still runs here (a lost embedded Ray takes
    # seconds to exit); `ray.init()` with no address would join RAY_ADDRESS's or `ray start`'s cluster instead.
    try:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=True,
        )
    except Exception as exc:  # "The current node timed out during startup" on a loaded machine, a full /tmp, ...
        if ray.is_initialized():
            ray.shutdown()
        raise RayStartError(
            f"the embedded Ray did not start: {describe(exc)}; the machine may be short of CPU time, memory or space "
            "in its temporary folder: a relaunch may mend it (or start one with `ray start --head` and run again)"
        ) from None
    logger.info("started an embedded local Ray (%s CPUs)", ray.cluster_resources().get("CPU", 0))
    return _remember(EMBEDDED, num_cpus)


def _remember(mode: str, num_cpus: int | None) -> str:
    _connection.mode = mode
    _connection.num_cpus = num_cpus
    _connection.lost_reason = None
    _connection.checked_at = 0.0
    _connection.gcs_address = _current_gcs_address()
    return mode


def _current_gcs_address() -> str | None:
    """The GCS address of the Ray this process is attached to now (local information, no GCS call)."""
    if not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # pragma: no cover - a runtime without a GCS address
        return None


def alive_nodes() -> list[str]:
    """The ids of the cluster's live nodes (asks the GCS)."""
    return [node["NodeID"] for node in ray.nodes() if node.get("Alive")]


def is_embedded() -> bool:
    return _connection.mode == EMBEDDED


def started_here() -> bool:
    """Whether the Ray this process is attached to runs from processes it started (the embedded Ray, or a local
    `ray.init()` of its own): a cluster no other driver is sent to, whose resources nobody else waits for."""
    node = _local_node()
    return ray.is_initialized() and node is not None and bool(node.all_processes.get("gcs_server"))


def _local_node():
    """The Ray node object of this process's `ray.init` (its `all_processes`: those it started), or None."""
    return getattr(ray._private.worker, "_global_node", None)


def cluster_lost(force: bool = False) -> str | None:
    """Why the cluster this driver uses is gone, or None. Cheap (checks at most once a second unless `force`)."""
    if _connection.mode is None or _current_gcs_address() != _connection.gcs_address:
        return None  # not a connection init_ray made (e.g. a test's own cluster): nothing to judge
    if _connection.lost_reason is not None:
        return _connection.lost_reason
    now = time.monotonic()
    if not force and now - _connection.checked_at < _CHECK_EVERY_S:
        return None
    _connection.checked_at = now
    if _connection.mode == EMBEDDED:
        reason = _embedded_process_exited()
    elif _connection.mode in (CONNECTED, EXISTING):
        reason = _gcs_unreachable(_connection.gcs_address)
    else:
        reason = None
    _connection.lost_reason = reason
    return reason


def _embedded_process_exited() -> str | None:
    node = _local_node()
    if node is None:
        return None
    for kind in _WATCHED_PROCESSES:
        for info in node.all_processes.get(kind, []):
            code = info.process.poll()
            if code is not None:
                return f"the embedded Ray's {kind} (pid {info.process.pid}) exited with code {code}"
    return None


def _gcs_unreachable(address: str | None, timeout_s: float = 2.0) -> str | None:
    reason = _unreachable(address, timeout_s) if address else None
    return None if reason is None else f"the Ray cluster's head node (GCS at {address}) is gone: {reason}"


def _is_host_port(address: str) -> bool:
    """Whether `address` is a GCS's host:port (not `auto`, nor a Ray Client `ray://` URL)."""
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and "://" not in address


def _unreachable(address: str, timeout_s: float = 2.0) -> str | None:
    """Why nothing accepts a TCP connection at `address` (host:port), or None when something does."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def restart_embedded() -> None:
    """Shut the lost embedded Ray down and start a fresh one with the same CPUs."""
    try:
        ray.shutdown()
    except Exception as exc:  # its processes are half gone: what is left is killed either way
        logger.warning("shutting the lost embedded Ray down: %s", exc)
    start_embedded(_connection.num_cpus)
