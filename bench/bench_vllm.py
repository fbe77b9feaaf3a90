"""Benchmark: Puzzle children served by vLLM's CPU build, measured against mlxkit's predicted speed-up.

Stages, each kept in --work and skipped when its output is there (rerun to resume; delete a
stage's file to redo it):
  1. profile   `mlx calibrate --engine vllm` on the parent: this CPU as vLLM runs it (cpu-vllm.yaml).
  2. children  `mlx search --target cpu-vllm.yaml --throughput T` for each T (the profile's engine is
               vllm, so only blocks vLLM builds are searched); one block library serves all of them.
  3. export    parent and children to the Nemotron-NAS layout (`mlx export --format nemotron-nas`).
  4. timing    each export in vLLM: --repeats requests of --prompt tokens then --gen new tokens,
               batch 1 (the profile's default scenario), median wall time; tokens/s = gen / time.
  5. agreement vLLM's greedy continuations of --prompts real-text prompts, scored again under
               torch (mlxkit's model class on the same checkpoint): top-1 agreement, max log-prob gap.

    .venv/bin/python bench/bench_vllm.py [--model smollm2-135m] [--data ../shared/data/wikitext2-valid.txt] \\
        [--targets 1.3x,1.5x,2x] [--work runs/bench-vllm] [--json bench/results/vllm.json]

Needs vLLM's CPU build (scripts/setup_vllm.sh). Timings are wall-clock: run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MLX = [sys.executable, "-m", "mlxkit"]


def _run(args: list[str], what: str) -> dict:
    print(f"[bench_vllm] {what}: {' '.join(args)}", file=sys.stderr, flush=True)
    done = subprocess.run(MLX + args + ["--json"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed: {done.stdout.strip()[-2000:]} {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def _stage(path: Path, build) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    result = build()
    path.write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "wikitext2-valid.txt"))
    parser.add_argument("--targets", default="1.3x,1.5x,2x")
    parser.add_argument("--work", default=str(REPO / "runs" / "bench-vllm"))
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--agreement-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    targets = [t.strip() for t in args.targets.split(",")]

    profile = work / "cpu-vllm.yaml"
    _stage(work / "1-profile.json", lambda: _run(
        ["calibrate", "--model", args.model, "--engine", "vllm", "--batch", "1", "--seq", "32,128",
         "--out", str(profile), "--overwrite"], "profile"))

    def search(target: str) -> dict:
        return _run(["search", "--model", args.model, "--target", str(profile), "--throughput", target,
                     "--data", args.data, "--refine", "0", "--out", str(work / f"child-{target}"), "--overwrite"],
                    f"child {target}")

    children = _stage(work / "2-children.json", lambda: {t: search(t) for t in targets})

    def export_all() -> dict:
        out = {"parent": str(work / "nas-parent")}
        _run(["export", args.model, "--format", "nemotron-nas", "--out", out["parent"], "--overwrite"], "export parent")
        for target in targets:
            out[target] = str(work / f"nas-child-{target}")
            _run(["export", children[target]["out"], "--format", "nemotron-nas", "--out", out[target], "--overwrite"],
                 f"export {target}")
        return out

    exports = _stage(work / "3-export.json", export_all)
    timing = _stage(work / "4-timing.json", lambda: {name: _time(path, args) for name, path in exports.items()})
    agreement = _stage(work / "5-agreement.json", lambda: _agreement(exports, children, args))

    parent_ms = timing["parent"]["request_ms"]
    rows = [{"model": "parent", "tokens_per_s": timing["parent"]["tokens_per_s"], "measured_speedup": 1.0,
             "predicted_speedup": 1.0, **agreement["parent"]}]
    for target in targets:
        predicted = children[target]["predicted"]["speedup"]
        measured = parent_ms / timing[target]["request_ms"]
        rows.append({"model": f"child {target}", "tokens_per_s": timing[target]["tokens_per_s"],
                     "measured_speedup": measured, "predicted_speedup": predicted,
                     "speedup_rel_error": (predicted - measured) / measured,
                     "num_params": children[target]["num_params"], "choices": children[target]["choices"],
                     **agreement[target]})
    report = {"model": args.model, "scenario": {"batch": 1, "prompt": args.prompt, "gen": args.gen},
              "vllm": timing["parent"]["vllm_version"], "profile": str(profile), "rows": rows}
    print("| model | vLLM tok/s | measured speedup | predicted | error | top-1 agreement | max log-prob gap |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        error = f"{row['speedup_rel_error']:+.1%}" if "speedup_rel_error" in row else "-"
        print(f"| {row['model']} | {row['tokens_per_s']:.1f} | {row['measured_speedup']:.2f}x | "
              f"{row['predicted_speedup']:.2f}x | {error} | {row['top1_agreement']:.3f} | {row['max_logprob_gap']:.2e} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


def _time(export: str, args: argparse.Namespace) -> dict:
    """Median wall time of one request (prompt, then `gen` new tokens) in vLLM, batch 1."""
    from mlxkit.engines.serving.vllm import run_worker

    print(f"[bench_vllm] timing {export}", file=sys.stderr, flush=True)
    config = json.loads((Path(export) / "config.json").read_text())
    result = run_worker({"model": export, "mode": "time", "dtype": "float32", "max_model_len": args.prompt + args.gen + 8,
                         "points": [[1, args.prompt]], "decode_steps": args.gen - 1, "warmup": 1,
                         "repeats": args.repeats, "vocab_size": int(config["vocab_size"]), "max_num_seqs": 1})
    row = result["timings"][0]
    request_ms = row["prefill_ms"] + (args.gen - 1) * row["decode_ms"]
    return {"prefill_ms": row["prefill_ms"], "decode_ms": row["decode_ms"], "request_ms": request_ms,
            "tokens_per_s": args.gen / request_ms * 1e3, "load_s": result["load_s"],
            "vllm_version": result["vllm_version"]}


def _agreement(exports: dict, children: dict, args: argparse.Namespace) -> dict:
    from mlxkit.engines.models.loading import load_model
    from mlxkit.engines.serving.vllm import vllm_agreement

    parent = load_model(args.model)
    text = Path(args.data).read_text()[:200_000]
    ids = parent.tokenizer(text)["input_ids"]
    stride = len(ids) // (args.prompts + 1)
    prompts = [ids[i * stride: i * stride + 48] for i in range(1, args.prompts + 1)]
    out = {}
    for name, export in exports.items():
        source = args.model if name == "parent" else children[name]["out"]
        reference = load_model(source, with_tokenizer=False).model.eval()
        print(f"[bench_vllm] agreement {export}", file=sys.stderr, flush=True)
        out[name] = vllm_agreement(export, reference, prompts, max_tokens=args.agreement_tokens).to_dict()
    return out


if __name__ == "__main__":
    main()
