"""How much global distillation buys: one Puzzle child, GKD at several token budgets.

The child is the default `mlx search` target (h100, 1.5x) on the Puzzle quality benchmark's
block library and calibration text (the same stages, shared under --work). Each budget is a
separate GKD run from the same undistilled child with the shipped recipe (its cosine learning
rate schedule spans the whole budget), then `mlx eval` on the first 8,192 tokens of wikitext-2
test against the parent. Resumable: every stage's output is kept under --work.

    python bench/bench_gkd_budget.py --work runs/bench_quality --budgets 8192,32768,65536
    python bench/bench_gkd_budget.py --work runs/bench_quality --report
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_puzzle_quality as quality  # noqa: E402  (the quality benchmark's stages)


def budget_suffix(tokens: int) -> str:
    return f"-gkd{tokens}"


def report(work: Path, name: str, budgets: list[int]) -> str:
    parent = json.loads((work / "evals" / "parent.json").read_text())
    rows = [(0, json.loads((work / "evals" / f"{name}-puzzle.json").read_text()), None)]
    for tokens in budgets:
        evaluation = work / "evals" / f"{name}-puzzle{budget_suffix(tokens)}.json"
        record = work / "children" / name / f"puzzle{budget_suffix(tokens)}.json"
        if evaluation.exists() and record.exists():
            rows.append((tokens, json.loads(evaluation.read_text()), json.loads(record.read_text())))
    lines = [f"Parent perplexity {parent['perplexity']:.2f} ({parent['tokens']} tokens of wikitext-2 test).\n",
             "| GKD tokens | steps | GKD wall time (s) | ppl | ppl / parent | KL to parent | top-1 agreement |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for tokens, evaluation, gkd in rows:
        steps = gkd["steps"] if gkd else 0
        seconds = f"{gkd['_stage_seconds']:.0f}" if gkd else "–"
        lines.append(f"| {tokens:,} | {steps} | {seconds} | {evaluation['perplexity']:.2f} | "
                     f"{evaluation['perplexity'] / parent['perplexity']:.3f} | {evaluation['kl_div']:.4f} | "
                     f"{evaluation['top1_agreement']:.3f} |")
    text = "\n".join(lines)
    (work / f"report-gkd-budget-{name}.md").write_text(text + "\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=quality.REPO / "runs" / "bench_quality")
    parser.add_argument("--target", default="h100:1.5x")
    parser.add_argument("--budgets", default="8192,32768,65536", help="GKD token budgets, comma-separated")
    parser.add_argument("--report", action="store_true", help="only print the table from what is done")
    args = parser.parse_args()
    work = args.work.resolve()
    target, throughput = args.target.split(":")
    name = f"{target}-{throughput}"
    budgets = [int(b) for b in args.budgets.split(",")]
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if not args.report:
        calibration = quality.prepare(work)
        child, _ = quality.build_child(work, target, throughput, "puzzle")
        quality.evaluate(work, str(child), f"{name}-puzzle")
        for tokens in budgets:
            quality.log(f"stage: {name} puzzle: GKD on {tokens} tokens")
            distilled, gkd = quality.distil(work, child, tokens, calibration, budget_suffix(tokens))
            quality.log(f"  GKD {gkd.get('_stage_seconds')} s, median {gkd.get('median_tokens_per_s')} tokens/s")
            quality.evaluate(work, str(distilled), f"{name}-puzzle{budget_suffix(tokens)}")
    print(report(work, name, budgets))


if __name__ == "__main__":
    main()
