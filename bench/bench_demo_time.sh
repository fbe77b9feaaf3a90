#!/usr/bin/env bash
# Wall time of `make demo`'s command with an empty cache (the converted model copied in), for the code
# at an older commit and for the working tree, one after the other. Run alone on the machine.
#   bash bench/bench_demo_time.sh c7aa067
set -euo pipefail
OLD=${1:?usage: bench/bench_demo_time.sh OLD_COMMIT}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
git -C "$REPO" worktree add -q --detach "$WORK/old-tree" "$OLD"
trap 'git -C "$REPO" worktree remove --force "$WORK/old-tree"; rm -rf "$WORK"' EXIT
# The old code as an importable `mlxkit` package tree (the repo maps cli/, engines/, ... into mlxkit.*).
mkdir -p "$WORK/oldpkg/mlxkit"
cp "$WORK"/old-tree/mlxkit/*.py "$WORK/oldpkg/mlxkit/"
for d in cli engines recipes hw_profiles; do ln -s "$WORK/old-tree/$d" "$WORK/oldpkg/mlxkit/$d"; done
for which in old new; do
  cache="$WORK/cache-$which"; mkdir -p "$cache"
  cp -r "${MLXKIT_CACHE:-$HOME/.cache/mlxkit}/models" "$cache/"
  start=$(date +%s.%N)
  if [ "$which" = old ]; then
    (cd "$WORK" && MLXKIT_CACHE=$cache PYTHONPATH=$WORK/oldpkg "$REPO/.venv/bin/python" -m mlxkit search \
      --target h100 --out "$WORK/child-old" --overwrite --gkd-tokens 4096 > "$WORK/demo-old.log" 2>&1)
  else
    (cd "$REPO" && MLXKIT_CACHE=$cache .venv/bin/mlx search --target h100 --out "$WORK/child-new" --overwrite \
      --gkd-tokens 4096 > "$WORK/demo-new.log" 2>&1)
  fi
  end=$(date +%s.%N)
  echo "$which: $(echo "$end - $start" | bc) s, load $(cut -d' ' -f1-3 /proc/loadavg)"
done
