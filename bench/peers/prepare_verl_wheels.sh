#!/usr/bin/env bash
# The wheels the GPU machine needs to run verl's GRPO trainer (bench/peers/verl_grpo.py), beyond
# those of ../shared/gpu/prepare-wheels.sh (vLLM, Ray, DeepSpeed, TRL and its data stack), in parts
# of at most 56 MiB, so that each fits one device call.
#
# Usage, from the project root:  bash bench/peers/prepare_verl_wheels.sh [OUT_DIR]
# OUT_DIR (default .gpu-wheels/verl) must be git-ignored. Then, on the device, after the shared
# parts and in the same warm machine: copy each part into /root/wheels/verl/ (carry
# [".gpu-wheels/verl/partK"]) and install them on top of the shared ones:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/wheels/verl/*.whl
# Nothing else changes on the machine: its torch 2.11 and transformers 5.17 serve verl too (see
# docs/performance/peers.md for why, and TRANSFORMERS_PIN below for verl's own pin).
#
# Versions: verl 0.9.1 (its pins: tensordict <= 0.10.0, hydra-core 1.3 with omegaconf < 2.4 and
# antlr4 4.9.*). The vLLM API server that verl's rollout starts (Conveyor never does) imports
# uvicorn, watchfiles and model_hosting_container_standards, which the shared set leaves out.
set -euo pipefail
out="${1:-.gpu-wheels/verl}"
mkdir -p "$out/dl"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64)
for n in 17 24 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
dl() { python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/dl" "$@"; }
dl verl==0.9.1 transferqueue==0.1.11 hydra-core==1.3.8 omegaconf==2.3.0 codetiming==1.4.0 \
   tensordict==0.10.0 'pyvers>=0.1,<0.2' orjson cloudpickle importlib-metadata zipp torchdata==0.11.0 \
   peft==0.21.2 einops pylatexenc==2.11 \
   model-hosting-container-standards==0.1.16 jmespath supervisor httpx httpcore h11 anyio idna certifi \
   uvicorn watchfiles python-multipart prometheus-fastapi-instrumentator
# antlr4-python3-runtime 4.9.3 (the one hydra-core 1.3 accepts) is published as a source archive
# only; it is pure Python, so a wheel built here installs on the device.
python3 -m pip wheel -q --no-deps -w "$out/dl" antlr4-python3-runtime==4.9.3
# verl 0.9.1 asks for transformers < 5.11; the device has 5.17. TRANSFORMERS_PIN=1 also puts 5.10.4
# into OUT_DIR/pin (a part of its own), for a run at verl's own pin: install it into a directory of
# its own and give that to verl only (run_verl's pythonpath; vLLM 0.26 accepts transformers >= 5.5.3):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/verl-pin /root/wheels/verl-pin/*.whl
if [ "${TRANSFORMERS_PIN:-0}" = 1 ]; then
  mkdir -p "$out/pin"
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/pin" transformers==5.10.4
  du -m "$out/pin"/*.whl
fi
# Pack into parts of <= 56 MiB (no verl wheel is larger than that: nothing to split).
python3 - "$out" <<'PY'
import os, shutil, sys
out = sys.argv[1]; dl = os.path.join(out, "dl"); limit = 56 * 1024 * 1024
files = sorted(os.listdir(dl), key=lambda f: -os.path.getsize(os.path.join(dl, f)))
parts, total = [], 0
for f in files:
    size = os.path.getsize(os.path.join(dl, f)); total += size
    if size > limit:
        sys.exit(f"{f}: {size / 2**20:.1f} MiB is over one part's 56 MiB")
    for p in parts:
        if p[0] + size <= limit:
            p[0] += size; p[1].append(f); break
    else:
        parts.append([size, [f]])
for k, (size, names) in enumerate(parts, 1):
    d = os.path.join(out, f"part{k}"); os.makedirs(d, exist_ok=True)
    for f in names:
        shutil.move(os.path.join(dl, f), os.path.join(d, f))
    print(f"part{k}: {len(names)} wheels, {size / 2**20:.1f} MiB")
print(f"total: {len(files)} wheels, {total / 2**20:.1f} MiB")
PY
rmdir "$out/dl"
