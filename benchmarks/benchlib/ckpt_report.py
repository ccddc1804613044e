"""bench_checkpoint.py's tables: throughput against the plain baselines, the async save against its floor, and the
Megatron layout against DCP."""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path
from typing import Sequence

import torch

from benchlib.ckpt_rows import (
    ASYNC_ROWS,
    BLOCKED_ROW,
    COPY_FLOOR,
    FSDP_ROWS,
    PIECE_ROWS,
    RAW_READ_ROW,
    RAW_WRITE_ROW,
    SYNC_ROW,
    BackendRows,
    Samples,
    load_rows,
    remote_load_rows,
    remote_save_rows,
    save_rows,
)
from benchlib.common import command_line, filesystem_of, memory_gib


def markdown_table(samples: Samples, megatron: Sequence[BackendRows] = ()) -> str:
    lines = ["| operation | bytes | seconds | GB/s | vs raw write |", "|---|---:|---:|---:|---:|"]
    for section, rows, reference in (
        ("save", save_rows(megatron), RAW_WRITE_ROW),
        ("load", load_rows(megatron), RAW_READ_ROW),
    ):
        ref_rate = samples.nbytes[reference] / samples.median(reference)
        for name in rows:
            seconds = samples.median(name)
            rate = samples.nbytes[name] / seconds
            label = f"{section}: {name.strip()}" if not name.startswith(" ") else f"{section}:   ↳ {name.strip()}"
            lines.append(
                f"| {label} | {samples.nbytes[name]:,} | {seconds:.3f} | {rate / 1e9:.3f} | {rate / ref_rate:.2f} |"
            )
    return "\n".join(lines)


def remote_table(samples: Samples, megatron: Sequence[BackendRows]) -> str:
    lines = ["| operation | bytes | seconds | MB/s | vs plain s3fs |", "|---|---:|---:|---:|---:|"]
    for section, rows in (("save", remote_save_rows(megatron)), ("load", remote_load_rows(megatron))):
        reference = samples.nbytes[rows[-1]] / samples.median(rows[-1])
        for name in rows:
            seconds = samples.median(name)
            rate = samples.nbytes[name] / seconds
            lines.append(
                f"| {section}: {name.strip()} | {samples.nbytes[name]:,} | {seconds:.3f} | {rate / 1e6:.0f} | "
                f"{rate / reference:.2f} |"
            )
    return "\n".join(lines)


def async_table(samples: Samples, megatron: Sequence[BackendRows] = ()) -> str:
    """The async save next to its floor (a plain copy of the same state) and the synchronous save; the Megatron
    backend's async saves below, against the same floor (each rank holds about the same bytes in both backends)."""
    floor = samples.median(COPY_FLOOR)
    lines = ["| async save (runner.async_save=true) | bytes | seconds | x copy floor |", "|---|---:|---:|---:|"]
    names = ASYNC_ROWS + [SYNC_ROW]
    labels = {name: name for name in ASYNC_ROWS + PIECE_ROWS}
    labels[SYNC_ROW] = "sync save: fsdp ActorCheckpointManager start_save + finish_save (background=False)"
    for rows in megatron:
        names += [rows.blocked, rows.wait, rows.write_s, rows.sync]
        labels.update({name: name for name in (rows.blocked, rows.wait, rows.write_s)})
        labels[rows.sync] = rows.save.replace("CheckpointHandler.save", "sync save: MegatronCheckpointManager")
    for name in names + PIECE_ROWS:
        seconds = samples.median(name)
        nbytes = f"{samples.nbytes[name]:,}" if samples.nbytes[name] else ""
        lines.append(f"| {labels[name]} | {nbytes} | {seconds:.4f} | {seconds / floor:.2f} |")
    blocked, sync = samples.median(BLOCKED_ROW), samples.median(SYNC_ROW)
    verdict = "met" if blocked <= 1.5 * floor else "NOT met"
    lines += [
        "",
        f"blocked / copy floor = {blocked / floor:.2f}x (goal <= 1.5x: {verdict}); "
        f"sync save / blocked = {sync / blocked:.1f}x",
    ]
    for rows in megatron:
        meg_blocked, meg_sync = samples.median(rows.blocked), samples.median(rows.sync)
        lines.append(
            f"{rows.save.split(':')[0]}: blocked / FSDP copy floor = {meg_blocked / floor:.2f}x; "
            f"sync save / blocked = {meg_sync / meg_blocked:.1f}x; "
            f"blocked megatron / FSDP = {meg_blocked / blocked:.2f}x"
        )
    return "\n".join(lines)


def backend_comparison(samples: Samples, megatron: Sequence[BackendRows], params: int, fsdp_ranks: int) -> str:
    """A line per Megatron format: its save and load seconds against DCP's, for the same model's state; and one of
    the last format against the first."""

    def pair(one: str, other: str) -> str:
        a, b = samples.median(one), samples.median(other)
        return f"{a:.3f} s vs {b:.3f} s ({a / b:.2f}x)"

    def line(rows: BackendRows, base: BackendRows, base_name: str) -> str:
        blocked = f"; blocked in an async save {pair(rows.blocked, base.blocked)}" if rows.blocked else ""
        return (
            f"{rows.save.split(':')[0]} vs {base_name}, same model ({params:,} parameters; actor files "
            f"{samples.nbytes[rows.sync]:,} vs {samples.nbytes[base.sync]:,} bytes): manager save "
            f"{pair(rows.sync, base.sync)}; handler save {pair(rows.save, base.save)}; "
            f"load {pair(rows.load, base.load)}{blocked}"
        )

    lines = [line(rows, FSDP_ROWS, f"FSDP/DCP ({fsdp_ranks} ranks)") for rows in megatron]
    if len(megatron) > 1:
        lines.append(line(megatron[-1], megatron[0], megatron[0].save.split(":")[0]))
    return "\n".join(lines)


def per_repeat_seconds(samples: Samples) -> str:
    """Every repeat's seconds, in order, so a slow first repeat (cold allocations) stays visible."""
    return "\n".join(
        f"  {name.strip()}: " + ", ".join(f"{s:.4f}" for s in seconds) for name, seconds in samples.seconds.items()
    )


def report_local(
    args: argparse.Namespace,
    samples: Samples,
    megatron: Sequence[BackendRows],
    params: int,
    drop: bool,
    work: Path,
    started: float,
) -> None:
    import ray

    tp, dp = args.megatron_tp, args.megatron_dp
    print()
    print(markdown_table(samples, megatron))
    print()
    print(async_table(samples, megatron))
    print()
    if megatron:
        print(backend_comparison(samples, megatron, params, args.workers))
        print()
    print(
        f"Medians of {args.repeat} repeats. 'torch.save + fsync' includes the fsync; its state is gathered "
        "unsharded into the driver beforehand (not timed). 'vs raw write' is the ratio of throughputs; load rows "
        "are relative to 'raw read' (= 1.00), both measured in this run. Page cache "
        + (
            "dropped (/proc/sys/vm/drop_caches was writable) before every load-side row."
            if drop
            else "NOT dropped (/proc/sys/vm/drop_caches not writable): loads are from the page cache."
        )
    )
    if megatron:
        print(
            f"The megatron rows come from a second actor group ({tp * dp} MegatronActorWorker ranks, tp={tp}, "
            f"dp={dp}) built after the FSDP group was shut down, on the same model and batch, with its own optimizer "
            "update; each format is measured on that group (actor.megatron.ckpt_format set on its ranks)."
        )
    print(
        f"machine: {os.cpu_count()} CPU cores ({platform.machine()}), {memory_gib():.0f} GiB RAM, "
        f"torch {torch.__version__}, ray {ray.__version__}; disk folder {work} on {filesystem_of(work)}"
    )
    print("seconds per repeat:")
    print(per_repeat_seconds(samples))
    print(f"command: {command_line()}")
    print(f"total time: {time.perf_counter() - started:.0f}s")


def report_remote(
    args: argparse.Namespace, samples: Samples, megatron: Sequence[BackendRows], params: int, started: float
) -> None:
    print()
    print(remote_table(samples, megatron))
    print()
    if megatron:
        print(backend_comparison(samples, megatron, params, args.workers))
        print()
    where = "moto's S3 server on 127.0.0.1 (its own process)" if args.moto else args.output.split("/", 3)[2]
    print(
        f"Medians of {args.repeat} repeats, store: {where}; the plain put/get run from this process, "
        "one thread per shard."
    )
    print(
        f"machine: {os.cpu_count()} CPU cores ({platform.machine()}), {memory_gib():.0f} GiB RAM, "
        f"torch {torch.__version__}"
    )
    print("seconds per repeat:")
    print(per_repeat_seconds(samples))
    print(f"command: {command_line()}")
    print(f"total time: {time.perf_counter() - started:.0f}s")
