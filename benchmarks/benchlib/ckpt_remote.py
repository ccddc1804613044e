"""bench_checkpoint.py on an object store (`--output s3://bucket/prefix`): rlrunner's save and load with every rank
uploading its own files, next to a plain s3fs put and get of the same objects; `--moto` starts a local S3 API."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from benchlib.ckpt_local import TimedManager, bench_data_state, set_ckpt_format, start_megatron_group
from benchlib.ckpt_report import report_remote
from benchlib.ckpt_rows import FSDP_ROWS, PLAIN_GET_ROW, PLAIN_PUT_ROW, BackendRows, Samples, megatron_rows
from benchlib.common import timed
from benchlib.groups import Groups


def start_moto(url: str) -> tuple[subprocess.Popen, dict[str, Any]]:
    """moto's S3 server on a free port of 127.0.0.1 in a process of its own, with the URL's bucket; its
    storage_options."""
    import boto3

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)
    credentials = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench", "region_name": "us-east-1"}
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    boto3.client("s3", endpoint_url=endpoint, **credentials).create_bucket(Bucket=bucket)
    return server, {
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def _in_threads(action: Callable[[str], Any], names: list[str]) -> list[Any]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        return list(pool.map(action, names))


def measure_remote(
    groups: Groups,
    storage,
    experiment: str,
    samples: Samples,
    fingerprint: dict[str, Any],
    rows: BackendRows,
    plain: bool,
) -> None:
    """One repeat on the store: rlrunner's save and load with the group's checkpoint manager (storage options for
    every rank), and with `plain` a plain put and get of the same objects."""
    from rlrunner.checkpoint.handler import CheckpointHandler
    from rlrunner.checkpoint.status import COMPLETE, inspect_checkpoint

    handler = CheckpointHandler(storage, experiment, save_interval=1, max_keep=None, fingerprint=fingerprint)
    manager = TimedManager(groups.manager(storage_options=storage.storage_options))
    seconds, url = timed(lambda: handler.save(1, manager, bench_data_state()))
    files = storage.walk(url)
    samples.add(rows.save, seconds, sum(files.values()))
    shards = {name: size for name, size in files.items() if name.startswith("actor/") and "/huggingface/" not in name}
    samples.add(rows.sync, manager.save_seconds, sum(shards.values()))

    fs, plain_url = storage.fs, storage.join(experiment, "plain")
    if plain:
        noise = os.urandom(1 << 20)  # incompressible, like the shards
        payloads = {name: (noise * (size // len(noise) + 1))[:size] for name, size in shards.items()}
        seconds, _ = timed(
            lambda: _in_threads(
                lambda n: fs.pipe_file(fs._strip_protocol(storage.join(plain_url, n)), payloads[n]), list(payloads)
            )
        )
        samples.add(PLAIN_PUT_ROW, seconds, sum(len(p) for p in payloads.values()))
        payloads.clear()

    seconds, status = timed(lambda: inspect_checkpoint(storage, url, checksums=True))
    if status.status != COMPLETE:
        raise RuntimeError(f"{url} does not verify: {status.reasons}")
    samples.add(rows.verify, seconds, sum(files.values()))
    seconds, _ = timed(lambda: groups.manager(storage_options=storage.storage_options).load(storage.join(url, "actor")))
    samples.add(rows.load, seconds, sum(shards.values()))
    if plain:
        seconds, got = timed(
            lambda: _in_threads(lambda n: fs.cat_file(fs._strip_protocol(storage.join(plain_url, n))), list(shards))
        )
        samples.add(PLAIN_GET_ROW, seconds, sum(len(g) for g in got))
        storage.delete_tree(plain_url)
    handler.delete(url)


def run_remote(
    args: argparse.Namespace, groups: Groups, meg_cfg, params: int, fingerprint: dict[str, Any], started: float
) -> int:
    """The store's measurements: the FSDP group's (with the plain put/get), then the Megatron layout's on its own
    group."""
    from rlrunner.storage import open_storage

    server = None
    options = args.storage_options
    if args.moto:
        server, options = start_moto(args.output)
    tp, dp = args.megatron_tp, args.megatron_dp
    formats = args.megatron_formats if meg_cfg is not None else []
    megatron = [megatron_rows(tp, dp, ckpt_format) for ckpt_format in formats]
    try:
        storage = open_storage(args.output, options)
        experiment = storage.join(args.output, f"bench-{uuid.uuid4().hex[:8]}")
        samples = Samples({}, {})
        for repeat in range(args.repeat):
            measure_remote(groups, storage, experiment, samples, fingerprint, FSDP_ROWS, plain=True)
            print(f"repeat {repeat + 1}/{args.repeat} done ({time.perf_counter() - started:.0f}s elapsed)", flush=True)
        groups.shutdown()
        if megatron:
            groups = start_megatron_group(meg_cfg, tp)
            for repeat in range(args.repeat):
                for ckpt_format, rows in zip(formats, megatron):
                    set_ckpt_format(groups, ckpt_format)
                    measure_remote(groups, storage, experiment, samples, fingerprint, rows, plain=False)
                print(
                    f"megatron repeat {repeat + 1}/{args.repeat} done ({time.perf_counter() - started:.0f}s elapsed)",
                    flush=True,
                )
            groups.shutdown()
        report_remote(args, samples, megatron, params, started)
    finally:
        if server is not None:
            server.kill()
            server.wait()
    return 0
