"""Would batching variants through the parent's tail make replace-1-block scoring faster?

One variant's score is a forward pass through the layers after its block, the head and the
log-softmax, over the held-out tokens (the quick recipe: 2 sequences of 256). This times that pass
for a SmolLM2-135M-shaped tail of 15 layers (random weights, the 49,152-word tied head) with the
tokens of 1, 2 and 4 variants stacked into one batch, and reports the time per variant against one
at a time.

    python bench/bench_scoring_batch.py

Run it alone on the machine: the times are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def time_per_variant(model: torch.nn.Module, variants: int, sequences: int, seq_len: int, repeats: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (variants * sequences, seq_len))

    def once() -> None:
        with torch.inference_mode():
            torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)

    once()  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - started) / repeats / variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=15, help="tail length (half of SmolLM2-135M's 30)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=2048)
    model = LlamaForCausalLM(config).eval()
    rows = []
    for variants in (1, 2, 4):
        rows.append({"variants_per_batch": variants,
                     "s_per_variant": round(time_per_variant(model, variants, 2, 256, args.repeats), 3)})
    for row in rows:
        row["vs_one_at_a_time"] = round(row["s_per_variant"] / rows[0]["s_per_variant"], 2)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
