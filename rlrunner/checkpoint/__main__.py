"""Inspect checkpoints: `python -m rlrunner.checkpoint list EXPERIMENT_OR_CHECKPOINTS_DIR` and `... verify CKPT`.

`list` shows every global_step_N folder with its step, size and status (complete, incomplete,
corrupt: sizes checked; add --checksums to read every file). `verify` checks one checkpoint's
sizes and CRC-32s against its manifest and exits 0 when it is complete, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlrunner.checkpoint import layout
from rlrunner.checkpoint.handler import COMPLETE, inspect_checkpoint, scan_checkpoints


def _root(path: Path) -> Path:
    return path / layout.CHECKPOINTS_DIR if (path / layout.CHECKPOINTS_DIR).is_dir() else path


def list_command(path: Path, checksums: bool) -> int:
    root = _root(path)
    statuses = scan_checkpoints(root, checksums=checksums)
    if not statuses:
        print(f"no global_step_* folders in {root}")
        return 0
    print(f"{'step':>8}  {'size':>10}  {'status':<10}  path")
    for status in statuses:
        step = "?" if status.step is None else str(status.step)
        print(f"{step:>8}  {status.size_bytes / 1e6:>8.1f}MB  {status.status:<10}  {status.path}")
        for reason in status.reasons:
            print(f"{'':>34}{reason}")
    for leftover in layout.leftover_dirs(root):
        print(f"{'':>8}  {'':>10}  {'leftover':<10}  {leftover}  (an unfinished save or deletion; removed at the next run's start)")
    return 0


def verify_command(path: Path) -> int:
    status = inspect_checkpoint(path.expanduser().resolve(), checksums=True)
    if status.status == COMPLETE:
        files = len(status.manifest["files"])
        print(f"{path}: complete, step {status.step}, world size {status.manifest['world_size']}, {files} files verified")
        return 0
    print(f"{path}: {status.status}: " + "; ".join(status.reasons))
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlrunner.checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="list the checkpoints of an experiment")
    listing.add_argument("path", type=Path, help="an experiment folder or its checkpoints/ folder")
    listing.add_argument("--checksums", action="store_true", help="also verify every file's CRC-32")
    verify = commands.add_parser("verify", help="verify one checkpoint against its manifest")
    verify.add_argument("path", type=Path, help="a global_step_N folder")
    args = parser.parse_args(argv)
    if args.command == "list":
        return list_command(args.path.expanduser().resolve(), args.checksums)
    return verify_command(args.path)


if __name__ == "__main__":
    sys.exit(main())
