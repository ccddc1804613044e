"""Where this process runs, as Ray sees it."""

from __future__ import annotations

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
