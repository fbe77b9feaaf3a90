"""GKD throughput against a plain training step of the student alone.

GKD adds the teacher's forward (and the per-layer cosine and chunked logit-KL terms) to every
step; a plain step trains the student on the LM loss only and never runs the teacher. Both
run through the same `mlx distill` loop, each in its own process, with the same global
batch, sequence length and steps; the report is the median tokens/s over the steps after
the first (which warms up), and their ratio.

    python bench/bench_gkd_speed.py --student runs/bench_quality/children/h100-1.5x/puzzle --steps 4
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


def run(mode: str, student: str, teacher: str, steps: int, batch: int, micro: int, seq_len: int,
        work: Path, extra: dict | None = None) -> dict:
    out = work / f"out-{mode}"
    settings = {"data.seq_len": seq_len, "optim.batch_sequences": batch, "optim.micro_batch_sequences": micro,
                "schedule.eval_every": 10 ** 6, "schedule.checkpoint_every": 10 ** 6, "data.held_out_sequences": 1}
    if mode == "plain":
        settings.update({"loss.cosine_weight": 0, "loss.kl_weight": 0, "loss.lm_weight": 1})
    settings.update(extra or {})
    command = [sys.executable, "-m", "mlxkit", "distill", "--gkd", "--teacher", teacher, "--student", student,
               "--data", str(SHARED / "wikitext2-valid.txt"), "--tokens", str(steps * batch * seq_len),
               "--out", str(out), "--quiet", *[f"--set={k}={v}" for k, v in settings.items()]]
    started = time.time()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    records = [json.loads(line) for line in (out / "distill_log.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]
    return {"mode": mode, "median_tokens_per_s": statistics.median(speeds), "steps_timed": len(speeds),
            "per_step_tokens_per_s": [round(s, 1) for s in speeds], "wall_s": round(time.time() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--student", default="smollm2-135m")
    parser.add_argument("--teacher", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        plain = run("plain", args.student, args.teacher, args.steps, args.batch, args.micro, args.seq_len, Path(tmp))
        gkd = run("gkd", args.student, args.teacher, args.steps, args.batch, args.micro, args.seq_len, Path(tmp))
    print(json.dumps({"student": args.student, "teacher": args.teacher, "batch": args.batch, "micro": args.micro,
                      "seq_len": args.seq_len, "plain": plain, "gkd": gkd,
                      "gkd_over_plain_throughput": gkd["median_tokens_per_s"] / plain["median_tokens_per_s"],
                      "load_average": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
