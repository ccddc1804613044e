#!/usr/bin/env bash
# The GPU check: what a lent GPU machine can show that this CPU machine cannot, in one script of a few minutes.
#
#   bash benchmarks/gpu_check.sh pack     # here (network): Ray, Hydra and torchdata packed into .gpu-env/
#   bash benchmarks/gpu_check.sh run      # on the GPU machine, from the repository root (the `device` tool:
#                                         #   carry [".gpu-env"], command "bash benchmarks/gpu_check.sh run", 540 s)
#
# `run` installs the carried packages, then on one GPU: the default job on CUDA (actor and rollout worker sharing
# the GPU: cluster.gpus_per_worker=0.5), the same with rollout.engine=vllm where vLLM imports (the GPU machine has no
# network and a device call carries at most 64 MiB: vLLM's CUDA wheel and its dependencies are far over that, so it is
# there only if the machine came with it), a run stopped by SIGTERM halfway and resumed with `auto` against the
# uninterrupted run (final weights and untimed metrics compared bit for bit), and a two-rank run with an actor rank
# SIGKILLed mid-run (repaired in-job: its recovery.jsonl, steps lost, final weights against the same job uninterrupted).
# It prints the weight sync's share of a step and each GPU process's peak memory (nvidia-smi sampled every 0.5 s).
# Figures go to docs/benchmarks.md ("GPU check"). GPU_CHECK_STEPS (default 60) sets each run's length;
# GPU_CHECK_ON_CPU=1 runs the same check on this CPU machine's .venv (the script's own test: no GPU figures).
set -euo pipefail
cd "$(git rev-parse --show-toplevel 2>/dev/null || dirname "$(dirname "$(readlink -f "$0")")")"

case "${1:-}" in
pack)
    bash ../shared/tools/gpu-env/pack.sh
    echo "gpu_check: packed .gpu-env/; on the GPU machine: bash benchmarks/gpu_check.sh run (carry .gpu-env)"
    exit 0
    ;;
run) ;;
*)
    echo "usage: bash benchmarks/gpu_check.sh pack|run" >&2
    exit 2
    ;;
esac

py=python3
if [ "${GPU_CHECK_ON_CPU:-0}" = 1 ]; then
    py=.venv/bin/python
    gpus=0
else
    [ -f .gpu-env/setup.sh ] || { echo "gpu_check: no .gpu-env/ here: run 'bash benchmarks/gpu_check.sh pack' first and carry it" >&2; exit 2; }
    # shellcheck disable=SC1091
    source .gpu-env/setup.sh
    python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "gpu_check: torch sees no CUDA device on this machine" >&2; exit 2; }
    gpus=1
fi

steps="${GPU_CHECK_STEPS:-60}"
work="$(mktemp -d /tmp/gpu_check.XXXXXX)"
samples="$work/nvidia-smi.csv"
echo "gpu_check: $( ((gpus)) && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1 || echo CPU), work in $work, $steps steps a run"

# every GPU process's memory, twice a second, for the whole check (its peak per process is reported at the end)
sampler=
if ((gpus)); then
    (while true; do
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
            | while IFS=', ' read -r pid used; do echo "$pid,$used,$(ps -o args= -p "$pid" 2>/dev/null | cut -c1-40)"; done
        sleep 0.5
    done) >"$samples" &
    sampler=$!
    trap 'kill $sampler 2>/dev/null || true' EXIT
fi

common=("cluster.gpus_per_worker=$("$py" -c "print(0.5 * $gpus)")" actor.num_workers=1 rollout.num_workers=1 "runner.max_steps=$steps"
    runner.save_interval=20 runner.val_interval=0 runner.logger.backends=[] runner.logger.progress_bar=false)

job() {  # job NAME OVERRIDES...: one run of the default job under $work/NAME; its exit code
    local name=$1; shift
    local started=$SECONDS
    set +e
    "$py" -m rlrunner.main_grpo "runner.output_dir=$work/$name" "$@" >"$work/$name.log" 2>&1
    local rc=$?
    set -e
    echo "gpu_check: $name exited $rc after $((SECONDS - started)) s (log: $work/$name.log)"
    [ $rc -eq 0 ] || tail -5 "$work/$name.log"
    return $rc
}

wait_for_step() {  # wait_for_step NAME STEP: until NAME's metrics.jsonl has STEP
    local file
    for _ in $(seq 600); do
        file=$(find "$work/$1" -name metrics.jsonl 2>/dev/null | head -1)
        if [ -n "$file" ] && "$py" -c "import json,sys; sys.exit(0 if any(json.loads(l).get('step', 0) >= $2 for l in open('$file')) else 1)" 2>/dev/null; then
            return 0
        fi
        sleep 0.5
    done
    return 1
}

status=0
job cuda "${common[@]}" || status=1

if ! ((gpus)); then
    echo "gpu_check: on CPU the vllm run is left out (tests/integration/test_vllm_engine.py covers it here)"
elif "$py" -c "import vllm" 2>/dev/null; then
    job vllm "${common[@]}" rollout.engine=vllm || status=1
else
    echo "gpu_check: vllm is not on this machine (no network, and its CUDA wheel is far over what a call carries): its run is left out"
fi

# stopped by SIGTERM at about half the steps (an emergency checkpoint), then resumed with auto
"$py" -m rlrunner.main_grpo "runner.output_dir=$work/resumed" "${common[@]}" >"$work/resumed.log" 2>&1 &
driver=$!
if wait_for_step resumed $((steps / 2)); then kill -TERM $driver; fi
set +e; wait $driver; rc=$?; set -e
echo "gpu_check: resumed stopped by SIGTERM (exit $rc) after step $(find "$work/resumed" -name metrics.jsonl -exec wc -l {} + | awk '{print $1; exit}')"
job resumed "${common[@]}" runner.resume_dir=auto || status=1

# two actor ranks, one SIGKILLed mid-run, against the same two-rank job uninterrupted
two=("cluster.gpus_per_worker=$("$py" -c "print(0.25 * $gpus)")" actor.num_workers=2 rollout.num_workers=1 "runner.max_steps=$steps"
    runner.save_interval=20 runner.val_interval=0 runner.logger.backends=[] runner.logger.progress_bar=false)
job two_ranks "${two[@]}" || status=1
"$py" -m rlrunner.main_grpo "runner.output_dir=$work/rank_killed" "${two[@]}" >"$work/rank_killed.log" 2>&1 &
driver=$!
if wait_for_step rank_killed $((steps / 2)); then
    victim=$(pgrep -f "ray::.*ActorWorker" | head -1 || true)
    [ -n "$victim" ] && kill -KILL "$victim" && echo "gpu_check: SIGKILLed actor rank process $victim"
fi
set +e; wait $driver; rc=$?; set -e
echo "gpu_check: rank_killed exited $rc"
[ $rc -eq 0 ] || status=1

[ -z "$sampler" ] || kill "$sampler" 2>/dev/null || true
"$py" benchmarks/gpu_check_report.py "$work" || status=1
exit $status
