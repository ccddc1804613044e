#!/usr/bin/env python
"""Multi-turn rollouts with a tool: what a step costs against a single-turn one, the share of a step spent waiting
on a slow tool, the tool processes' speed-up, and (`--learning`) what the calculator job learns with its tool and
without it.

Step time (the default): the calculator job (`configs/calculator_tool.yaml`: the embedded tiny Qwen2, 16 prompts x 16
samples a step, one rollout worker) from its random initial weights, with a parser that makes every first turn a call,
so that every trajectory has two turns and one tool call in between (the most a two-turn job pays), against a single-
turn job on the same prompts that generates and trains on as many tokens as the multi-turn job's sequences hold
(`rollout.max_new_tokens` = its tokens after the prompt, model's and tool's, measured in the multi-turn run; the ratio
of the goal), and one that generates as many as its model did (the two turns' together). Then the same multi-turn job
with a tool that sleeps `--sleep-ms` (50 ms) per call, in 1 and in 4 tool processes: the share of its step spent waiting
on the tool is its step time less the instant tool's, over its step time. One embedded local Ray, one run after the
other, `--warmup` + `--steps` steps each, no periodic save; medians of `time/step_s` over the measured steps, ratios
against a run of the same invocation. The runs with a slow tool must log the same metrics whatever their number of tool
processes, and so must the instant tool's (the tool's time changes no bit).

`--learning`: the calculator job itself, `--learning-steps` (800) steps with the tool, then with
`rollout.multi_turn.tools=null`; the reward and the exact-answer share over the last 50 steps of each, and the run's
wall time.

Run from the repository root:

    .venv/bin/python benchmarks/bench_agents.py                  # step time, tool wait, tool processes
    .venv/bin/python benchmarks/bench_agents.py --learning       # the calculator job with and without its tool
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, beside this script
from benchlib.common import command_line, cpu_model, make_workdir, read_jsonl, runs_in_embedded_ray  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

TOOLS = '''
"""The calculator's tool, taking {seconds} s a call; and a parser that makes every first turn a call."""
import time


def multiply(numbers: list[int]) -> int:
    """Multiply integers together.

    Args:
        numbers: the factors
    """
    time.sleep({seconds})
    product = 1
    for number in numbers:
        product *= number
    return product


def every_turn_calls(text):
    return [{{"name": "multiply", "arguments": {{"numbers": [len(text), 7, 9]}}}}]
'''


def run(args: argparse.Namespace, name: str, overrides: list[str], work: Path) -> list[dict[str, Any]]:
    """One run of the calculator job with `overrides`: its steps' metrics."""
    from rlrunner.config import load_config
    from rlrunner.runner.metrics import METRICS_FILE
    from rlrunner.runner.supervisor import Supervisor

    total = args.warmup + args.steps
    cfg = load_config(
        [
            f"runner.output_dir={work}",
            f"runner.experiment_name={name}",
            f"runner.max_steps={total}",
            f"runner.save_interval={total + 1000}",
            "runner.val_interval=0",
            "runner.logger.progress_bar=false",
            "runner.logger.backends=[]",
            *overrides,
            *args.override,
        ],
        config_name="calculator_tool",
    )
    started = time.perf_counter()
    supervisor = Supervisor(cfg)
    supervisor.run()
    steps = [s for s in read_jsonl(Path(supervisor.ctx.log_path) / METRICS_FILE) if s["step"] >= 1]
    print(f"{name}: {len(steps)} steps in {time.perf_counter() - started:.1f}s (start-up included)", flush=True)
    return steps


def median(steps: list[dict[str, Any]], key: str, first: int) -> float:
    return statistics.median(s[key] for s in steps if s["step"] >= first)


def untimed(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if not k.startswith("time/")} for s in steps]


def step_time(args: argparse.Namespace, work: Path) -> bool:
    first = args.warmup + 1
    tools = {}
    for label, seconds in (("instant", 0.0), ("slow", args.sleep_ms / 1000)):
        tools[label] = work / f"tools_{label}.py"
        tools[label].write_text(textwrap.dedent(TOOLS.format(seconds=seconds)))
    measured: dict[str, list[dict[str, Any]]] = {}

    def runs(name: str) -> None:
        if name.startswith("single-turn"):  # as many tokens as the multi-turn run's model made, or its sequences hold
            key = "agent/model_tokens_mean" if name == "single-turn" else "rollout/response_length_mean"
            tokens = round(statistics.mean(s[key] for s in measured["multi-turn"]))
            overrides = ["rollout.multi_turn.tools=null", f"rollout.max_new_tokens={tokens}"]
        else:
            label, processes = ("instant", 2) if name == "multi-turn" else ("slow", int(name.split("-")[-1]))
            overrides = [
                f"rollout.multi_turn.tools={tools[label]}",
                f"rollout.multi_turn.parser={tools[label]}:every_turn_calls",
                f"rollout.multi_turn.num_workers={processes}",
            ]
        measured[name] = run(args, name, overrides, work)

    names = ["multi-turn", "single-turn", "single-turn-long", *[f"slow-tool-{p}" for p in args.tool_workers]]
    runs_in_embedded_ray(4, work, names, runs)
    t_single = median(measured["single-turn-long"], "time/step_s", first)
    print()
    print("| run | model tokens a trajectory | tokens after the prompt | step (s) | rollout (s) | update (s) | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in ("single-turn-long", "single-turn", "multi-turn"):
        steps = measured[name]
        model = statistics.mean(s.get("agent/model_tokens_mean", s["rollout/response_length_mean"]) for s in steps)
        length = statistics.mean(s["rollout/response_length_mean"] for s in steps)
        times = [median(steps, key, first) for key in ("time/step_s", "time/rollout_s", "time/update_s")]
        print(f"| {name} | {model:.1f} | {length:.1f} | {times[0]:.3f} | {times[1]:.3f} | {times[2]:.3f} | "
              f"{times[0] / t_single:.2f} |")  # fmt: skip
    t_multi = median(measured["multi-turn"], "time/step_s", first)
    t_short = median(measured["single-turn"], "time/step_s", first)
    print(f"\nmulti-turn / single-turn step time, the same tokens trained: {t_multi / t_single:.2f}x (goal: at most "
          f"1.3x); the same tokens generated: {t_multi / t_short:.2f}x")  # fmt: skip
    calls = 16 * 16 * statistics.mean(s["agent/tool_calls_mean"] for s in measured["multi-turn"])
    print(f"\na tool of {args.sleep_ms:g} ms a call, {calls:.0f} calls a step ({calls * args.sleep_ms / 1000:.1f} s of "
          "calls in one process):")  # fmt: skip
    print("| tool processes | step (s) | waiting on the tool (s) | share of the step | speed-up |")
    print("|---:|---:|---:|---:|---:|")
    slow = {p: median(measured[f"slow-tool-{p}"], "time/step_s", first) for p in args.tool_workers}
    for processes, seconds in slow.items():
        waiting = seconds - t_multi
        print(f"| {processes} | {seconds:.3f} | {waiting:.3f} | {waiting / seconds:.0%} | "
              f"{slow[args.tool_workers[0]] / seconds:.2f}x |")  # fmt: skip
    same = all(untimed(measured[f"slow-tool-{p}"]) == untimed(measured["multi-turn"]) for p in args.tool_workers)
    print(f"\nmetrics apart from timings: {'the same' if same else 'NOT the same'} for the instant and the slow tool")
    return same


def learning(args: argparse.Namespace, work: Path) -> bool:
    from rlrunner.config import load_config
    from rlrunner.runner.metrics import METRICS_FILE
    from rlrunner.runner.supervisor import Supervisor

    def job(name: str) -> tuple[list[dict[str, Any]], float]:
        overrides = [] if name == "tool" else ["rollout.multi_turn.tools=null"]
        cfg = load_config(
            [
                f"runner.output_dir={work}",
                f"runner.experiment_name={name.replace(' ', '-')}",
                f"runner.max_steps={args.learning_steps}",
                "runner.logger.progress_bar=false",
                "runner.logger.backends=[]",
                *overrides,
                *args.override,
            ],
            config_name="calculator_tool",
        )
        started = time.perf_counter()
        supervisor = Supervisor(cfg)
        supervisor.run()
        return read_jsonl(Path(supervisor.ctx.log_path) / METRICS_FILE), time.perf_counter() - started

    results = runs_in_embedded_ray(4, work, ["tool", "no tool"], job)
    print()
    header = ["job", "reward, last 50 steps", "exact answers, last 50", "tool calls a trajectory", "val accuracy"]
    print("| " + " | ".join([*header, "wall time (s)"]) + " |")
    print("|---|---:|---:|---:|---:|---:|")  # fmt: skip
    last = {}
    for name, (records, seconds) in results.items():
        steps = [r for r in records if r["step"] >= 1]
        tail = steps[-50:]
        last[name] = statistics.mean(r["rollout/reward_mean"] for r in tail)
        accuracy = statistics.mean(r["rollout/accuracy"] for r in tail)
        calls = statistics.mean(r.get("agent/tool_calls_mean", 0.0) for r in tail)
        val = [r["val/accuracy"] for r in records if "val/accuracy" in r]
        print(f"| {name} | {last[name]:.3f} | {accuracy:.3f} | {calls:.2f} | {val[0]:.3f} -> {val[-1]:.3f} | "
              f"{seconds:.0f} |")  # fmt: skip
    gain = last["tool"] - last["no tool"]
    print(f"\nreward with the tool - without it, last 50 steps: {gain:+.3f} (goal: at least +0.2)")
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learning", action="store_true", help="the calculator job with and without its tool")
    parser.add_argument("--learning-steps", type=int, default=800, help="steps of each --learning run")
    parser.add_argument("--sleep-ms", type=float, default=50.0, help="what one call of the slow tool sleeps")
    parser.add_argument("--tool-workers", type=int, nargs="+", default=[1, 4], help="tool processes of the slow runs")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per run, excluded from the medians")
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="an extra override for every run"
    )
    parser.add_argument("--dir", type=Path, default=None, help="folder for the runs (a fresh subfolder is made)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or any(w < 1 for w in args.tool_workers):
        parser.error("--steps and every --tool-workers value must be positive, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.chdir(REPO)  # the calculator config names its files relative to the repository
    print(f"command: {command_line()}")
    print(f"machine: {os.cpu_count()} CPU cores ({cpu_model()})")
    work = make_workdir(args.dir, "bench_agents_")
    started = time.perf_counter()
    ok = learning(args, work) if args.learning else step_time(args, work)
    print(f"total time: {time.perf_counter() - started:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
