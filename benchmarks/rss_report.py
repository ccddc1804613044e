"""Summarise the files of `benchlib/rss_probe` (one per process): for each new high of a process's resident set,
the size and where the thread running the framework was (its innermost frames in rlrunner, torch and transformers).

    .venv/bin/python benchmarks/rss_report.py /tmp/probe [--min-mib 800] [--frames 4]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_KEEP = ("/rlrunner/", "/torch/", "/transformers/")


def highs(path: Path) -> list[tuple[float, list[str]]]:
    """(resident MiB, innermost-first framework frames of the busiest thread) for each logged high in `path`."""
    out = []
    for block in path.read_text().split("=== rss ")[1:]:
        mib = float(block.split(" ", 1)[0])
        best: list[str] = []
        for stack in block.split("\n--- thread\n"):
            frames = [
                f"{Path(p).name}:{line}:{fn}" for p, line, fn in _FRAME.findall(stack) if any(k in p for k in _KEEP)
            ]
            if len(frames) > len(best):
                best = frames
        out.append((mib, best[::-1]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--min-mib", type=float, default=0.0, help="only processes that reached this")
    parser.add_argument("--frames", type=int, default=4, help="innermost frames shown per high")
    args = parser.parse_args()
    for path in sorted(Path(args.folder).glob("*.txt")):
        found = highs(path)
        if not found or found[-1][0] < args.min_mib:
            continue
        print(f"# process {path.stem}: peak logged {found[-1][0]:.0f} MiB")
        for mib, frames in found:
            print(f"  {mib:7.0f}  {' < '.join(frames[: args.frames]) or '(no framework frame)'}")


if __name__ == "__main__":
    main()
