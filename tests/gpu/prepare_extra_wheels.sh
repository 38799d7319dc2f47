#!/usr/bin/env bash
# The wheels tests/gpu/test_day_one_gpu.py needs on the lent GPU machine beyond those of
# ../shared/gpu/prepare-wheels.sh: peft (model.lora), mlflow-skinny and wandb (run.trackers),
# TensorBoard's reader, and what they import that neither the image nor the shared parts have
# (the image lacks importlib_metadata, zipp and cloudpickle, which MLflow imports).
#
# Usage, from the project root:  bash tests/gpu/prepare_extra_wheels.sh [OUT_DIR]
# OUT_DIR (default .gpu-wheels/extra) must be git-ignored. On the device, with the shared parts
# already in /root/wheels: copy this part there too (carry [".gpu-wheels/extra/part1"]) before
# tests/gpu/install-on-device.sh, which installs every wheel in /root/wheels.
set -euo pipefail
out="${1:-.gpu-wheels/extra}"
mkdir -p "$out/dl" "$out/part1"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64)
for n in 17 24 27 28 31 34 35; do plat+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q "${plat[@]}" -d "$out/dl" peft mlflow-skinny wandb tensorboard \
  'opentelemetry-sdk==1.45.2' 'opentelemetry-proto==1.45.2' 2>&1 | grep -v '^WARNING: Location' || true
# The image has these (torch, transformers and their stack), the shared parts the rest.
skip='^(numpy|pillow|setuptools|pyyaml|requests|charset_normalizer|urllib3|idna|certifi|packaging|typing_extensions|'
skip+='torch|transformers|tokenizers|safetensors|huggingface_hub|hf_xet|filelock|fsspec|tqdm|regex|jinja2|markupsafe|'
skip+='sympy|mpmath|networkx|psutil|accelerate|pydantic|pydantic_core|annotated_types|typing_inspection|fastapi|'
skip+='starlette|anyio|sniffio|h11|httpcore|httpx|uvicorn|cachetools|xxhash|opentelemetry_api|python_multipart|'
skip+='distro|protobuf|grpcio|httpx2|httpcore2|kernels|cuda_pathfinder|rich|'
skip+='pygments|markdown_it_py|mdurl|cuda_.*|nvidia_.*|triton)-'
for w in "$out"/dl/*.whl; do
  if basename "$w" | grep -Eiq "$skip"; then rm "$w"; else mv "$w" "$out/part1/"; fi
done
rm -rf "$out/dl"
du -sh "$out/part1"; ls "$out/part1"
