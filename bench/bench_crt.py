"""Continual robust training on scikit-learn's digits: does the logit regulariser keep old robustness?

Stages, each an `mlx finetune --recipe crt` child process:
  1. train an MLP on digits against L∞ (the packaged recipe, its ALR regulariser on);
  2. fine-tune that model for the new attack L2 (`--new-attack l2`, replaying L∞), twice:
     with the regulariser (`regularizer.kind=alr`) and without (`regularizer.kind=none`),
     same seed, budgets, steps and data order.
Every model is then evaluated on the held-out digits: clean accuracy, accuracy under each of
linf, l2, l1 and stadv (the recipe's budgets and evaluation steps), and union accuracy
(correct under every one of the four). l1 and stadv are never trained against: they show
how robustness carries over to unforeseen attacks.

Training-time overhead of the regulariser: the fine-tuning arms run back to back, `--repeats`
times in alternating order (none, alr, alr, none, ...), and the overhead is the ratio of their
training seconds (the timed optimiser steps; evaluation and checkpointing excluded) in each
pair. The runs are deterministic, so repeats also check that a rerun gives the same accuracy.

Needs the `bench` extra (scikit-learn, for its bundled digits data; nothing is downloaded).

    python bench/bench_crt.py --out runs/bench-crt
    python bench/bench_crt.py --out /tmp/crt-smoke --train-steps 20 --finetune-steps 10 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
EVAL_ATTACKS = ["linf", "l2", "l1", "stadv"]
MODEL = {"architecture": "mlp", "input_shape": [1, 8, 8], "num_classes": 10, "hidden": [256, 256]}


def write_digits(out: Path, test_fraction: float, seed: int) -> tuple[Path, Path]:
    """digits as [N, 1, 8, 8] in [0, 1] (pixel values are 0..16), split by a seeded permutation."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(round(test_fraction * len(y)))
    test, train = order[:cut], order[cut:]
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "train.npz", x=x[train], y=y[train])
    np.savez(out / "test.npz", x=x[test], y=y[test])
    return out / "train.npz", out / "test.npz"


def run_child(arguments: list[str], log: Path) -> dict:
    command = [sys.executable, "-m", "mlxkit", "finetune", "--recipe", "crt", *arguments, "--json", "--quiet",
               "--overwrite"]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log.with_suffix(".stdout"), "w") as stdout, open(log.with_suffix(".stderr"), "w") as stderr:
        code = subprocess.call(command, cwd=REPO, stdout=stdout, stderr=stderr)
    if code != 0:
        tail = log.with_suffix(".stderr").read_text()[-3000:]
        raise SystemExit(f"{' '.join(command)} failed (exit {code}):\n{tail}")
    return json.loads(log.with_suffix(".stdout").read_text())


def evaluate(model_dir: Path, test: Path, settings: list[str], seed: int) -> dict:
    """Clean, per-attack and union accuracy over all four attacks, with the recipe's evaluation steps."""
    import torch

    from mlxkit.cli._options import parse_overrides
    from mlxkit.engines.finetune.recipe import load_finetune_recipe
    from mlxkit.engines.robust.classifier import load_classifier
    from mlxkit.engines.robust.data import read_npz
    from mlxkit.engines.robust.evaluation import robustness_report
    from mlxkit.engines.robust.trainer import build_attacks

    torch.set_num_threads(1)
    recipe = load_finetune_recipe("crt").with_overrides(parse_overrides(settings))
    model = load_classifier(model_dir)
    data = read_npz(test, model.config.input_shape, model.config.num_classes, recipe.data.low, recipe.data.high)
    return robustness_report(model, data, build_attacks(recipe, EVAL_ATTACKS, for_eval=True), seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-crt")
    parser.add_argument("--train-steps", type=int, default=2000)
    parser.add_argument("--finetune-steps", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3, help="fine-tuning pairs run back to back for the timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-fraction", type=float, default=0.25)
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        help="recipe override for every stage, e.g. --set attacks.l2.budget=1.0")
    args = parser.parse_args()
    out = args.out.resolve()
    train, test = write_digits(out / "data", args.test_fraction, args.seed)
    (out / "mlp.json").write_text(json.dumps(MODEL))
    common = ["--data", str(train), "--eval-data", str(test), "--seed", str(args.seed),
              "--set", "schedule.eval_every=100000", *[f"--set={s}" for s in args.settings]]

    started = time.time()
    initial = run_child(["--model", str(out / "mlp.json"), "--attacks", "linf", "--steps", str(args.train_steps),
                         "--out", str(out / "linf"), *common], out / "logs" / "linf")
    print(f"initial L∞ training: {initial['train_seconds']} s", file=sys.stderr)

    arms: dict[str, list[dict]] = {"none": [], "alr": []}
    for repeat in range(args.repeats):
        for kind in (("none", "alr") if repeat % 2 == 0 else ("alr", "none")):
            summary = run_child(["--model", str(out / "linf"), "--new-attack", "l2", "--steps",
                                 str(args.finetune_steps), "--out", str(out / f"l2-{kind}-{repeat}"),
                                 "--set", f"regularizer.kind={kind}", *common], out / "logs" / f"l2-{kind}-{repeat}")
            arms[kind].append(summary)
            print(f"fine-tune l2, regulariser {kind}, repeat {repeat}: {summary['train_seconds']} s", file=sys.stderr)

    results = {"initial": evaluate(out / "linf", test, args.settings, args.seed)}
    for kind in arms:
        results[kind] = evaluate(out / f"l2-{kind}-0", test, args.settings, args.seed)
        for repeat in range(1, args.repeats):  # deterministic runs: a repeat must reproduce the first
            again = evaluate(out / f"l2-{kind}-{repeat}", test, args.settings, args.seed)
            if again != results[kind]:
                print(f"warning: repeat {repeat} of {kind} differs from repeat 0", file=sys.stderr)
    ratios = [alr["train_seconds"] / none["train_seconds"] for alr, none in zip(arms["alr"], arms["none"])]
    report = {"settings": vars(args) | {"out": str(out)}, "model": MODEL, "results": results,
              "train_seconds": {kind: [s["train_seconds"] for s in runs] for kind, runs in arms.items()},
              "initial_train_seconds": initial["train_seconds"], "overhead_ratios": ratios,
              "overhead_ratio_median": statistics.median(ratios), "attack_counts":
                  {kind: runs[0]["attack_counts"] for kind, runs in arms.items()},
              "bench_wall_s": round(time.time() - started, 1), "load_after": os.getloadavg()}
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")

    print("| model | clean | linf | l2 | l1 | stadv | union (all 4) | train s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = [("after L∞ training (ALR)", "initial", [initial["train_seconds"]]),
            ("fine-tuned for L2, no regulariser", "none", report["train_seconds"]["none"]),
            ("fine-tuned for L2, ALR", "alr", report["train_seconds"]["alr"])]
    for label, key, seconds in rows:
        r = results[key]
        cells = [f"{r['clean']:.3f}"] + [f"{r['attacks'][a]:.3f}" for a in EVAL_ATTACKS] + [f"{r['union']:.3f}"]
        print(f"| {label} | " + " | ".join(cells) + f" | {' / '.join(f'{s:.1f}' for s in seconds)} |")
    print(f"\nregulariser overhead (ALR / none, training seconds, per back-to-back pair): "
          f"{', '.join(f'{r:.2f}x' for r in ratios)}; median {report['overhead_ratio_median']:.2f}x")


if __name__ == "__main__":
    main()
