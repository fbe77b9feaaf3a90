#!/usr/bin/env bash
# `make demo`'s command with an empty cache (the converted model copied in), for the code at an older
# commit and for the working tree, one after the other: wall time, each stage's time (the progress
# lines' "done in"), peak RSS of the whole run, and the chosen child with its held-out KL.
# Run alone on the machine.
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
# Runs a command and prints its peak RSS (the largest of it and its children) in MiB on the last line.
PEAK='import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
sys.exit(code)'
for which in old new; do
  cache="$WORK/cache-$which"; mkdir -p "$cache"
  cp -r "${MLXKIT_CACHE:-$HOME/.cache/mlxkit}/models" "$cache/"
  start=$(date +%s.%N)
  if [ "$which" = old ]; then
    (cd "$WORK" && MLXKIT_CACHE=$cache PYTHONPATH=$WORK/oldpkg "$REPO/.venv/bin/python" -c "$PEAK" \
      "$REPO/.venv/bin/python" -m mlxkit search --target h100 --out "$WORK/child-old" --overwrite \
      --gkd-tokens 4096 > "$WORK/demo-old.log" 2>&1)
  else
    (cd "$REPO" && MLXKIT_CACHE=$cache .venv/bin/python -c "$PEAK" .venv/bin/mlx search --target h100 \
      --out "$WORK/child-new" --overwrite --gkd-tokens 4096 > "$WORK/demo-new.log" 2>&1)
  fi
  end=$(date +%s.%N)
  echo "$which: $(echo "$end - $start" | bc) s, peak RSS $(tail -n 1 "$WORK/demo-$which.log") MiB," \
    "load $(cut -d' ' -f1-3 /proc/loadavg)"
done
"$REPO/.venv/bin/python" "$REPO/bench/demo_stages.py" "$WORK/demo-old.log" "$WORK/demo-new.log" \
  "$WORK/child-old" "$WORK/child-new"
