#!/usr/bin/env bash
# Split a wheel part of .gpu-wheels (../shared/gpu/prepare-wheels.sh) in two halves,
# PARTa and PARTb, for when the part and the working tree together pass the device
# tool's 64 MiB a call: files fill PARTa up to half the part, the rest go to PARTb, and
# the wheel piece that crosses the middle is cut, its second half named <file>x, which
# install-on-device.sh's `cat "$base".piece*` reads back in order (piece00 < piece00x <
# piece01). Copy both halves (`device.sh copy PARTa`, then PARTb)
# before installing.
#
#   bash tests/gpu/split_wheel_part.sh part1
set -euo pipefail
cd "$(dirname "$0")/../.."
part=${1:?usage: split_wheel_part.sh PART}
src=.gpu-wheels/$part
[ -d "$src" ] || { echo "split_wheel_part.sh: no $src here" >&2; exit 2; }
rm -rf "$src"a "$src"b && mkdir -p "$src"a "$src"b
total=$(du -cb "$src"/* | tail -1 | cut -f1)
half=$(( (total + 1) / 2 ))
filled=0
for f in "$src"/*; do
  name=$(basename "$f"); size=$(stat -c %s "$f")
  if [ $((filled + size)) -le "$half" ]; then
    cp "$f" "$src"a/; filled=$((filled + size))
  elif [[ "$name" == *.piece* ]] && [ "$filled" -lt "$half" ]; then
    # The piece that crosses the middle: its first bytes fill PARTa, the rest PARTb.
    head -c $((half - filled)) "$f" > "$src"a/"$name"
    tail -c +$((half - filled + 1)) "$f" > "$src"b/"$name"x
    filled=$half
  else
    cp "$f" "$src"b/
  fi
done
du -sb "$src"a "$src"b
