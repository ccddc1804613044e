#!/usr/bin/env bash
# Launch GRPO training: every argument is a Hydra override (or --config-name NAME).
#   bash launch/run_main_grpo.sh runner.max_steps=20 actor.num_workers=2
# With a Ray cluster running (`ray start`, or RAY_ADDRESS) the driver joins it; otherwise it starts
# an embedded local Ray.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${repo}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${PYTHON:-python}" -m rlrunner.main_grpo "$@"
