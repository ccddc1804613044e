"""Freed tensor memory goes back to the operating system.

glibc's malloc serves a block below its mmap threshold from its heaps, and raises that threshold (up to 32 MiB)
each time a larger mmapped block is freed. A training process allocates and frees tensors of a few MiB over and
over (a layer's gathered weights, a bucket, activations); once the threshold has risen, they come from the heaps,
where blocks freed between live ones are kept by the process: measured with FSDP on a 120M model over 2 ranks, each
rank's peak resident set was 3.07 GiB instead of 1.87 GiB. A fixed threshold turns the adjustment off, so every
block of at least that size is mapped on its own and unmapped when freed.

The threshold is 1 MiB; a small model's actor ranks raise it to 4 MiB (`models.loading.fit_heap_to`). A block that is
mapped costs a page fault per 4 KiB page at its first write, every time it is allocated, and on CPU, where activations
are host tensors, the default job's (2 MiB at 256 rows x 8 tokens x 256 floats, 1 MiB per rank at 2 ranks) were all
fresh mappings: its update on one rank with two threads took 112 ms at 1 MiB and 67 ms at 4 MiB, the elementwise ops
2-3x slower. Real sizes keep 1 MiB, for their peaks: the 120M model's FSDP ranks at 4 ranks peaked at 1.34x their
share plus overhead at 4 MiB (1.35x at 2 MiB) against 1.28x at 1 MiB, 358M at 1.32x against 1.19x (bench_memory,
snapshots on; the goal is 1.3x).
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20
SMALL_MODEL_MMAP_THRESHOLD_BYTES = 4 << 20


def release_freed_memory(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold_bytes` for this process, and its trim threshold at twice that; False
    where the C library has no `mallopt` (not glibc) or refuses it."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    # glibc's own adjustment keeps the top of its heap up to twice the mmap threshold; fixed, the trim threshold would
    # stay at 128 KiB, and a freed block below the mmap threshold at the heap's top would be given back at once, to be
    # faulted in again at its next allocation (in about a third of fresh processes, by where the block lands)
    done = bool(mallopt(M_MMAP_THRESHOLD, int(threshold_bytes))) and bool(
        mallopt(M_TRIM_THRESHOLD, 2 * int(threshold_bytes))
    )
    if not done:
        logger.warning(
            "mallopt(M_MMAP_THRESHOLD, %d) or its trim threshold was refused: freed memory may stay with the process",
            threshold_bytes,
        )
    return done
