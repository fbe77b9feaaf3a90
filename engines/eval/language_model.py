"""Perplexity of a causal LM on token blocks, and its agreement with a reference model.

The metrics themselves (and which positions they cover) are defined once in `metrics.py`.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import NonFiniteError
from mlxkit.engines.eval.metrics import TokenMetrics
from mlxkit.engines.training.device import module_device

# Bounds the [batch, seq, vocab] logits held at once, per model: 1,024 x 49,152 float32 is 192 MiB.
# A model evaluated during training sits beside its gradients and optimiser state, and with a
# reference the logits are held twice; the matrices of a 1,024-token forward still run at full speed.
TOKENS_PER_BATCH = 1024


@dataclass
class EvalResult:
    perplexity: float
    nll: float
    tokens: int
    tokens_per_s: float
    seconds: float
    sequences: int
    seq_len: int
    kl_div: float | None = None
    top1_agreement: float | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits for `ids`, which are moved to the model's device first (the metrics upcast them to float32)."""
    return model(input_ids=ids.to(module_device(model)), use_cache=False).logits


@torch.no_grad()  # not inference_mode: a sharded model reuses the weights it gathers here in training
def evaluate(model, blocks: torch.Tensor, reference=None, reporter: Reporter | None = None) -> EvalResult:
    """NLL, perplexity and (with a `reference`) KL(reference || model) and top-1 agreement on `blocks` [n, seq_len].

    Each batch of `blocks` is moved to the model's device; the models may be held in a low-precision
    dtype, while log-softmax, NLL and KL are computed in float32 (`metrics.TokenMetrics`).

    Raises `NonFiniteError` when the model's outputs are not finite (NaN weights, overflow) or
    the perplexity overflows: a perplexity of NaN or infinity is not a result. tokens/s counts the evaluated model's forward passes only.
    """
    reporter = reporter or Reporter()
    n, seq_len = blocks.shape
    batch = max(1, TOKENS_PER_BATCH // seq_len)
    metrics = TokenMetrics()
    device = module_device(model)
    model_seconds = 0.0
    batches = range(0, n, batch)
    with reporter.task("evaluating", total=len(batches)) as task:
        for first in batches:
            ids = blocks[first:first + batch].to(device)
            start = time.perf_counter()
            logits = _logits(model, ids)
            if device.type == "cuda":  # kernels run asynchronously: time the forward, not its launch
                torch.cuda.synchronize(device)
            model_seconds += time.perf_counter() - start
            reference_logits = _logits(reference, ids).to(device) if reference is not None else None
            metrics.update(logits, ids, reference_logits)
            task.advance()
            task.update(ppl=metrics.perplexity)
    if not all(math.isfinite(v) for v in (metrics.nll, metrics.kl_div or 0.0)):
        raise NonFiniteError("the model's outputs are not finite on this data (NaN or infinite weights?)")
    if not math.isfinite(metrics.perplexity):
        raise NonFiniteError(f"the perplexity is beyond float64's range: the mean NLL is {metrics.nll:.1f} nats per "
                             "token (exp overflows past 709.8); the model's logits are far out of scale")
    return EvalResult(
        perplexity=metrics.perplexity, nll=metrics.nll, tokens=metrics.positions,
        tokens_per_s=blocks.numel() / max(model_seconds, 1e-9), seconds=model_seconds, sequences=n, seq_len=seq_len,
        kl_div=metrics.kl_div, top1_agreement=metrics.top1_agreement,
    )
