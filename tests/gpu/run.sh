#!/usr/bin/env bash
# The GPU tier, on a machine with a CUDA GPU:   bash tests/gpu/run.sh [pytest args]
#
# Installs vLLM, Ray and DeepSpeed when they are missing, from wheels in /root/wheels
# (copied there from .gpu-wheels/partK, which `bash ../shared/gpu/prepare-wheels.sh`
# makes) or from .gpu-wheels itself, with tests/gpu/install-on-device.sh; then runs
# tests/gpu with CONVEYOR_GPU_TESTS=1. Logs go to $OUT (the device tool's result
# folder) or runs/gpu-tests: pytest.log, quickstart.log, replay.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
log_dir="${OUT:-runs/gpu-tests}"
mkdir -p "$log_dir"
export CONVEYOR_GPU_LOG_DIR="$log_dir" CONVEYOR_GPU_TESTS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# vLLM forks its engine process unless it sees CUDA initialised in the caller; the engine
# tests touch CUDA in pytest's process first, and run alone (-k) the forked engine failed
# with "Cannot re-initialize CUDA in forked subprocess". Spawn always.
export VLLM_WORKER_MULTIPROC_METHOD=spawn
[ -f /root/wheels/env.sh ] && . /root/wheels/env.sh
if ! python3 -c "import vllm, ray, deepspeed" 2>/dev/null; then
  mkdir -p /root/wheels
  if ! ls /root/wheels/*.whl* >/dev/null 2>&1; then
    if ! ls .gpu-wheels/part*/* >/dev/null 2>&1; then
      echo "tests/gpu/run.sh: vLLM, Ray or DeepSpeed missing and no wheels in /root/wheels or .gpu-wheels" >&2
      exit 2
    fi
    cp .gpu-wheels/part*/* /root/wheels/
  fi
  bash tests/gpu/install-on-device.sh || exit 2
  . /root/wheels/env.sh
fi
if ! python3 -c "import pipeline.transport" 2>/dev/null || [ "$(python3 -c 'import pipeline, os; print(os.path.dirname(os.path.dirname(pipeline.__file__)))')" != "$PWD" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 2
fi
python3 -c "import torch, vllm, ray, deepspeed; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '', '| vllm', vllm.__version__, 'ray', ray.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1 | tee "$log_dir/pytest.log"
# Order: the quickstart run before the engine tests, whose process keeps GPU memory cached.
[ $# -gt 0 ] || set -- tests/gpu/test_transport_gpu.py tests/gpu/test_pipeline_gpu.py tests/gpu/test_colocate_gpu.py tests/gpu/test_resume_gpu.py tests/gpu/test_engine_kill_gpu.py tests/gpu/test_stop_gpu.py tests/gpu/test_mps_gpu.py tests/gpu/test_engines_gpu.py
python3 -m pytest -v -p no:cacheprovider -rA "$@" 2>&1 | tee -a "$log_dir/pytest.log"
