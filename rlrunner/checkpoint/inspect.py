"""Inspect checkpoints: `python -m rlrunner.checkpoint list EXPERIMENT_OR_CHECKPOINTS_DIR` and `... verify CKPT`.

`list` shows every global_step_N folder with its step, size and status (complete, incomplete,
corrupt: sizes checked; add --checksums to read every file). `verify` checks one checkpoint's
sizes and CRC-32s against its manifest and exits 0 when it is complete, 1 otherwise. Both take
local paths or fsspec URLs (s3://bucket/runs/exp); credentials come from the usual places (AWS_*
variables, ~/.aws), anything else from --storage_options '<json>'.
"""

from __future__ import annotations

import argparse
import sys

from rlrunner.checkpoint import layout
from rlrunner.checkpoint.status import COMPLETE, inspect_checkpoint, scan_checkpoints
from rlrunner.errors import ConfigError
from rlrunner.experiment.lock import describe_holder
from rlrunner.storage import Storage, add_storage_options_argument, open_storage


def _root(storage: Storage, url: str) -> str:
    inside = storage.join(url, layout.CHECKPOINTS_DIR)
    return inside if storage.is_dir(inside) else url


def list_command(storage: Storage, url: str, checksums: bool) -> int:
    root = _root(storage, url)
    if root != url:  # an experiment folder: say whether a run is using it
        holder = describe_holder(storage, url)
        print(f"experiment lock: held by {holder}" if holder else "experiment lock: free")
    statuses = scan_checkpoints(storage, root, checksums=checksums)
    if not statuses:
        print(f"no global_step_* folders in {root}")
        return 0
    print(f"{'step':>8}  {'size':>10}  {'status':<10}  path")
    for status in statuses:
        step = "?" if status.step is None else str(status.step)
        print(f"{step:>8}  {status.size_bytes / 1e6:>8.1f}MB  {status.status:<10}  {status.url}")
        for reason in status.reasons:
            print(f"{'':>34}{reason}")
    for leftover in layout.leftover_dirs(storage, root):
        print(
            f"{'':>8}  {'':>10}  {'leftover':<10}  {leftover}  "
            "(an unfinished save or deletion; removed at the next run's start)"
        )
    return 0


def verify_command(storage: Storage, url: str) -> int:
    status = inspect_checkpoint(storage, url, checksums=True)
    if status.status == COMPLETE:
        files = len(status.manifest["files"])
        print(
            f"{url}: complete, step {status.step}, world size {status.manifest['world_size']}, {files} files verified"
        )
        return 0
    print(f"{url}: {status.status}: " + "; ".join(status.reasons))
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlrunner.checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="list the checkpoints of an experiment")
    listing.add_argument("path", help="an experiment folder or its checkpoints/ folder (a path or a URL)")
    listing.add_argument("--checksums", action="store_true", help="also verify every file's CRC-32")
    verify = commands.add_parser("verify", help="verify one checkpoint against its manifest")
    verify.add_argument("path", help="a global_step_N folder (a path or a URL)")
    for command in (listing, verify):
        add_storage_options_argument(command, "--storage_options", "--storage-options")
    args = parser.parse_args(argv)
    try:
        storage = open_storage(args.path, args.storage_options)
    except ConfigError as exc:
        print(f"python -m rlrunner.checkpoint: error: {exc}", file=sys.stderr)
        return 2
    url = storage.url if storage.is_local else args.path.rstrip("/")
    if args.command == "list":
        return list_command(storage, url, args.checksums)
    return verify_command(storage, url)


if __name__ == "__main__":
    sys.exit(main())
