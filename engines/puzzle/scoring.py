"""Replace-1-block scoring: swap one subblock into the parent and compare next-token distributions.

Scoring streams from the cached residual-stream state at the swapped layer, so only the
layers from there on run. Metrics use the public NVlabs/puzzle names where they exist:
`kl_div` (KL(parent || child)) and `lm_loss` (the child's NLL), plus `top1_agreement`, all as
defined in `mlxkit.engines.eval.metrics` (mean over the held-out positions that have a next token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlxkit.engines.eval.metrics import kl_from_log_probs
from mlxkit.engines.puzzle.subblocks import Subblock
from mlxkit.engines.training.device import module_device


class ParentTail:
    """Runs the parent from any layer to the logits, over the held-out sequences.

    Everything stays on the parent's device, in its (compute) dtype, up to the logits;
    log-softmax, KL and the other metrics are computed in float32.
    """

    def __init__(self, parent_model, val_ids: torch.Tensor, final_state: torch.Tensor, pos):
        self.model = parent_model
        self.pos = pos
        self.targets = val_ids[:, 1:].to(module_device(parent_model))
        self.parent_logp = self._log_probs(final_state)
        self.parent_top1 = self.parent_logp.argmax(-1)

    def _log_probs(self, state: torch.Tensor) -> torch.Tensor:
        """Next-token log-probabilities at the positions that have a target (all but the last)."""
        return F.log_softmax(self.model.lm_head(self.model.model.norm(state[:, :-1])).float(), dim=-1)

    def run_from(self, state: torch.Tensor, first_layer: int) -> torch.Tensor:
        for layer in self.model.model.layers[first_layer:]:
            state = layer(state, self.pos)
        return self._log_probs(state)

    def metric_tensors(self, child_logp: torch.Tensor) -> dict[str, torch.Tensor]:
        """The metrics as 0-d float32 tensors on the device (no host synchronisation)."""
        kl = kl_from_log_probs(self.parent_logp, child_logp).mean()
        lm_loss = -child_logp.gather(-1, self.targets.unsqueeze(-1)).mean()
        agree = (child_logp.argmax(-1) == self.parent_top1).float().mean()
        return {"kl_div": kl, "lm_loss": lm_loss, "top1_agreement": agree}

    def metrics(self, child_logp: torch.Tensor) -> dict[str, float]:
        return {name: value.item() for name, value in self.metric_tensors(child_logp).items()}


def replaced_log_probs(tail: ParentTail, block: Subblock, layer_idx: int, val_in: torch.Tensor,
                       val_mid: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities (float32) of the parent with only `block` replaced at `layer_idx`.

    `block` and the cached states are on the parent's device, in its dtype.
    """
    parent_layer = tail.model.model.layers[layer_idx]
    if block.kind == "attention":
        state = val_in + block(val_in, tail.pos)
        delta = parent_layer.ffn_delta(state)
        state = state if delta is None else state + delta
    else:
        state = val_mid + block(val_mid)
    return tail.run_from(state, layer_idx + 1)


@torch.inference_mode()
def score_subblock(tail: ParentTail, block: Subblock, layer_idx: int, val_in: torch.Tensor,
                   val_mid: torch.Tensor) -> dict[str, float]:
    """Metrics of the parent with only `block` replaced at `layer_idx`."""
    return tail.metrics(replaced_log_probs(tail, block, layer_idx, val_in, val_mid))


@torch.inference_mode()
def parent_metrics(tail: ParentTail) -> dict[str, float]:
    return tail.metrics(tail.parent_logp)
