"""Benchmark: Puzzle children exported to GGUF, timed in llama.cpp next to mlxkit's predicted speed-up.

The parent and every child given on the command line are exported with `mlx export --format
gguf` (same encoding for all), loaded in llama.cpp (llama-cpp-python) and timed: prompt
processing (one batch of --prompt tokens) and generation (--gen single-token steps after
it), each the median of --repeats runs after one warm-up, with --threads threads. All models are
loaded at once and timed in turn within every repeat, so slow phases of a shared VM fall on
every model alike. The
measured speed-ups over the parent are printed beside the one `mlx search` predicted (the
child's mlxkit.json: results.predicted.speedup, for the target and scenario it searched for).
The "in+out" speed-up is the whole request (prompt, then generation) against the parent's:
what the cost model predicts for a batch-1 scenario with in = --prompt and out = --gen, so for
children searched with `--target cpu` (default scenario batch 1, in 128, out 128, fp32) at the
defaults here, measured and predicted are the same quantity. For other targets, read the two
side by side, not as a check of each other.

    .venv/bin/python bench/bench_export_speed.py runs/demo/child [more children ...] \\
        [--parent smollm2-135m] [--encoding f32] [--threads 2] [--repeats 5] [--prompt 128] [--gen 128] [--json out.json]

Needs `pip install -e .[llamacpp]`. Run it on a quiet machine: the numbers are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _predicted(child: Path) -> dict:
    manifest = child / "mlxkit.json"
    if not manifest.exists():
        return {}
    data = json.loads(manifest.read_text())
    settings = data.get("settings") or {}
    if "search" in settings:  # `mlx search --gkd-tokens`: the distillation's manifest records the search's stages
        settings = settings["search"]
        predicted = settings.get("predicted") or {}
    else:
        predicted = (data.get("results") or {}).get("predicted") or {}
    return {"speedup": predicted.get("speedup"), "target": settings.get("target"),
            "scenario": settings.get("scenario")}


def _time_models(paths: list[Path], args: argparse.Namespace) -> list[dict]:
    """Every model loaded at once and timed in turn within each repeat, so drift on a shared VM hits all alike."""
    import llama_cpp
    import numpy as np

    from mlxkit.engines.calibrate.llamacpp_timing import native_stderr_silenced

    with native_stderr_silenced():
        models = [llama_cpp.Llama(str(p), n_ctx=args.prompt + args.gen + 16, n_batch=args.prompt,
                                  n_ubatch=args.prompt, n_threads=args.threads, n_threads_batch=args.threads,
                                  logits_all=False, verbose=False) for p in paths]
    rng = np.random.default_rng(0)
    # Token ids past the specials; the same ids for every model (they share the parent's vocabulary).
    vocab = min(min(m.n_vocab() for m in models), 10000)
    prompt = rng.integers(100, vocab, size=args.prompt).tolist()
    steps = rng.integers(100, vocab, size=args.gen).tolist()
    prompt_s: list[list[float]] = [[] for _ in models]
    gen_s: list[list[float]] = [[] for _ in models]
    try:
        for run in range(args.repeats + 1):  # run 0 warms caches and the thread pools
            for i, llm in enumerate(models):
                llm.reset()  # the next eval drops the KV cache past position 0: an empty context again
                start = time.perf_counter()
                llm.eval(prompt)
                middle = time.perf_counter()
                for token in steps:
                    llm.eval([token])
                end = time.perf_counter()
                if run:
                    prompt_s[i].append(middle - start)
                    gen_s[i].append(end - middle)
    finally:
        with native_stderr_silenced():
            for llm in models:
                llm.close()
    return [{"prompt_tokens_per_s": args.prompt / statistics.median(p), "gen_tokens_per_s": args.gen / statistics.median(g),
             "request_s": statistics.median(a + b for a, b in zip(p, g)), "prompt_s": p, "gen_s": g}
            for p, g in zip(prompt_s, gen_s)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("children", nargs="*", type=Path, help="child directories saved by `mlx search`")
    parser.add_argument("--parent", default="smollm2-135m")
    parser.add_argument("--encoding", default="f32", choices=["f32", "f16", "q8_0"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens (one batch)")
    parser.add_argument("--gen", type=int, default=128, help="generated tokens (one at a time)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from mlxkit.engines.export import export_model

    work = Path(tempfile.mkdtemp(prefix="bench-export-"))
    models = [("parent", args.parent, {})] + [(c.name if c.name != "child" else str(c), str(c), _predicted(c))
                                              for c in args.children]
    rows, paths = [], []
    for i, (label, spec, predicted) in enumerate(models):
        out = work / f"{i}.gguf"
        start = time.perf_counter()
        export = export_model(spec, "gguf", out, args.encoding)
        rows.append({"model": label, "spec": spec, "gguf_mib": out.stat().st_size / 2**20,
                     "export_s": time.perf_counter() - start,
                     "feed_forward_length": export["gguf"]["feed_forward_length"],
                     "head_count_kv": export["gguf"]["head_count_kv"], "predicted": predicted})
        paths.append(out)
    for row, timing in zip(rows, _time_models(paths, args)):
        row.update(timing)

    parent = rows[0]
    print(f"\nllama.cpp, {args.encoding}, {args.threads} threads, median of {args.repeats}: prompt {args.prompt} tokens, "
          f"generation {args.gen} tokens")
    print(f"{'model':<28}{'MiB':>7}{'prompt tok/s':>14}{'x':>7}{'gen tok/s':>12}{'x':>7}{'in+out x':>10}"
          "   predicted (mlx search)")
    for row in rows:
        row["prompt_speedup"] = row["prompt_tokens_per_s"] / parent["prompt_tokens_per_s"]
        row["gen_speedup"] = row["gen_tokens_per_s"] / parent["gen_tokens_per_s"]
        row["request_speedup"] = parent["request_s"] / row["request_s"]
        pred = row["predicted"]
        pred_text = f"{pred['speedup']:.2f}x on {pred['target']}, {pred['scenario']}" if pred.get("speedup") else "-"
        print(f"{row['model'][:27]:<28}{row['gguf_mib']:>7.0f}{row['prompt_tokens_per_s']:>14,.0f}"
              f"{row['prompt_speedup']:>7.2f}{row['gen_tokens_per_s']:>12,.1f}{row['gen_speedup']:>7.2f}"
              f"{row['request_speedup']:>10.2f}   {pred_text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args) | {"children": [str(c) for c in args.children]},
                                               "rows": rows}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
