"""The one definition of the next-token metrics every verb reports: KL, NLL, top-1 agreement.

Positions: for a block of T tokens, a causal LM's logits at positions 0..T-2 predict tokens
1..T-1. Every metric here covers exactly those T-1 positions per sequence (the last
position has no target, so it is dropped everywhere, even from KL and top-1 agreement
where a target is not needed). Callers pass logits for all T positions.

- `kl_div`: KL(reference || model) = Σ_v p_ref(v) (log p_ref(v) − log p_model(v)), in nats,
  averaged over positions. The reference is the teacher or parent.
- `nll`: −log p_model(next token), averaged over positions; perplexity is exp(nll).
- `top1_agreement`: fraction of positions where both models' most likely token is the same.

`TokenMetrics` accumulates sums over batches and over chunks of positions, so the
[positions, vocab] log-probabilities of both models never exist for a whole batch at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Positions per chunk: bounds the float32 [chunk, vocab] temporaries (4096 × 49152 × 4 B = 0.8 GB
# per tensor for SmolLM2's vocabulary would be too much; 1024 keeps each near 200 MB).
POSITION_CHUNK = 1024


def predicting(logits: torch.Tensor) -> torch.Tensor:
    """The positions that have a next token: [batch, T, V] → [batch·(T−1), V]."""
    return logits[:, :-1].reshape(-1, logits.shape[-1])


def kl_from_log_probs(reference_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(reference || model) along the last axis of two log-probability tensors, in nats."""
    return (reference_logp.exp() * (reference_logp - logp)).sum(-1)


def kl_per_position(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || model) at each row of two [N, V] logit tensors (computed in float32), in nats."""
    return kl_from_log_probs(F.log_softmax(reference_logits.float(), dim=-1), F.log_softmax(logits.float(), dim=-1))


@dataclass
class TokenMetrics:
    """Running sums of the metrics above; `update` per batch, read the means at the end."""

    positions: int = 0
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    agree: int = 0
    has_reference: bool = False

    @torch.no_grad()
    def update(self, logits: torch.Tensor, input_ids: torch.Tensor,
               reference_logits: torch.Tensor | None = None) -> None:
        """Add a batch: `logits` (and `reference_logits`) [B, T, V] for `input_ids` [B, T].

        Taken sequence by sequence: `logits[b, :-1]` is a view, where flattening the batch's predicting
        positions would copy the whole [B·(T−1), V] tensor, once per model.
        """
        targets = input_ids[:, 1:].to(logits.device)
        self.has_reference |= reference_logits is not None
        for b in range(logits.shape[0]):
            rows = logits[b, :-1]
            ref_rows = reference_logits[b, :-1] if reference_logits is not None else None
            for lo in range(0, rows.shape[0], POSITION_CHUNK):
                chunk = rows[lo:lo + POSITION_CHUNK].float()
                logp = F.log_softmax(chunk, dim=-1)
                self.nll_sum += -logp.gather(-1, targets[b, lo:lo + POSITION_CHUNK, None]).sum().item()
                if ref_rows is not None:
                    ref_chunk = ref_rows[lo:lo + POSITION_CHUNK].float()
                    # kl_per_position(ref_chunk, chunk), with the chunk's log-softmax taken once
                    self.kl_sum += kl_from_log_probs(F.log_softmax(ref_chunk, dim=-1), logp).sum().item()
                    self.agree += (ref_chunk.argmax(-1) == chunk.argmax(-1)).sum().item()
            self.positions += rows.shape[0]

    @property
    def nll(self) -> float:
        return self.nll_sum / max(self.positions, 1)

    @property
    def perplexity(self) -> float:
        """exp(nll); infinite past float64's range (nll above about 709.8), where `math.exp` raises."""
        try:
            return math.exp(self.nll)
        except OverflowError:
            return math.inf

    @property
    def kl_div(self) -> float | None:
        return self.kl_sum / self.positions if self.has_reference and self.positions else None

    @property
    def top1_agreement(self) -> float | None:
        return self.agree / self.positions if self.has_reference and self.positions else None

    def to_dict(self) -> dict[str, float | int | None]:
        return {"nll": self.nll, "perplexity": self.perplexity, "kl_div": self.kl_div,
                "top1_agreement": self.top1_agreement, "positions": self.positions}
