#!/usr/bin/env python
"""The CPU time of opening an S3 store: `open_storage` (s3fs sessions reading botocore's data files through the
process's one loader) against a plain s3fs filesystem per open (s3fs's own session, which parses those files again).

A run opens a filesystem for every save, every load and every check of a store, in the driver and in every rank.
Each arm opens `--opens` filesystems one after the other and lists the bucket with each (the first request builds
the session and its client); the arms alternate for `--rounds` rounds after one warm-up open each (imports). The
S3 API is moto's server in a process of its own (`benchlib.ckpt_remote.start_moto`), so this process's CPU time is
the client's alone. Prints the median CPU and wall time per open of each arm and their ratio.

Run from the repository root (moto comes with the test extras):

    .venv/bin/python benchmarks/bench_s3_open.py
    .venv/bin/python benchmarks/bench_s3_open.py --opens 50 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.ckpt_remote import start_moto  # noqa: E402
from benchlib.common import command_line, cpu_model  # noqa: E402

URL = "s3://bench-open/runs"


def plain_s3fs(options: dict[str, Any]) -> Callable[[], Any]:
    """What `open_storage` did before: a fresh s3fs filesystem, no caches, with the session s3fs makes."""
    import s3fs

    def open_and_list() -> Any:
        fs = s3fs.S3FileSystem(**options, skip_instance_cache=True, use_listings_cache=False)
        return fs.ls("bench-open")

    return open_and_list


def rlrunner_storage(options: dict[str, Any]) -> Callable[[], Any]:
    from rlrunner.storage import open_storage

    def open_and_list() -> Any:
        return open_storage(URL, options).list(URL)

    return open_and_list


def per_open(action: Callable[[], Any], opens: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per open, over `opens` opens."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(opens):
        action()
    return (time.process_time() - cpu) / opens, (time.perf_counter() - wall) / opens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opens", type=int, default=20, help="filesystems opened per arm and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    server, options = start_moto(URL)
    try:
        arms = {"plain s3fs": plain_s3fs(options), "open_storage": rlrunner_storage(options)}
        for action in arms.values():
            action()  # imports, the bucket's first listing
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name, action in arms.items():
                samples[name].append(per_open(action, args.opens))
    finally:
        server.kill()
        server.wait()

    print(f"# {command_line()}")
    print(f"# {cpu_model()}; {args.opens} opens x {args.rounds} rounds per arm, medians of the rounds")
    medians = {name: tuple(statistics.median(s[i] for s in rows) for i in (0, 1)) for name, rows in samples.items()}
    for name, (cpu, wall) in medians.items():
        print(f"{name:>14}: {cpu * 1000:7.1f} ms of CPU, {wall * 1000:7.1f} ms wall per open (and a listing)")
    base_cpu, base_wall = medians["plain s3fs"]
    cpu, wall = medians["open_storage"]
    print(f"open_storage / plain s3fs: CPU {cpu / base_cpu:.2f}x, wall {wall / base_wall:.2f}x")


if __name__ == "__main__":
    main()
