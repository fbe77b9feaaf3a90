#!/usr/bin/env bash
# Prepare, with the network, everything the GPU check needs on a lent machine that has none, into one
# ignored folder inside the tree (only the working tree travels there, 64 MiB in all):
#   .device/wheels/     the runtime dependencies the machine's image lacks or holds too old
#                       (bench/device/carry.txt), for CPython 3.12 on manylinux x86_64, and mlxkit itself;
#   .device/data/       the held-out text (wikitext-2 valid and test);
#   .device/tokenizer/  the embedded default parent's tokenizer (its 98 MB of weights cannot travel, and
#                       the check builds random-weight models from bench/device/shapes/ instead).
# Then it checks that the folder, with the rest of the tree, fits the limit with room to spare.
#
#   bash scripts/prepare_device.sh        (make gpu-prepare)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.device}
PYTHON=${PYTHON:-python3}
DATA_DIR=${DATA_DIR:-../shared/data}
[ -d "$DATA_DIR" ] || [ ! -d shared/data ] || DATA_DIR=shared/data  # a checkout may hold shared/ inside
TOKENIZER_FROM=${TOKENIZER_FROM:-$HOME/.cache/mlxkit/models/smollm2-135m}
LIMIT_MIB=64
ROOM_MIB=8   # kept free under the limit for the tree's own growth and the files a session adds

rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp/wheels" "$DEST.tmp/data" "$DEST.tmp/tokenizer"
mapfile -t WANTED < <(grep -Ev '^\s*(#|$)' bench/device/carry.txt)
# --platform is matched exactly, so every manylinux tag a wheel may carry is named.
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST.tmp/wheels" "${WANTED[@]}"
"$PYTHON" -m pip wheel -q --no-deps -w "$DEST.tmp/wheels" .

for name in wikitext2-valid.txt wikitext2-test.txt; do
  [ -f "$DATA_DIR/$name" ] || { echo "error: $DATA_DIR/$name is missing (set DATA_DIR)" >&2; exit 1; }
  cp "$DATA_DIR/$name" "$DEST.tmp/data/"
done
if [ ! -f "$TOKENIZER_FROM/tokenizer.json" ]; then
  [ -x .venv/bin/mlx ] || { echo "error: no tokenizer at $TOKENIZER_FROM; run 'make setup' first" >&2; exit 1; }
  .venv/bin/mlx fetch smollm2-135m >&2
fi
cp "$TOKENIZER_FROM"/tokenizer.json "$TOKENIZER_FROM"/tokenizer_config.json "$DEST.tmp/tokenizer/"
[ ! -f "$TOKENIZER_FROM/chat_template.jinja" ] || cp "$TOKENIZER_FROM/chat_template.jinja" "$DEST.tmp/tokenizer/"

rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
# What travels: tracked files, untracked files git does not ignore, and the carried folder.
tree_bytes=$( { git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null || true; } \
  | awk '{s += $1} END {print s + 0}')
folder_bytes=$(du -sb "$DEST" | cut -f1)
total_mib=$(( (tree_bytes + folder_bytes) / 1048576 ))
echo "prepared $DEST: $(ls "$DEST/wheels" | wc -l) wheels, $((folder_bytes / 1048576)) MiB; with the tree $total_mib MiB of $LIMIT_MIB" >&2
if (( total_mib > LIMIT_MIB - ROOM_MIB )); then
  echo "error: $DEST and the tree come to $total_mib MiB, over $((LIMIT_MIB - ROOM_MIB)) MiB ($LIMIT_MIB less $ROOM_MIB of room)" >&2
  exit 1
fi
