"""Where this process runs, as Ray sees it."""

from __future__ import annotations

import os
import socket


def node_ip() -> str:
    """This node's IP as Ray knows it, or the hostname's when outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # pragma: no cover - outside a Ray worker
        pass
    return socket.gethostbyname(socket.gethostname())


def node_id() -> str | None:
    """The Ray node this process runs on (nodes of one machine share an IP, not an id), or None outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # pragma: no cover - outside a Ray worker
        pass
    return None


def available_memory_bytes() -> int:
    """Host memory available to new allocations on this node (Linux's MemAvailable; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
