#!/usr/bin/env bash
# On the GPU machine, after tests/gpu/install-on-device.sh (the shared wheels in /tmp/site) and with
# verl's part copied to /root/wheels/verl: install verl into /tmp/verl-site and make /tmp/site-notrl,
# the shared site without TRL. Then run the verl row, beside the others in one call, with
#   CONVEYOR_VERL_SITE=/tmp/site-notrl:/tmp/verl-site python3 -m bench longtail --systems streaming,lockstep,trl,verl ...
# Why without TRL: verl 0.9.1's apply_monkey_patch imports AutoModelForCausalLMWithValueHead from
# `trl` whenever TRL is importable, and TRL 1.16 has no such class (docs/performance/peers.md).
# Packages the shared site has win over verl's copies (/tmp/site-notrl comes first).
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/verl-site /root/wheels/verl/*.whl
mkdir -p /tmp/site-notrl
for p in /tmp/site/*; do
  case "${p##*/}" in
    trl|trl-*) ;;
    *) ln -sfn "$p" "/tmp/site-notrl/${p##*/}" ;;
  esac
done
PYTHONPATH=/tmp/site-notrl:/tmp/verl-site python3 -c \
  "import importlib.util as u, verl; assert u.find_spec('trl') is None; print('verl', verl.__version__, 'without trl')"
