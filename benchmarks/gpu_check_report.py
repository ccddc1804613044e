#!/usr/bin/env python
"""The figures of `benchmarks/gpu_check.sh run`, from the runs it left in its work folder: each run's step time and the
weight sync's share of it, the resumed and the rank-killed runs against their uninterrupted twins (final weights and
untimed metrics, bit for bit), and each GPU process's peak memory from the nvidia-smi samples.

    python3 benchmarks/gpu_check_report.py /tmp/gpu_check.XXXXXX
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # rlrunner, from the repository
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.common import read_jsonl  # noqa: E402

RUNS = ("cuda", "vllm", "resumed", "two_ranks", "rank_killed")


def experiment(work: Path, name: str) -> Path | None:
    found = sorted(work.glob(f"{name}/*/metrics.jsonl"))
    return found[0].parent if found else None


def steps_of(folder: Path) -> dict[int, dict[str, Any]]:
    """The last record of each step (a resumed run logs the steps after its checkpoint again)."""
    return {row["step"]: row for row in read_jsonl(folder / "metrics.jsonl") if row.get("step", 0) >= 1}


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    from rlrunner.tools.convert import load_model_weights

    newest = max((folder / "checkpoints").glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    return load_model_weights(newest)


def same_run(folder: Path, twin: Path) -> str:
    """Whether two runs of the same job ended with the same weights and logged the same untimed metrics."""
    untimed = [
        {step: {k: v for k, v in row.items() if not k.startswith("time/")} for step, row in steps_of(f).items()}
        for f in (folder, twin)
    ]
    a, b = final_weights(folder), final_weights(twin)
    weights = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return (
        f"final weights {'the same, bit for bit' if weights else 'DIFFERENT'}; "
        f"untimed metrics {'the same' if untimed[0] == untimed[1] else 'DIFFERENT'} over {len(untimed[0])} steps"
    )


def main(work: Path) -> int:
    ok = True
    print("| run | steps | step (s, median) | weight sync (s, median) | weight sync share |")
    print("|---|---:|---:|---:|---:|")
    folders = {name: experiment(work, name) for name in RUNS}
    for name, folder in folders.items():
        if folder is None:
            continue
        steps = list(steps_of(folder).values())[2:]  # the first two steps warm up (allocations, compilation)
        if not steps:
            continue
        step = statistics.median(s["time/step_s"] for s in steps)
        sync = statistics.median(s.get("time/weight_sync_s", 0.0) for s in steps)
        print(f"| {name} | {len(steps) + 2} | {step:.3f} | {sync:.4f} | {sync / step:.1%} |")
    for run, twin in (("resumed", "cuda"), ("rank_killed", "two_ranks")):
        if folders[run] is None or folders[twin] is None:
            print(f"\n{run}: missing (see its log)")
            ok = False
            continue
        verdict = same_run(folders[run], folders[twin])
        ok &= "DIFFERENT" not in verdict
        print(f"\n{run} against {twin}: {verdict}")
    events = read_jsonl(folders["rank_killed"] / "recovery.jsonl") if folders["rank_killed"] else []
    for event in events:
        fields = ("event", "cause", "lost_steps", "seconds")
        print("rank_killed recovery: " + ", ".join(f"{k}={event[k]}" for k in fields if k in event))
    peaks: dict[str, float] = defaultdict(float)
    samples = work / "nvidia-smi.csv"
    for line in samples.read_text().splitlines() if samples.exists() else []:
        pid, used, *command = line.split(",", 2)
        if used.strip().isdigit():
            key = f"{pid.strip()} {(command or [''])[0].strip()}"
            peaks[key] = max(peaks[key], float(used) / 1024)
    print("\n| GPU process (pid, command) | peak memory (GiB) |")
    print("|---|---:|")
    for key, peak in sorted(peaks.items(), key=lambda item: -item[1]):
        print(f"| {key} | {peak:.2f} |")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
