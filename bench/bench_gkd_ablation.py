"""Which GKD recipe teaches a Puzzle child most per token: an ablation at one token budget.

The children are the quality benchmark's Puzzle children (its block library and calibration
text, shared under --work). Every variant is its own `mlx distill --gkd` run from the same
undistilled child, on the same text (wikitext-2 validation) and the same token budget, then
`mlx eval` on the first 8,192 tokens of wikitext-2 test against the parent.

A variant is a `+`-joined list of atoms, each a set of recipe overrides on the shipped `gkd`
recipe (`kl-only+lr1e-3` = no cosine term, peak learning rate 1e-3). `plain-kd` is the
reference the recipe has to beat: an independent ~40-line logit-KD loop (KL only, AdamW,
lr 2e-4 with cosine decay, 4 random 256-token windows a step) that shares no code with the
trainer but model loading and saving.

    python bench/bench_gkd_ablation.py --child h100-1.5x --tokens 32768 \\
        --variants plain-kd,shipped,kl-only,lr3e-4,lr1e-3,t2,freeze,batch2,cosine-summed
    python bench/bench_gkd_ablation.py --child h100-1.5x --tokens 32768 --report

Resumable: each variant's child and evaluation are kept under --work/ablation/.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_puzzle_quality as quality  # noqa: E402  (the quality benchmark's stages)

DATA = quality.SHARED / "wikitext2-valid.txt"
ATOMS: dict[str, list[str]] = {
    "shipped": [],
    "kl-only": ["loss.cosine_weight=0"],
    # The shipped loss already averages the cosine term over layers; this is the summed form.
    "cosine-summed": ["loss.cosine_weight=30"],
    "lr1e-4": ["optim.lr=1e-4"],  # the shipped recipe's rate before this benchmark
    "lr3e-4": ["optim.lr=3e-4"],
    "lr1e-3": ["optim.lr=1e-3"],
    "t2": ["loss.temperature=2"],
    "freeze": ["trainable=replaced_blocks"],
    # Training blocks from the budget's first tokens of the text only (how GKD read --data before).
    "narrow": ["data.corpus_tokens=0"],
    # Twice the optimiser steps for the same tokens: 2 sequences of 512 a step instead of 4.
    "batch2": ["optim.batch_sequences=2", "optim.micro_batch_sequences=1"],
}
# The run's own held-out log is small; the reported numbers come from `mlx eval`.
COMMON = ["--set", "data.held_out_sequences=2", "--set", "schedule.eval_every=1000"]


def overrides(variant: str) -> list[str]:
    out: list[str] = []
    for atom in variant.split("+"):
        if atom not in ATOMS:
            raise SystemExit(f"unknown atom '{atom}' (known: {', '.join(ATOMS)}, plain-kd)")
        for setting in ATOMS[atom]:
            out += ["--set", setting]
    return out


def plain_kd(teacher_spec: str, student_dir: Path, out: Path, tokens: int, seed: int = 0) -> dict:
    """The reference loop: KL(teacher || student) on random 256-token windows, 4 a step."""
    import torch
    import torch.nn.functional as F

    from mlxkit.engines.core.manifest import Manifest
    from mlxkit.engines.models.loading import load_model
    from mlxkit.engines.models.saving import save_model

    torch.manual_seed(seed)
    teacher = load_model(teacher_spec).model.eval().requires_grad_(False)
    loaded = load_model(str(student_dir))
    student = loaded.model.train()
    ids = loaded.tokenizer(DATA.read_text(encoding="utf-8"), return_tensors="pt").input_ids[0]
    window, batch = 256, 4
    steps = math.ceil(tokens / (window * batch))
    optimizer = torch.optim.AdamW(student.parameters(), lr=2e-4, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    started = time.time()
    for step in range(steps):
        starts = torch.randint(0, ids.numel() - window, (batch,))
        x = torch.stack([ids[s:s + window] for s in starts.tolist()])
        with torch.no_grad():
            target = F.log_softmax(teacher(x).logits.float(), -1)
        log_q = F.log_softmax(student(x).logits.float(), -1)
        loss = F.kl_div(log_q, target, log_target=True, reduction="batchmean") / window
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        quality.log(f"  plain-kd step {step + 1}/{steps}: KL {loss.item():.4f}")
    seconds = time.time() - started
    manifest = Manifest(verb="bench")
    manifest.results = {"method": "plain-kd", "steps": steps, "lr": 2e-4, "window": window, "batch": batch}
    save_model(student.eval(), loaded.tokenizer, out, manifest, overwrite=True)
    return {"steps": steps, "tokens": steps * window * batch, "_stage_seconds": round(seconds, 1),
            "median_tokens_per_s": round(steps * window * batch / seconds, 1)}


def run_variant(work: Path, child: str, variant: str, tokens: int) -> tuple[Path, dict]:
    student = work / "children" / child / "puzzle"
    base = work / "ablation" / child / f"{variant}-{tokens}"
    record = base.with_suffix(".json")
    if variant == "plain-kd":
        make = lambda: plain_kd(quality.PARENT, student, base, tokens)  # noqa: E731
    else:
        make = lambda: quality.run_json(  # noqa: E731
            ["distill", "--gkd", "--teacher", quality.PARENT, "--student", str(student), "--data", str(DATA),
             "--tokens", str(tokens), "--out", str(base), *COMMON, *overrides(variant)],
            work / "logs" / f"ablation-{child}-{variant}-{tokens}.log")
    return base, quality.cached(record, make)


def report(work: Path, child: str, tokens: list[int]) -> str:
    parent = json.loads((work / "evals" / "parent.json").read_text())
    start = json.loads((work / "evals" / f"{child}-puzzle.json").read_text())
    lines = [f"Child {child}: perplexity {start['perplexity']:.2f} before GKD; parent {parent['perplexity']:.2f} "
             f"({parent['tokens']} tokens of wikitext-2 test).\n",
             "| variant | GKD tokens | steps | wall (s) | tokens/s | ppl | ppl / parent | KL to parent | top-1 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for record in sorted((work / "ablation" / child).glob("*.json")):
        variant, _, budget = record.stem.rpartition("-")
        if int(budget) not in tokens:
            continue
        evaluation = work / "evals" / f"ablation-{child}-{record.stem}.json"
        if not evaluation.exists():
            continue
        e, r = json.loads(evaluation.read_text()), json.loads(record.read_text())
        rows.append((e["perplexity"], f"| {variant} | {int(budget):,} | {r.get('steps')} | "
                                      f"{r.get('_stage_seconds', 0):.0f} | {r.get('median_tokens_per_s') or 0:.1f} | "
                                      f"{e['perplexity']:.2f} | {e['perplexity'] / parent['perplexity']:.3f} | "
                                      f"{e['kl_div']:.4f} | {e['top1_agreement']:.3f} |"))
    lines += [line for _, line in sorted(rows)]
    text = "\n".join(lines)
    (work / f"report-gkd-ablation-{child}.md").write_text(text + "\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=quality.REPO / "runs" / "bench_quality")
    parser.add_argument("--child", default="h100-1.5x", help="target-throughput of a quality-benchmark child")
    parser.add_argument("--tokens", default="32768", help="GKD token budgets, comma-separated")
    parser.add_argument("--variants", default="plain-kd,shipped,kl-only,lr3e-4,lr1e-3,t2,freeze,batch2,cosine-summed")
    parser.add_argument("--report", action="store_true", help="only print the table from what is done")
    args = parser.parse_args()
    work = args.work.resolve()
    budgets = [int(t) for t in args.tokens.split(",")]
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if not args.report:
        target, throughput = args.child.split("-")
        quality.prepare(work)
        quality.build_child(work, target, throughput, "puzzle")
        quality.evaluate(work, str(work / "children" / args.child / "puzzle"), f"{args.child}-puzzle")
        for tokens in budgets:
            for variant in args.variants.split(","):
                quality.log(f"stage: {args.child} GKD ablation: {variant} on {tokens} tokens")
                out, info = run_variant(work, args.child, variant, tokens)
                quality.log(f"  {info.get('_stage_seconds')} s, median {info.get('median_tokens_per_s')} tokens/s")
                quality.evaluate(work, str(out), f"ablation-{args.child}-{variant}-{tokens}")
                print(report(work, args.child, budgets), flush=True)
    print(report(work, args.child, budgets))


if __name__ == "__main__":
    main()
