"""Benchmark: Puzzle children exported to GGUF, timed in llama.cpp next to mlxkit's predicted speed-up.

The parent and every child given on the command line are exported with `mlx export --format
gguf` (same dtype for all), loaded in llama.cpp (llama-cpp-python) and timed: prompt
processing (one batch of --prompt tokens) and generation (--gen single-token steps after
it), each the median of --repeats runs after one warm-up, with --threads threads. The
measured speed-ups over the parent are printed beside the one `mlx search` predicted (the
child's mlxkit.json: results.predicted.speedup, for the target and scenario it searched for,
which is usually not this CPU: read the two side by side, not as a check of each other).

    .venv/bin/python bench/bench_export_speed.py runs/demo/child [more children ...] \\
        [--parent smollm2-135m] [--dtype f16] [--threads 2] [--repeats 5] [--prompt 256] [--gen 64] [--json out.json]

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
    predicted = (data.get("results") or {}).get("predicted") or {}
    settings = data.get("settings") or {}
    return {"speedup": predicted.get("speedup"), "target": settings.get("target"),
            "scenario": settings.get("scenario")}


def _time_model(path: Path, args: argparse.Namespace) -> dict:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(str(path), n_ctx=args.prompt + args.gen + 16, n_batch=args.prompt, n_ubatch=args.prompt,
                          n_threads=args.threads, n_threads_batch=args.threads, logits_all=False, verbose=False)
    rng = np.random.default_rng(0)
    # Token ids past the specials; the same ids for every model (they share the parent's vocabulary).
    prompt = rng.integers(100, min(llm.n_vocab(), 10000), size=args.prompt).tolist()
    steps = rng.integers(100, min(llm.n_vocab(), 10000), size=args.gen).tolist()
    prompt_s, gen_s = [], []
    try:
        for run in range(args.repeats + 1):  # run 0 warms caches and the thread pool
            llm.reset()  # the next eval drops the KV cache past position 0: an empty context again
            start = time.perf_counter()
            llm.eval(prompt)
            middle = time.perf_counter()
            for token in steps:
                llm.eval([token])
            end = time.perf_counter()
            if run:
                prompt_s.append(middle - start)
                gen_s.append(end - middle)
    finally:
        llm.close()
    pp, tg = statistics.median(prompt_s), statistics.median(gen_s)
    return {"prompt_tokens_per_s": args.prompt / pp, "gen_tokens_per_s": args.gen / tg,
            "prompt_s": prompt_s, "gen_s": gen_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("children", nargs="*", type=Path, help="child directories saved by `mlx search`")
    parser.add_argument("--parent", default="smollm2-135m")
    parser.add_argument("--dtype", default="f16", choices=["f32", "f16", "q8_0"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens (one batch)")
    parser.add_argument("--gen", type=int, default=64, help="generated tokens (one at a time)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from mlxkit.engines.export import export_model

    work = Path(tempfile.mkdtemp(prefix="bench-export-"))
    models = [("parent", args.parent, {})] + [(c.name if c.name != "child" else str(c), str(c), _predicted(c))
                                              for c in args.children]
    rows = []
    for i, (label, spec, predicted) in enumerate(models):
        out = work / f"{i}.gguf"
        start = time.perf_counter()
        export = export_model(spec, "gguf", out, args.dtype)
        export_s = time.perf_counter() - start
        timing = _time_model(out, args)
        rows.append({"model": label, "spec": spec, "gguf_mib": out.stat().st_size / 2**20, "export_s": export_s,
                     "feed_forward_length": export["gguf"]["feed_forward_length"],
                     "head_count_kv": export["gguf"]["head_count_kv"], "predicted": predicted, **timing})
        print(f"{label}: prompt {timing['prompt_tokens_per_s']:,.0f} tok/s, generation "
              f"{timing['gen_tokens_per_s']:,.1f} tok/s ({rows[-1]['gguf_mib']:.0f} MiB GGUF)", flush=True)

    parent = rows[0]
    print(f"\nllama.cpp, {args.dtype}, {args.threads} threads, median of {args.repeats}: prompt {args.prompt} tokens, "
          f"generation {args.gen} tokens")
    print(f"{'model':<28}{'MiB':>7}{'prompt tok/s':>14}{'x':>7}{'gen tok/s':>12}{'x':>7}   predicted (mlx search)")
    for row in rows:
        row["prompt_speedup"] = row["prompt_tokens_per_s"] / parent["prompt_tokens_per_s"]
        row["gen_speedup"] = row["gen_tokens_per_s"] / parent["gen_tokens_per_s"]
        pred = row["predicted"]
        pred_text = f"{pred['speedup']:.2f}x on {pred['target']}, {pred['scenario']}" if pred.get("speedup") else "-"
        print(f"{row['model'][:27]:<28}{row['gguf_mib']:>7.0f}{row['prompt_tokens_per_s']:>14,.0f}"
              f"{row['prompt_speedup']:>7.2f}{row['gen_tokens_per_s']:>12,.1f}{row['gen_speedup']:>7.2f}   {pred_text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args) | {"children": [str(c) for c in args.children]},
                                               "rows": rows}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
