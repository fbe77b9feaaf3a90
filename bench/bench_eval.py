"""`mlx eval` on SmolLM2-135M against an independent plain-transformers computation.

Both score the same tokens of wikitext-2 test (non-overlapping windows); the report gives
both perplexities, their relative difference (goal: within 1 %), and each side's tokens/s.

Usage: python bench/bench_eval.py [--data ../shared/data/wikitext2-test.txt] [--max-tokens 8192] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/wikitext2-test.txt")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()

    done = subprocess.run([sys.executable, "-m", "mlxkit", "eval", "smollm2-135m", "--data", str(args.data),
                           "--max-tokens", str(args.max_tokens), "--seq-len", str(args.seq_len), "--json"],
                          check=True, capture_output=True, text=True)
    ours = json.loads(done.stdout)

    from mlxkit.engines.models.default_model import default_model_dir

    path = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = args.data.read_text(encoding="utf-8")
    ids = tokenizer(text[: args.max_tokens * 12], add_special_tokens=False, return_tensors="pt").input_ids[0]
    n = args.max_tokens // args.seq_len
    windows = ids[: n * args.seq_len].view(n, args.seq_len)
    start = time.perf_counter()
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    seconds = time.perf_counter() - start
    reference = math.exp(sum(losses) / len(losses))
    print(json.dumps({"mlx_eval_perplexity": ours["perplexity"], "transformers_perplexity": reference,
                      "relative_difference": abs(ours["perplexity"] - reference) / reference,
                      "tokens_scored": ours["tokens"], "mlx_eval_tokens_per_s": ours["tokens_per_s"],
                      "transformers_tokens_per_s": windows.numel() / seconds}, indent=2))


if __name__ == "__main__":
    main()
