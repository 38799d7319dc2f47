#!/usr/bin/env bash
# Split a wheel part of .gpu-wheels (../shared/gpu/prepare-wheels.sh) in two halves,
# PARTa and PARTb, for when the part and the working tree together pass the device
# tool's 64 MiB a call: files fill PARTa up to half the part, the rest go to PARTb, and
# the wheel or wheel piece that crosses the middle is cut, its second half named
# <piece>x, which install-on-device.sh's `cat "$base".piece*` reads back in order
# (piece00 < piece00x < piece01; a whole wheel becomes <wheel>.piece00 and .piece00x). Copy both halves (`device.sh copy PARTa`, then PARTb)
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
  elif [ "$filled" -lt "$half" ] && [[ "$name" == *.piece* || "$name" == *.whl ]]; then
    # The file that crosses the middle: its first bytes fill PARTa, the rest PARTb. A
    # whole wheel becomes pieces 00 and 00x, which install-on-device.sh joins like any.
    first=$name; [[ "$name" == *.piece* ]] || first=$name.piece00
    head -c $((half - filled)) "$f" > "$src"a/"$first"
    tail -c +$((half - filled + 1)) "$f" > "$src"b/"$first"x
    filled=$half
  else
    cp "$f" "$src"b/
  fi
done
du -sb "$src"a "$src"b
# A file neither a wheel nor a piece that crossed the middle went to PARTb uncut.
for half_dir in "$src"a "$src"b; do
  size=$(du -sb "$half_dir" | cut -f1)
  if [ "$size" -gt $((total * 3 / 4)) ]; then
    echo "split_wheel_part.sh: $half_dir holds $size of $total bytes: a large file in it was not cut" >&2
    exit 2
  fi
done
