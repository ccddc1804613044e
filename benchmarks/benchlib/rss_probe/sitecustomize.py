"""Attribute a process's memory peak: put this folder on PYTHONPATH with RLRUNNER_RSS_PROBE_DIR set, and every
Python process started under it (Ray workers included: they inherit the environment) runs a thread that samples
its resident set every few milliseconds and, at each new high of at least RLRUNNER_RSS_PROBE_STEP_MIB above the last
one logged, writes the resident set and the Python stacks of its other threads to <dir>/<pid>.txt.

A sampling probe: a peak shorter than the interval can be missed, and the stack is where the process was when the
high was seen (the allocation is at or just before it). `benchmarks/rss_report.py` summarises the files.
"""

import os
import sys
import threading
import time
import traceback

_DIR = os.environ.get("RLRUNNER_RSS_PROBE_DIR")
_STEP = int(os.environ.get("RLRUNNER_RSS_PROBE_STEP_MIB", "32")) * 2**20
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _probe(path: str) -> None:
    me = threading.get_ident()
    high = 0
    while True:
        rss = _rss_bytes()
        if rss >= high + _STEP:
            high = rss
            stacks = []
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    stacks.append("".join(traceback.format_stack(frame, limit=40)))
            with open(path, "a") as out:
                out.write(f"=== rss {rss / 2**20:.0f} MiB at {time.time():.3f} argv {' '.join(sys.argv)[:200]}\n")
                out.write("\n--- thread\n".join(stacks))
                out.write("\n")
        time.sleep(0.002)


if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    threading.Thread(
        target=_probe, args=(os.path.join(_DIR, f"{os.getpid()}.txt"),), daemon=True, name="rss-probe"
    ).start()
