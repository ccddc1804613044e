"""The ranks of a test's own process group (no Ray), each a fresh process forked from one server that imported torch
and our backends once.

A spawned rank spends 2-4 s of CPU importing torch, transformers, DTensor and a backend before it runs a line of the
test; the suite starts about sixty of them. `multiprocessing`'s fork server is started once per pytest process with
those modules preloaded, so each rank is a fork of a process that already has them: the same clean start as a spawn
(the server never ran torch, so no threads or state are inherited), without the imports.

A rank forked this way inherits the server's environment, taken when the first test started it, not the test's: a
test that changes the environment for its ranks passes what they need as arguments (or spawns them).
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable

import forked_ray_workers
import torch.multiprocessing

# What the ranks of the suite import: the libraries Ray's workers are forked with, then our backends and megatron-core
# (these ranks never connect to Ray, so importing it here is harmless); a name that fails to import is skipped by the
# server (the ranks then import it).
PRELOAD = [
    *forked_ray_workers.PRELOAD,
    "rlrunner.backends.fsdp.worker",
    "rlrunner.backends.megatron.worker",
    "megatron.core",
    "frozen_heap",  # last: everything above out of the collector's reach
]


def forked_context() -> multiprocessing.context.ForkServerContext:
    """The fork server's context, for a test that starts its ranks as `Process`es of its own."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call of the session
    return multiprocessing.get_context("forkserver")


def spawn_ranks(fn: Callable[..., Any], args: tuple = (), nprocs: int = 1) -> None:
    """`fn(rank, *args)` in `nprocs` processes, waited for; raises with a rank's traceback if one fails (as
    `torch.multiprocessing.spawn`)."""
    forked_context()
    torch.multiprocessing.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
