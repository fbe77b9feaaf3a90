"""Replace-1-block scoring's head and metrics: `ParentTail.score` against the same arithmetic on fresh tensors.

After a variant's tail, scoring takes the final norm, the head and the log-softmax over the held-out
positions, then the KL to the parent, the NLL and the top-1 agreement: several tensors of sequences ×
positions × vocabulary each. `ParentTail.score` computes the parent's probabilities once and writes the
child's log-probabilities and the KL terms into buffers it reuses; the reference allocates them afresh
per variant, as `kl_from_log_probs` does. This times both over the quick recipe's held-out set (2 × 256
tokens) of a SmolLM2-135M-shaped parent (random weights, the 49,152-word tied head), alternating the two,
and checks that they give the same numbers.

    python bench/bench_scoring_metrics.py

Run it alone on the machine: the times are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from mlxkit.engines.eval.metrics import kl_from_log_probs
from mlxkit.engines.models.decilm.convert import from_parent
from mlxkit.engines.puzzle.library.scoring import ParentTail


def fresh_metrics(tail: ParentTail, state: torch.Tensor) -> dict[str, float]:
    logp = F.log_softmax(tail.head(tail.model.model.norm(state[:, :-1])).float(), dim=-1)
    kl = kl_from_log_probs(tail.parent_logp, logp).mean()
    nll = -logp.gather(-1, tail.targets.unsqueeze(-1)).mean()
    agree = (logp.argmax(-1) == tail.parent_top1).float().mean()
    return {"kl_div": kl.item(), "lm_loss": nll.item(), "top1_agreement": agree.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=2048)
    parent = from_parent(LlamaForCausalLM(config).eval())
    ids = torch.randint(0, config.vocab_size, (2, 256))
    times: dict[str, list[float]] = {"fresh": [], "reused": []}
    with torch.inference_mode():
        tail = ParentTail(parent, ids, torch.randn(2, 256, 576), None)
        states = [torch.randn(2, 256, 576) for _ in range(args.repeats)]
        same = True
        for state in states:
            for name, run in (("fresh", fresh_metrics), ("reused", lambda t, s: t.score(s))):
                started = time.perf_counter()
                result = run(tail, state)
                times[name].append(time.perf_counter() - started)
                if name == "fresh":
                    reference = result
                else:
                    same = same and result == reference
    fresh, reused = (statistics.median(times[k][1:]) for k in ("fresh", "reused"))
    print(json.dumps({"positions": 2 * 255, "vocab": config.vocab_size, "fresh_ms": round(fresh * 1000, 1),
                      "reused_ms": round(reused * 1000, 1), "reused_vs_fresh": round(reused / fresh, 2),
                      "same_metrics": same}, indent=1))


if __name__ == "__main__":
    main()
