"""Does in-context refinement make the MIP's estimate hold, and does it pick a better child?

On copies of the quality benchmark's block library (so its own children are untouched):

0. `isolated`: at every target, `mlx search --refine 0` on a copy that is never refined: the
   first solve on replace-1-block scores, as the search was before refinement.
1. `refined`: `mlx search --refine 3` at each target in --refine-targets, each on its own copy
   of the library, where it leaves its corrections.
2. `corrected-from-R`: at each target in --predict-targets, a search on refined target R's copy
   with `--refine 0`: one solve with R's corrections, no new measurement. Its corrected
   prediction is out of sample: none of the measurements behind the corrections was of this child.
3. Every child is evaluated on wikitext-2 test (`mlx eval`, as the quality benchmark does),
   and measured on the library's held-out calibration tokens by the search itself.

    python bench/bench_refinement.py --work runs/bench_quality \\
        --refine-targets h100:1.5x,cpu:1.5x --predict-targets h100:1.2x,h100:2x
    python bench/bench_refinement.py --work runs/bench_quality --report
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_puzzle_quality as quality  # noqa: E402  (the quality benchmark's stages)


def library_copy(work: Path, name: str) -> Path:
    """Hard links of the library's blocks, scores and index, and its held-out tokens (no activations)."""
    source, copy = work / "library", work / name
    if not copy.exists():
        tmp = copy.with_name(copy.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / ".work").mkdir(parents=True)
        for name in ("blocks", "scores"):
            subprocess.run(["cp", "-al", str(source / name), str(tmp / name)], check=True)
        for name in ("library.json", "mlxkit.json"):
            shutil.copy2(source / name, tmp / name)
        shutil.copy2(source / ".work" / "tokens.pt", tmp / ".work" / "tokens.pt")
        tmp.rename(copy)
    return copy


def search(work: Path, library: Path, target: str, throughput: str, label: str, refine: int) -> tuple[Path, dict]:
    name = f"{target}-{throughput}"
    out = work / "children" / name / label
    record = work / "children" / name / f"{label}.json"
    return out, quality.cached(record, lambda: quality.run_json(
        ["search", "--library", str(library), "--target", target, "--throughput", throughput,
         "--refine", str(refine), "--out", str(out), "--overwrite"], work / "logs" / f"search-{name}-{label}.log"))


def report(work: Path) -> str:
    parent = json.loads((work / "evals" / "parent.json").read_text())
    lines = [f"Parent perplexity {parent['perplexity']:.2f} on wikitext-2 test ({parent['tokens']} tokens).\n",
             "| target | child | predicted speedup | Σ isolated KL | corrected prediction | measured KL (held-out "
             "calibration) | KL on wikitext-2 test | ppl on wikitext-2 test | refinement rounds (measured KL) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for record in sorted((work / "children").glob("*/*.json")):
        name, label = record.parent.name, record.stem
        if not label.startswith(("isolated", "refined", "corrected")):
            continue
        info = json.loads(record.read_text())
        evaluation = work / "evals" / f"{name}-{label}.json"
        test = json.loads(evaluation.read_text()) if evaluation.exists() else {}
        isolated, speedup = info.get("objective_isolated"), info["predicted"]["speedup"]
        corrected = info.get("estimate_corrected")
        measured = info.get("evaluation", {}).get("kl_div")
        refinement, rounds = info.get("refinement"), ""
        if refinement:
            rounds = ", ".join(f"{r['measured']:.3f}" + ("*" if k == refinement["best_round"] else "")
                               for k, r in enumerate(refinement["rounds"]))
            # The kept child's prediction as made before it was measured (the isolated sum when round 1 had
            # no corrections to start from).
            corrected = refinement["rounds"][refinement["best_round"]]["predicted_corrected"]

        def num(value, digits=4):
            return "–" if value is None else f"{value:.{digits}f}"
        lines.append(f"| {name} | {label} | {num(speedup, 3)} | {num(isolated)} | "
                     f"{num(corrected)} | {num(measured)} | {num(test.get('kl_div'))} | "
                     f"{num(test.get('perplexity'), 2)} | {rounds} |")
    text = "\n".join(lines)
    (work / "report-refinement.md").write_text(text + "\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=quality.REPO / "runs" / "bench_quality")
    parser.add_argument("--refine-targets", default="h100:1.5x,cpu:1.5x")
    parser.add_argument("--predict-targets", default="h100:1.2x,h100:2x")
    parser.add_argument("--report", action="store_true", help="only print the table from what is done")
    args = parser.parse_args()
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if not args.report:
        quality.prepare(work)
        plain = library_copy(work, "library-isolated")
        refine_targets = args.refine_targets.split(",")
        predict_targets = args.predict_targets.split(",")
        for spec in refine_targets + predict_targets:
            target, throughput = spec.split(":")
            quality.log(f"stage: {target}-{throughput} isolated")
            out, _ = search(work, plain, target, throughput, "isolated", 0)
            quality.evaluate(work, str(out), f"{target}-{throughput}-isolated")
        for source in refine_targets:
            target, throughput = source.split(":")
            refined = library_copy(work, f"library-refined-{target}-{throughput}")
            quality.log(f"stage: {target}-{throughput} refined")
            out, _ = search(work, refined, target, throughput, "refined", 3)
            quality.evaluate(work, str(out), f"{target}-{throughput}-refined")
            for spec in predict_targets:
                p_target, p_throughput = spec.split(":")
                label = f"corrected-from-{target}-{throughput}"
                quality.log(f"stage: {p_target}-{p_throughput} {label}")
                out, _ = search(work, refined, p_target, p_throughput, label, 0)
                quality.evaluate(work, str(out), f"{p_target}-{p_throughput}-{label}")
    print(report(work))


if __name__ == "__main__":
    main()
