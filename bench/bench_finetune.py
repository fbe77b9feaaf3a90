"""H-Tuning against LoRA and full fine-tuning on SmolLM2-135M: memory, time per step, held-out loss.

Each recipe (`mlx finetune --recipe lora|htuning|full`) trains the causal-LM objective on
wikitext-2 validation text in its own process, with the same global batch, sequence length,
micro-batch (= the batch: no gradient accumulation, so activation memory shows) and steps.
The held-out loss is measured on the first sequences of wikitext-2 test (`--eval-data`).

Reported per recipe, and as ratios to LoRA:
  * peak RSS of the child process (`os.wait4`'s ru_maxrss: the child alone, load and save included);
  * median seconds per optimiser step (evaluation and checkpointing are outside the timed step);
  * held-out loss after the same number of steps;
  * held-out loss after the same training time: the latest evaluation whose cumulative step
    time is within the shortest recipe's total (so resolution is `--eval-every` steps).

Resumable stage by stage: each finished recipe leaves OUT/results/<recipe>.json and is skipped on
a rerun with the same settings; an interrupted recipe resumes from its `mlx finetune` checkpoint.

    python bench/bench_finetune.py                          # 60 steps of 8 x 256 tokens each
    python bench/bench_finetune.py --steps 2 --batch 2 --seq-len 128 --eval-every 1 --held-out 2   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
RECIPES = ("lora", "htuning", "full")


def run_recipe(recipe: str, args: argparse.Namespace, out: Path) -> dict:
    """One `mlx finetune` child; returns its summary plus the child's peak RSS."""
    settings = {"data.seq_len": args.seq_len, "optim.micro_batch_sequences": args.batch,
                "data.held_out_sequences": args.held_out, "schedule.eval_every": args.eval_every}
    command = [sys.executable, "-m", "mlxkit", "finetune", "--recipe", recipe, "--model", args.model,
               "--data", str(args.data), "--eval-data", str(args.eval_data), "--steps", str(args.steps),
               "--batch", str(args.batch), "--out", str(out / recipe), "--overwrite", "--json", "--quiet",
               *[f"--set={k}={v}" for k, v in settings.items()]]
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(logs / f"{recipe}.stdout", "w") as stdout, open(logs / f"{recipe}.stderr", "w") as stderr:
        child = subprocess.Popen(command, cwd=REPO, stdout=stdout, stderr=stderr)
        _, status, usage = os.wait4(child.pid, 0)  # the rusage of this child alone
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{recipe} failed (exit {child.returncode}):\n"
                         + (logs / f"{recipe}.stderr").read_text()[-3000:])
    summary = json.loads((logs / f"{recipe}.stdout").read_text())
    peak = usage.ru_maxrss / (1 << 20) if sys.platform == "darwin" else usage.ru_maxrss / 1024
    return {**summary, "child_peak_rss_mib": round(peak, 1), "child_wall_s": round(time.time() - started, 1)}


def stage(recipe: str, args: argparse.Namespace, key: dict) -> dict:
    """The recipe's result: read back when an earlier invocation finished it with the same settings."""
    path = args.out / "results" / f"{recipe}.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved
        # other settings: start this recipe over (its output and unfinished work are of the old settings)
        shutil.rmtree(args.out / recipe, ignore_errors=True)
        shutil.rmtree(args.out / f".{recipe}.finetune-work", ignore_errors=True)
    summary = run_recipe(recipe, args, args.out)
    log = [json.loads(line) for line in (Path(summary["out"]) / "finetune_log.jsonl").read_text().splitlines()]
    step_s = [r["step_s"] for r in log if "step_s" in r]
    result = {"key": key, "recipe": recipe, "trainable_parameters": summary["trainable_parameters"],
              "peak_rss_mib": summary["child_peak_rss_mib"],
              "median_step_s": statistics.median(step_s[1:] or step_s),  # the first step warms up
              "train_s": summary["train_seconds"], "loss_before": summary["before"]["loss"],
              "loss_after": summary["after"]["loss"],
              # the evaluation before the first step comes after no training
              "evals": [{"step": r["step"], "train_s": r.get("train_s", 0.0), "loss": r["eval"]["loss"]}
                        for r in log if "eval" in r]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def loss_at_time(result: dict, seconds: float) -> dict:
    """The latest evaluation reached within `seconds` of training."""
    return [e for e in result["evals"] if e["train_s"] <= seconds + 1e-9][-1]


def markdown(results: dict[str, dict], args: argparse.Namespace) -> str:
    base = results.get("lora")
    common = min(r["train_s"] for r in results.values())

    def ratio(value: float, of: str) -> str:
        return f"{value / base[of]:.2f}x" if base and base[of] else "-"

    lines = [f"SmolLM2-135M ({args.model}), causal LM on wikitext-2 valid; held-out: first {args.held_out} x "
             f"{args.seq_len} tokens of wikitext-2 test; batch {args.batch} x {args.seq_len} tokens, {args.steps} "
             f"steps; same-time column at {common:.1f} s of training (the shortest recipe's total)", "",
             "| recipe | trainable params | peak RSS (MiB) | RSS vs LoRA | s/step | time vs LoRA | "
             f"held-out loss @{args.steps} steps | held-out loss @{common:.0f} s (step) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        at = loss_at_time(r, common)
        lines.append(f"| {name} | {r['trainable_parameters']:,} | {r['peak_rss_mib']:.0f} | "
                     f"{ratio(r['peak_rss_mib'], 'peak_rss_mib')} | {r['median_step_s']:.2f} | "
                     f"{ratio(r['median_step_s'], 'median_step_s')} | {r['loss_after']:.4f} "
                     f"(from {r['loss_before']:.4f}) | {at['loss']:.4f} ({at['step']}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", type=Path, default=SHARED / "wikitext2-valid.txt")
    parser.add_argument("--eval-data", type=Path, default=SHARED / "wikitext2-test.txt")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--held-out", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_finetune")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    key = {k: str(v) for k, v in vars(args).items() if k not in ("recipes", "out")}
    results = {name: stage(name, args, key) for name in args.recipes.split(",")}
    table = markdown(results, args)
    (args.out / "summary.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
