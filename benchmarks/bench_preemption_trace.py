#!/usr/bin/env python
"""Preemption traces: a run on a Ray cluster of several nodes whose actor nodes leave and come back, with
`runner.recovery.elastic` on and off, against the same run uninterrupted.

    python benchmarks/bench_preemption_trace.py [--actor-nodes 4] [--steps 60] [--leave-every 30]
        [--return-after 45] [--outage 90] [--shrink-after 5]

The cluster (ray.cluster_utils.Cluster, every node a set of processes on this machine): a head node of 1 CPU (the
driver and the snapshot holders) and `--actor-nodes` worker nodes of 1 CPU each. The job is the default one
(configs/grpo.yaml: the embedded tiny Qwen2, 16 prompts x 16 samples) with `--actor-nodes` actor ranks and one rollout
worker at 1 CPU each, so that every node holds one worker. The FSDP update is layout-invariant
(`actor.layout_invariant` resolves on for an elastic run; set here for every run, so that all of them compute the same
numbers). Each run trains `--steps` steps; its trace starts at its first completed step.

Traces (`--traces`):
  return   every `--leave-every` s a node holding an actor rank is removed, and a new node of the same size is added
           `--return-after` s later (the issue's trace is 60 s / 90 s; scaled down by default for a 2-core machine);
  outage   one node holding an actor rank is removed and none comes back for `--outage` s (the issue: 5 minutes).

Figures per run, against the uninterrupted run (its wall time W from its first to its last step):
  steps at W      steps completed within W of the run's first step (the uninterrupted run: all of them)
  loss -> step    from each node's removal to the next completed step (elastic: goal shrink_after_s + 5 s)
  grow -> step    recovery.jsonl's grow events: from the decision to grow back to the first step at the larger size
  same weights    the final checkpoint's weights equal the uninterrupted run's, bit for bit
  sizes           the data-parallel sizes the run's steps took (metrics.jsonl's actor/dp_size)
  ended           finished, or stopped at `--max-run-factor` x the uninterrupted run's wall time (an emergency
                  checkpoint, runner.max_wall_time_s), or gave up after runner.recovery.max_restarts restarts without
                  progress
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.common import command_line, machine, make_workdir, read_jsonl  # noqa: E402

HEAD_CPUS = 1


def start_cluster(actor_nodes: int) -> Any:
    """This process's Ray as the head node, and `actor_nodes` nodes of 1 CPU joined to it."""
    from ray.cluster_utils import Cluster

    ray.init(num_cpus=HEAD_CPUS, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    cluster = Cluster()
    cluster.head_node = ray._private.worker._global_node
    cluster.extra = [cluster.add_node(num_cpus=1) for _ in range(actor_nodes)]
    wait_nodes(actor_nodes + 1)
    return cluster


def wait_nodes(count: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(node["Alive"] for node in ray.nodes()) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster did not reach {count} nodes")
        time.sleep(0.2)


def overrides(output: Path, args: argparse.Namespace, elastic: bool, max_wall_s: float | None) -> list[str]:
    return [
        *([f"runner.max_wall_time_s={max_wall_s:.0f}"] if max_wall_s else []),
        f"runner.output_dir={output}",
        "runner.experiment_name=trace",
        f"runner.max_steps={args.steps}",
        f"runner.save_interval={args.steps}",
        "runner.logger.progress_bar=false",
        "runner.logger.backends=[]",
        "data.synthetic.val_size=0",
        f"actor.num_workers={args.actor_nodes}",
        "rollout.num_workers=1",
        "actor.layout_invariant=true",
        "cluster.cpus_per_actor_worker=1",
        "cluster.cpus_per_rollout_worker=1",
        "cluster.reuse_workers=false",
        f"runner.recovery.elastic={str(elastic).lower()}",
        f"runner.recovery.shrink_after_s={args.shrink_after}",
        "runner.recovery.wait_timeout_s=900",
        "runner.recovery.max_restarts=20",
    ]


class Trace:
    """Node removals and returns at times from the run's first completed step, applied from the main thread."""

    def __init__(self, kind: str, args: argparse.Namespace):
        self.kind, self.args = kind, args
        self.removed_at: list[float] = []
        self.due: list[tuple[float, str]] = []  # (seconds after the first step, "remove" | "add")
        if kind == "return":
            for leave in range(1, 1000):
                self.due.append((leave * args.leave_every, "remove"))
                self.due.append((leave * args.leave_every + args.return_after, "add"))
        elif kind == "outage":
            self.due = [(args.leave_every, "remove"), (args.leave_every + args.outage, "add")]
        self.due.sort()

    def apply(self, cluster: Any, supervisor: Any, since_first_step: float) -> None:
        while self.due and self.due[0][0] <= since_first_step:
            _, action = self.due.pop(0)
            if action == "add":
                cluster.extra.append(cluster.add_node(num_cpus=1))
            elif self._remove_actor_node(cluster, supervisor):
                self.removed_at.append(time.monotonic())

    @staticmethod
    def _remove_actor_node(cluster: Any, supervisor: Any) -> bool:
        trainer = supervisor.trainer
        group = trainer.actor_group if trainer is not None else None
        if group is None:
            return False
        nodes = {host["node_id"] for host in group.hosts}
        for node in list(cluster.extra):
            if node.node_id in nodes:
                cluster.extra.remove(node)
                cluster.remove_node(node)
                return True
        return False


def run(
    cluster: Any,
    work: Path,
    name: str,
    args: argparse.Namespace,
    elastic: bool,
    trace: Trace | None,
    max_wall_s: float | None = None,
) -> dict:
    """One run; with `max_wall_s` it is stopped then (runner.max_wall_time_s: an emergency checkpoint) if not done."""
    from rlrunner.config import load_config
    from rlrunner.errors import RecoveryExhaustedError, StoppedEarly
    from rlrunner.runner.supervisor import Supervisor

    output = work / name
    supervisor = Supervisor(load_config(overrides(output, args, elastic, max_wall_s)))
    errors: list[BaseException] = []
    ended = ["finished"]

    def train() -> None:
        try:
            supervisor.run()
        except StoppedEarly:
            ended[0] = f"stopped at {max_wall_s:.0f} s"
        except RecoveryExhaustedError:
            ended[0] = "gave up (runner.recovery.max_restarts)"
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    metrics = output / "trace" / "metrics.jsonl"
    step_times: list[float] = []
    while thread.is_alive():
        lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        step_times += [time.monotonic()] * (lines - len(step_times))
        if trace is not None and step_times:
            trace.apply(cluster, supervisor, time.monotonic() - step_times[0])
        time.sleep(0.05)
    if errors:
        raise errors[0]
    lines = read_jsonl(metrics)
    step_times += [time.monotonic()] * (len(lines) - len(step_times))
    recovery = output / "trace" / "recovery.jsonl"
    events = read_jsonl(recovery) if recovery.exists() else []
    from rlrunner.tools.convert import load_model_weights

    final = output / "trace" / "checkpoints" / f"global_step_{args.steps}"
    weights = load_model_weights(final) if final.is_dir() else None
    return {
        "ended": ended[0],
        "step_times": step_times,
        "removed_at": trace.removed_at if trace is not None else [],
        "events": events,
        "sizes": [line.get("actor/dp_size") for line in lines],
        "weights": weights,
    }


def restore_cluster(cluster: Any, actor_nodes: int) -> None:
    """Back to `actor_nodes` worker nodes before the next run."""
    while len(cluster.extra) < actor_nodes:
        cluster.extra.append(cluster.add_node(num_cpus=1))
    wait_nodes(actor_nodes + 1)


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def row(name: str, result: dict, baseline: dict) -> str:
    times, first = result["step_times"], result["step_times"][0]
    wall = baseline["step_times"][-1] - baseline["step_times"][0]
    at_w = sum(1 for t in times if t - first <= wall)
    to_step = []
    for removed in result["removed_at"]:
        later = [t for t in times if t > removed]
        if later:
            to_step.append(later[0] - removed)
    grows = [e["time_to_step_s"] for e in result["events"] if e["event"] == "grow"]
    shrinks = [e for e in result["events"] if e["event"] == "shrink"]
    lost = sum(e.get("lost_steps", 0) for e in result["events"] if e["event"] == "failure")
    sizes = sorted({s for s in result["sizes"] if s is not None})
    if result["weights"] is None:
        same = "- (not finished)"
    else:
        same = "yes" if same_weights(result["weights"], baseline["weights"]) else "NO"
    fmt = lambda xs: f"{statistics.median(xs):.1f} (max {max(xs):.1f})" if xs else "-"  # noqa: E731
    return (
        f"| {name} | {at_w} / {len(baseline['step_times'])} ({at_w / len(baseline['step_times']):.2f}x) | "
        f"{fmt(to_step)} | {fmt(grows)} | {len(shrinks)} / {len(grows)} | {lost} | "
        f"{same} | {', '.join(map(str, sizes))} | {times[-1] - first:.0f} | {result['ended']} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actor-nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--leave-every", type=float, default=30.0)
    parser.add_argument("--return-after", type=float, default=45.0)
    parser.add_argument("--outage", type=float, default=90.0)
    parser.add_argument("--shrink-after", type=float, default=5.0)
    parser.add_argument("--traces", nargs="+", default=["return", "outage"], choices=["return", "outage"])
    parser.add_argument(
        "--max-run-factor",
        type=float,
        default=2.0,
        help="a run with a trace is stopped after this many times the uninterrupted run's wall time, if not done",
    )
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args()
    work = make_workdir(None, "bench-preemption-")
    cluster = start_cluster(args.actor_nodes)
    print(f"# {command_line()}\n# {machine()}\n", flush=True)
    results: dict[str, dict] = {}
    try:
        started = time.monotonic()
        results["uninterrupted"] = run(cluster, work, "uninterrupted", args, elastic=True, trace=None)
        max_wall_s = args.max_run_factor * (time.monotonic() - started)
        for kind in args.traces:
            for elastic in (True, False):
                name = f"{kind}, elastic {'on' if elastic else 'off'}"
                print(f"running: {name}", flush=True)
                folder = name.replace(", ", "-").replace(" ", "_")
                results[name] = run(cluster, work, folder, args, elastic, Trace(kind, args), max_wall_s)
                restore_cluster(cluster, args.actor_nodes)
    finally:
        ray.shutdown()
    baseline = results["uninterrupted"]
    print(
        "| run | steps at W | loss -> next step s | grow -> step s | shrinks / grows | steps lost | same weights "
        "| dp sizes | wall s | ended |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, result in results.items():
        print(row(name, result, baseline))
    wall = baseline["step_times"][-1] - baseline["step_times"][0]
    print(
        f"\nW = {wall:.1f} s ({args.steps} steps uninterrupted at dp {args.actor_nodes}); shrink_after_s = "
        f"{args.shrink_after}; trace: leave every {args.leave_every:g} s, back {args.return_after:g} s later; "
        f"outage {args.outage:g} s"
    )
    if args.json:
        plain = {n: {k: v for k, v in r.items() if k != "weights"} for n, r in results.items()}
        args.json.write_text(json.dumps(plain, indent=1))


if __name__ == "__main__":
    main()
