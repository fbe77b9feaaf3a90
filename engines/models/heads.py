"""A causal LM's output head as its own forward applies it, for losses that take logits in chunks.

The chunked losses and the scorers map final hidden states to logits themselves, a slice of
positions at a time, rather than asking the model for a whole batch's logits. They must apply
what the model's forward applies after the vocabulary projection: Gemma 2 squashes its logits
to cap·tanh(logits / cap) (`final_logit_softcapping`), and a KL on uncapped logits measures
another distribution than the one the model samples from.
"""

from __future__ import annotations

import torch


class OutputHead:
    """`head(hidden)` gives the logits the model's forward gives for those final (normed) hidden states."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.projection = model.get_output_embeddings()
        cap = getattr(model.config, "final_logit_softcapping", None)
        self.cap = float(cap) if cap is not None else None

    @property
    def vocab_size(self) -> int:
        return int(self.projection.weight.shape[0])

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.projection(hidden)
        if self.cap is None:
            return logits
        return torch.tanh(logits / self.cap) * self.cap
