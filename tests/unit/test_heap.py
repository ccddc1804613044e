"""Freed tensor memory goes back to the OS once `release_freed_memory` has run (in a fresh interpreter each time:
the setting is per process and cannot be undone)."""

from __future__ import annotations

import subprocess
import sys

SCENARIO = """
import sys, torch
from rlrunner.utils.heap import release_freed_memory

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

if sys.argv[1] == "release":
    assert release_freed_memory()
block = torch.ones(8 << 20)  # 32 MiB mapped and freed: glibc's threshold rises to it
del block
before = rss()
alive = []
for round in range(3):  # a training step's pattern: blocks of a few MiB made and freed, small ones kept between them
    freed = []
    for i in range(32):
        freed.append(torch.ones((2 << 20) + i * 1024))
        alive.append(torch.ones(16 << 10))
    del freed
print(rss() - before)
"""


def _kept_after_freeing(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCENARIO, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_blocks_freed_between_live_ones_leave_the_process():
    kept_by_default = _kept_after_freeing("default")
    kept = _kept_after_freeing("release")
    # 3 rounds of 32 blocks of 8 MiB freed, 6 MiB of small tensors kept: glibc's default keeps one round's blocks
    assert kept_by_default > 128 << 20, kept_by_default  # the behaviour this guards against, on this C library
    assert kept < 32 << 20, kept


FAULTS = """
import resource, sys, torch
from rlrunner.models.loading import SMALL_MODEL_BYTES, fit_heap_to
from rlrunner.utils.heap import release_freed_memory

release_freed_memory()  # what every worker does when it starts
fit_heap_to(SMALL_MODEL_BYTES + int(sys.argv[1]))  # what a rank's setup does with its model's size
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):  # an activation of the default job's update (2 MiB), made and freed over and over
    activation = torch.ones(512 << 10)
    del activation
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(over_small_bytes: int, processes: int = 1) -> list[int]:
    """The faults of FAULTS in `processes` fresh interpreters at once (where a block lands differs between them)."""
    command = [sys.executable, "-c", FAULTS, str(over_small_bytes)]
    running = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    outputs = [process.communicate()[0] for process in running]
    assert all(process.returncode == 0 for process in running)
    return [int(out.split()[-1]) for out in outputs]


def test_a_small_models_rank_reuses_its_activations_blocks_without_page_faults():
    # In a third of fresh processes the block lands at the top of the heap, which glibc gave back at once while its
    # trim threshold stayed at 128 KiB: several processes, so that this shows
    small = _page_faults(0, processes=4)
    (large,) = _page_faults(1)
    # above SMALL_MODEL_BYTES each 2 MiB block is a fresh mapping: 512 faults every time; a small model's come back
    assert large > 50 * 400, large
    assert max(small) < large / 10, (small, large)
