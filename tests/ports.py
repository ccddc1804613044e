"""Port numbers for the servers a test starts itself: a process group's rendezvous, a Ray head, an address nobody
listens on.

A port the kernel hands out for `bind(0)` comes from its ephemeral range, which every other process on the machine
draws from too (Ray's own processes, the other pytest worker's runs): between the pick and the server's bind, one of
them can take it. These are picked below that range, where a port is only ever taken by asking for it by number, and
checked free by binding each once.
"""

from __future__ import annotations

import random
import socket

_LOWEST = 20000  # below it: services, and the ports `ray start` gives its workers (10002-19999 by default)


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range starts here
        return 49152


def free_ports(count: int) -> list[int]:
    """`count` distinct ports nothing listens on now, outside the ephemeral range."""
    chosen: list[int] = []
    for port in random.sample(range(_LOWEST, _ephemeral_start()), k=min(4 * count + 64, _ephemeral_start() - _LOWEST)):
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise RuntimeError(f"no {count} free ports below the ephemeral range")


def free_port() -> int:
    return free_ports(1)[0]
