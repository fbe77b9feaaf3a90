"""Perplexity of a causal LM on token blocks, and its agreement with a reference model."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from mlxkit.engines.core.progress import Reporter

TOKENS_PER_BATCH = 4096  # bounds the [batch, seq, vocab] logits held at once


@dataclass
class EvalResult:
    perplexity: float
    nll: float
    tokens: int
    tokens_per_s: float
    seconds: float
    sequences: int
    seq_len: int
    kl: float | None = None
    top1_agreement: float | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()


@torch.inference_mode()
def evaluate(model, blocks: torch.Tensor, reference=None, reporter: Reporter | None = None) -> EvalResult:
    """Mean next-token NLL over every predicted position of `blocks` ([n, seq_len]).

    With a `reference`, also KL(reference || model) of the next-token distributions and
    the fraction of positions where both models' top-1 tokens agree. tokens/s counts the
    evaluated model's forward passes only.
    """
    reporter = reporter or Reporter()
    n, seq_len = blocks.shape
    batch = max(1, TOKENS_PER_BATCH // seq_len)
    nll_sum = kl_sum = 0.0
    agree = scored = 0
    model_seconds = 0.0
    batches = range(0, n, batch)
    with reporter.task("evaluating", total=len(batches)) as task:
        for first in batches:
            ids = blocks[first:first + batch]
            start = time.perf_counter()
            logp = F.log_softmax(_logits(model, ids)[:, :-1], dim=-1)
            model_seconds += time.perf_counter() - start
            targets = ids[:, 1:]
            nll_sum += -logp.gather(-1, targets.unsqueeze(-1)).sum().item()
            scored += targets.numel()
            if reference is not None:
                ref_logp = F.log_softmax(_logits(reference, ids)[:, :-1], dim=-1)
                kl_sum += (ref_logp.exp() * (ref_logp - logp)).sum().item()
                agree += (ref_logp.argmax(-1) == logp.argmax(-1)).sum().item()
            task.advance()
            task.update(ppl=math.exp(nll_sum / scored))
    nll = nll_sum / scored
    return EvalResult(
        perplexity=math.exp(nll), nll=nll, tokens=scored, tokens_per_s=blocks.numel() / max(model_seconds, 1e-9),
        seconds=model_seconds, sequences=n, seq_len=seq_len,
        kl=kl_sum / scored if reference is not None else None,
        top1_agreement=agree / scored if reference is not None else None,
    )
