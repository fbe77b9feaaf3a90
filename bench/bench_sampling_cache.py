"""Calibration sampling: transformers' `generate` with its default (dynamic) KV cache against its static one.

`engines/data/sampled.py` samples the calibration pool as 32 rows of 256 tokens per `generate` call
from the parent's BOS token. This runs one such batch (seed 123) twice with each cache, in the order
dynamic, static, static, dynamic so that a drift in the machine's speed falls on both, and reports
the mean wall time, tokens/s, and whether the two sampled the same tokens.

    python bench/bench_sampling_cache.py ~/.cache/mlxkit/models/smollm2-135m

Run it alone on the machine: the times are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

ROWS, ROW_LEN = 32, 256


def sample(model, cache: str | None) -> tuple[float, torch.Tensor]:
    torch.manual_seed(123)
    prompt = torch.full((ROWS, 1), model.config.bos_token_id or 0, dtype=torch.long)
    options = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=ROW_LEN - 1,
                   min_new_tokens=ROW_LEN - 1, pad_token_id=model.config.eos_token_id,
                   attention_mask=torch.ones_like(prompt))
    if cache is not None:
        options["cache_implementation"] = cache
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompt, **options)
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a local transformers causal LM directory")
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    times: dict[str | None, list[float]] = {None: [], "static": []}
    outputs: dict[str | None, torch.Tensor] = {}
    for cache in (None, "static", "static", None):
        seconds, outputs[cache] = sample(model, cache)
        times[cache].append(seconds)
    dynamic_s, static_s = (sum(times[c]) / 2 for c in (None, "static"))
    dynamic, static = outputs[None], outputs["static"]
    tokens = ROWS * (ROW_LEN - 1)
    print(json.dumps({"tokens": tokens, "dynamic_s": round(dynamic_s, 1), "static_s": round(static_s, 1),
                      "dynamic_tokens_per_s": round(tokens / dynamic_s, 1),
                      "static_tokens_per_s": round(tokens / static_s, 1),
                      "static_vs_dynamic_time": round(static_s / dynamic_s, 2),
                      "same_tokens": bool(torch.equal(dynamic, static))}, indent=1))


if __name__ == "__main__":
    main()
