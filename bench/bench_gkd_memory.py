"""GKD's peak memory and speed at 135M: an older commit against the working tree, side by side.

Each run is `mlx distill --gkd` of a 135M student against the embedded SmolLM2-135M teacher on the
same text and batch, alone in a fresh process; its peak is `getrusage(RUSAGE_CHILDREN).ru_maxrss` of
a small wrapper, and its speed the median tokens/s the training log reports after the first step.
The working tree runs twice, as it is (the gkd recipe checkpoints) and with `gradient_checkpointing=false`;
`--mmap-thresholds` adds a run of the working tree per glibc mmap threshold (`MALLOC_MMAP_THRESHOLD_`, bytes),
compared with the working tree's default-allocator run, and each `--set KEY=VALUE` a run of the working tree
with that recipe setting.

    python bench/bench_gkd_memory.py --old 52d85a3 --student runs/demo/child --tokens 4096
    python bench/bench_gkd_memory.py --old 52d85a3 --student smollm2-135m --mmap-thresholds 1048576,4194304
    python bench/bench_gkd_memory.py --old 52d85a3 --student runs/demo/child --set optim.micro_batch_sequences=1

Run it alone on the machine: the speeds are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
PEAK = ("import resource, subprocess, sys\n"
        "code = subprocess.run(sys.argv[1:]).returncode\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)\n"
        "sys.exit(code)")


def old_package(commit: str, work: Path) -> Path:
    """The code at `commit` as an importable `mlxkit` tree (the repo maps cli/, engines/, ... into mlxkit.*)."""
    tree = work / "old-tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), commit], check=True)
    package = work / "oldpkg" / "mlxkit"
    package.mkdir(parents=True)
    for file in (tree / "mlxkit").glob("*.py"):
        (package / file.name).write_text(file.read_text())
    for folder in ("cli", "engines", "recipes", "hw_profiles"):
        (package / folder).symlink_to(tree / folder)
    return package.parent


def run(label: str, student: str, tokens: int, work: Path, pythonpath: Path | None,
        settings: dict[str, object], env_extra: dict[str, str] | None = None) -> dict:
    out = work / f"out-{label}"
    command = [sys.executable, "-c", PEAK, sys.executable, "-m", "mlxkit", "distill", "--gkd",
               "--teacher", "smollm2-135m", "--student", student, "--data", str(SHARED / "wikitext2-valid.txt"),
               "--tokens", str(tokens), "--out", str(out), "--quiet",
               *[f"--set={k}={v}" for k, v in settings.items()]]
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(env_extra or {}))
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    started = time.time()
    done = subprocess.run(command, cwd=work if pythonpath is not None else REPO, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"{label}: {done.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "distill_log.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
    return {"run": label, "peak_rss_mib": int(done.stdout.strip().splitlines()[-1]),
            "median_tokens_per_s": round(statistics.median(speeds), 1) if speeds else None,
            "wall_s": round(time.time() - started, 1), "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="the commit to compare with")
    parser.add_argument("--student", required=True, help="a 135M student sharing SmolLM2's tokenizer")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--mmap-thresholds", default="", help="comma-separated MALLOC_MMAP_THRESHOLD_ values (bytes)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="a further run of the working tree with this recipe setting (repeatable)")
    args = parser.parse_args()
    student = str(Path(args.student).resolve()) if Path(args.student).exists() else args.student
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        try:
            rows = [run("old", student, args.tokens, work, old_package(args.old, work), {}),
                    run("new", student, args.tokens, work, None, {}),
                    run("new, checkpointing off", student, args.tokens, work, None,
                        {"gradient_checkpointing": "false"})]
            for threshold in filter(None, args.mmap_thresholds.split(",")):
                rows.append(run(f"new, MALLOC_MMAP_THRESHOLD_={threshold}", student, args.tokens, work, None, {},
                                {"MALLOC_MMAP_THRESHOLD_": threshold}))
            for setting in args.settings:
                key, _, value = setting.partition("=")
                rows.append(run(f"new, {setting}", student, args.tokens, work, None, {key: value}))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(work / "old-tree")],
                           capture_output=True)
    for row in rows:
        for base, suffix in ((rows[0], "old"), (rows[1], "now")):
            row[f"peak_vs_{suffix}"] = round(row["peak_rss_mib"] / base["peak_rss_mib"], 2)
            if row["median_tokens_per_s"] and base["median_tokens_per_s"]:
                row[f"speed_vs_{suffix}"] = round(row["median_tokens_per_s"] / base["median_tokens_per_s"], 2)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
