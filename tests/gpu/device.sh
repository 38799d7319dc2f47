#!/usr/bin/env bash
# On a lent GPU machine whose one command has a time limit: install once, then run the
# GPU tier or a benchmark in the foreground, or start a long job in the background and
# collect it over later commands of the same machine start.
#
#   bash tests/gpu/device.sh copy PART             copy .gpu-wheels/PART/* to /root/wheels (one part a command)
#   bash tests/gpu/device.sh tests SECS [ARGS...]  bash tests/gpu/run.sh ARGS, stopped after SECS
#   bash tests/gpu/device.sh run SECS CMD...       CMD, stopped after SECS
#   bash tests/gpu/device.sh start SECS CMD...     CMD in a process session of its own (it outlives
#                                                  this command), stopped after SECS; its output in
#                                                  /root/job/log, its files under $JOB_OUT (/root/job/out)
#   bash tests/gpu/device.sh poll SECS             wait up to SECS for the started job; copy its log
#                                                  to $OUT/job/log and the JSON/PNG/log files under
#                                                  $JOB_OUT, paths kept, to $OUT/job/files.tgz (the
#                                                  device tool returns at most 8 files a call)
#
# Every mode but copy installs vLLM, Ray and DeepSpeed first where they are missing
# (tests/gpu/install-on-device.sh) and sets what the GPU tier sets: offline Hub, spawned
# vLLM workers, the installed packages' path before this checkout's, and
# CONVEYOR_SOURCE_COMMIT from the file .commit (the device's copy has no .git: write it
# beside the checkout with `git rev-parse HEAD > .commit`). Environment variables such
# as CONVEYOR_SHAPES pass through. $OUT is the device tool's result folder.
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-}
shift || true
out="${OUT:-runs/device}"
mkdir -p "$out"
job=/root/job

prepare() {
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1
  [ -f /root/wheels/env.sh ] && . /root/wheels/env.sh
  if ! python3 -c "import vllm, ray, deepspeed" 2>/dev/null; then
    bash tests/gpu/install-on-device.sh > "$out/install.log" 2>&1 || { tail -30 "$out/install.log"; exit 2; }
    . /root/wheels/env.sh
  fi
  # env.sh puts the installed packages on PYTHONPATH: keep them, this checkout first.
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  CONVEYOR_SOURCE_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
  export CONVEYOR_SOURCE_COMMIT
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
  df -h / | tail -1
}

# After a command: the disk's free space, where core dumps go, and the largest files on
# the root file system (a 4B run once filled the disk and nothing said with what).
disk_report() {
  echo "device.sh: disk $(df -h / | tail -1 | awk '{print $4 " free of " $2}'); core_pattern $(cat /proc/sys/kernel/core_pattern 2>/dev/null), core size limit $(ulimit -c)"
  find / -xdev -type f -size +1G -printf '%s %p\n' 2>/dev/null | sort -rn | head -8 \
    | awk '{printf "device.sh:   %6.1f GiB  %s\n", $1 / 1073741824, $2}'
}

need_secs() {
  [[ "${1:-}" =~ ^[0-9]+$ ]] || { echo "device.sh $mode: expected SECS (a whole number of seconds), got '${1:-}'" >&2; exit 2; }
}

case "$mode" in
  copy)
    [ -d ".gpu-wheels/${1:-}" ] || { echo "device.sh copy: no .gpu-wheels/${1:-} here (carry it)" >&2; exit 2; }
    mkdir -p /root/wheels && cp ".gpu-wheels/$1"/* /root/wheels/ && ls /root/wheels | wc -l ;;
  tests)
    need_secs "${1:-}"; secs=$1; shift; prepare
    timeout "$secs" bash tests/gpu/run.sh "$@"; echo "device.sh: exit $?"; disk_report ;;
  run)
    need_secs "${1:-}"; secs=$1; shift; prepare
    timeout "$secs" "$@" 2>&1 | tee "$out/run.log"; echo "device.sh: exit ${PIPESTATUS[0]}"; disk_report ;;
  start)
    need_secs "${1:-}"; secs=$1; shift; prepare
    [ $# -gt 0 ] || { echo "device.sh start: expected a command" >&2; exit 2; }
    rm -rf "$job" && mkdir -p "$job/out"
    export JOB_OUT="$job/out"
    setsid bash -c 'timeout "$0" "$@" > /root/job/log 2>&1; echo $? > /root/job/done' "$secs" "$@" \
      < /dev/null > /dev/null 2>&1 &
    sleep 5; echo "device.sh: started"; tail -5 "$job/log" ;;
  poll)
    need_secs "${1:-}"
    for _ in $(seq "$1"); do [ -f "$job/done" ] && break; sleep 1; done
    echo "device.sh: job exit $(cat "$job/done" 2>/dev/null || echo 'running')"
    mkdir -p "$out/job"
    cp "$job/log" "$out/job/" 2>/dev/null
    (cd "$job/out" && find . -type f \( -name '*.json' -o -name '*.png' -o -name '*.log' \) -print0 \
      | tar -czf "$out/job/files.tgz" --null -T -) 2>/dev/null
    grep -v '^\s*$' "$job/log" 2>/dev/null | tail -60
    [ -f "$job/done" ] && disk_report ;;
  *)
    sed -n '2,15p' "$0"; exit 2 ;;
esac
