#!/usr/bin/env bash
# On a lent GPU machine, after tests/gpu/install-on-device.sh and with verl's wheels in
# /root/wheels/verl: every row of `bench longtail` in one call (Conveyor streaming and
# lock-step, each with MPS (placement.mps: auto, the default) and without, TRL, verl, the engines alone), verl
# in a site of its own without TRL
# (bench/peers/verl_env_on_device.sh, CONVEYOR_VERL_SITE). Writes under OUT_DIR.
#
#   bash bench/peers/longtail_all_rows.sh OUT_DIR [SCALE] [STEPS] [SYSTEMS]
#
# At qwen3_0.6b, scale 0.25 and 4 steps the rows take about 30 minutes together (verl's
# alone about 9): start it with `tests/gpu/device.sh start`, collect it with `poll`.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: longtail_all_rows.sh OUT_DIR [SCALE] [STEPS] [SYSTEMS]}
scale=${2:-0.25}
steps=${3:-4}
systems=${4:-streaming,lockstep,streaming[placement.mps=false],lockstep[placement.mps=false],trl,verl,engines}
mkdir -p "$out"
case ",$systems," in *,verl,*|*,verl\[*) bash bench/peers/verl_env_on_device.sh ;; esac  # only for its row
CONVEYOR_VERL_SITE=/tmp/site-notrl:/tmp/verl-site python3 -m bench longtail --model qwen3_0.6b \
  --scale "$scale" --steps "$steps" --systems "$systems" --out "$out"
