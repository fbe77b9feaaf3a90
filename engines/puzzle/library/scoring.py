"""Replace-1-block scoring: swap one subblock into the parent and compare next-token distributions.

Scoring starts from the cached residual-stream state at the swapped layer, so only the
layers from there on run. `score_subblock` runs a resident parent's tail per variant;
`score_streamed` takes many variants through one pass over the tail, holding one parent
layer at a time (a streamed parent reads each from disk once per pass), with the same results.

Metrics use the public NVlabs/puzzle names where they exist:
`kl_div` (KL(parent || child)) and `lm_loss` (the child's NLL), plus `top1_agreement`, all as
defined in `mlxkit.engines.eval.metrics` (mean over the held-out positions that have a next token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from mlxkit.engines.models.heads import OutputHead
from mlxkit.engines.puzzle.subblocks import Subblock, SubblockKind
from mlxkit.engines.training.device import module_device


class ParentTail:
    """Runs the parent from any layer to the logits, over the held-out sequences.

    Everything stays on the parent's device, in its (compute) dtype, up to the logits;
    log-softmax, KL and the other metrics are computed in float32.

    `score` runs once per variant over vocabulary-wide tensors (sequences × positions × vocabulary), so
    the parent's probabilities are computed once and the child's log-probabilities and KL terms are
    written into two buffers that every variant reuses. On a CPU a fresh tensor that size is mapped and
    zero-filled page by page: at SmolLM2's vocabulary over 2 × 256 tokens, reusing them takes a variant's
    head and metrics from 307 to 206 ms (`bench/bench_scoring_metrics.py`). The values are those of
    `engines.eval.metrics.kl_from_log_probs` on fresh tensors, bit for bit.
    """

    def __init__(self, parent_model, val_ids: torch.Tensor, final_state: torch.Tensor, pos):
        self.model = parent_model
        self.pos = pos
        self.head = OutputHead(parent_model)
        self.targets = val_ids[:, 1:].to(module_device(parent_model))
        self.parent_logp = self.log_probs(final_state)
        self.parent_top1 = self.parent_logp.argmax(-1)
        self._parent_probs: torch.Tensor | None = None
        self._scratch: dict[str, torch.Tensor] = {}

    def _parent_probabilities(self) -> torch.Tensor:
        if self._parent_probs is None:
            self._parent_probs = self.parent_logp.exp()
        return self._parent_probs

    def _buffer(self, name: str) -> torch.Tensor:
        """A scratch tensor shaped like the log-probabilities, the same one on every call with `name`."""
        if name not in self._scratch:
            self._scratch[name] = torch.empty_like(self.parent_logp)
        return self._scratch[name]

    def log_probs(self, state: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token log-probabilities at the positions that have a target (all but the last), from the
        last layer's output: the final norm and the head, which stay resident in a streamed parent."""
        return torch.log_softmax(self.head(self.model.model.norm(state[:, :-1])).float(), dim=-1, out=out)

    def run_layers(self, state: torch.Tensor, first_layer: int) -> torch.Tensor:
        """The last layer's output, from layer `first_layer` on, through the parent's resident layers."""
        for layer in self.model.model.layers[first_layer:]:
            state = layer(state, self.pos)
        return state

    def run_from(self, state: torch.Tensor, first_layer: int) -> torch.Tensor:
        """From layer `first_layer` to the log-probabilities, through the parent's resident layers."""
        return self.log_probs(self.run_layers(state, first_layer))

    def metric_tensors(self, child_logp: torch.Tensor) -> dict[str, torch.Tensor]:
        """The metrics as 0-d float32 tensors on the device (no host synchronisation)."""
        terms = torch.sub(self.parent_logp, child_logp, out=self._buffer("terms")).mul_(self._parent_probabilities())
        kl = terms.sum(-1).mean()
        lm_loss = -child_logp.gather(-1, self.targets.unsqueeze(-1)).mean()
        agree = (child_logp.argmax(-1) == self.parent_top1).float().mean()
        return {"kl_div": kl, "lm_loss": lm_loss, "top1_agreement": agree}

    def metrics(self, child_logp: torch.Tensor) -> dict[str, float]:
        return {name: value.item() for name, value in self.metric_tensors(child_logp).items()}

    def score(self, state: torch.Tensor) -> dict[str, float]:
        """The metrics of the child whose last decoder layer output `state`."""
        return self.metrics(self.log_probs(state, out=self._buffer("child_logp")))


def replaced_output(block: Subblock, parent_layer, val_in: torch.Tensor, val_mid: torch.Tensor, pos) -> torch.Tensor:
    """The output of a parent layer whose `block.kind` subblock is replaced by `block`.

    `val_in`/`val_mid` are the cached states entering the layer and after its attention; an
    attention block is followed by the parent layer's own FFN.
    """
    if block.kind == "attention":
        state = val_in + block(val_in, pos)
        delta = parent_layer.ffn_delta(state)
        return state if delta is None else state + delta
    return val_mid + block(val_mid)


def replaced_log_probs(tail: ParentTail, block: Subblock, layer_idx: int, val_in: torch.Tensor,
                       val_mid: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities (float32) of the parent with only `block` replaced at `layer_idx`.

    `block` and the cached states are on the parent's device, in its dtype; the parent is resident.
    """
    state = replaced_output(block, tail.model.model.layers[layer_idx], val_in, val_mid, tail.pos)
    return tail.run_from(state, layer_idx + 1)


@torch.inference_mode()
def score_subblock(tail: ParentTail, block: Subblock, layer_idx: int, val_in: torch.Tensor,
                   val_mid: torch.Tensor) -> dict[str, float]:
    """Metrics of the parent with only `block` replaced at `layer_idx`."""
    state = replaced_output(block, tail.model.model.layers[layer_idx], val_in, val_mid, tail.pos)
    return tail.score(tail.run_layers(state, layer_idx + 1))


@torch.inference_mode()
def parent_metrics(tail: ParentTail) -> dict[str, float]:
    return tail.metrics(tail.parent_logp)


# Held-out states in flight at once when replacements share a pass over the parent's tail.
STATE_BUDGET_BYTES = 1 << 30


@dataclass(frozen=True)
class Replacement:
    """One variant to score: its layer and kind, and how to read its block and that layer's cached
    held-out states (`val_in`, `val_mid`), called when the pass reaches the layer."""

    layer: int
    kind: SubblockKind
    load: Callable[[], tuple[Subblock, torch.Tensor, torch.Tensor]]


@torch.inference_mode()
def score_streamed(tail: ParentTail, layers, replacements: Sequence[Replacement], *, state_bytes: int,
                   budget_bytes: int | None = None,
                   progress: Callable[[float], None] | None = None) -> Iterator[tuple[int, dict[str, float]]]:
    """Replace-1-block metrics of many variants, holding one parent layer at a time.

    `layers.hold(j)` gives decoder layer j (a `StreamedParent` reads it from disk). Variants go
    through the tail in passes: a pass takes, in layer order, as many variants as keep their
    held-out states (`state_bytes` each) within `budget_bytes` (default `STATE_BUDGET_BYTES`),
    and walks the layers from the first of them to the last, reading each layer once for the
    whole pass; a variant joins at its own layer. Each variant's state goes through exactly the operations of
    `score_subblock` (never batched with another's), so the metrics are the same bit for bit.
    Yields (index into `replacements`, metrics) at the end of each pass.

    A pass holds back every score until its last layer, so `progress`, when given, is called as the work
    goes: each variant counts 1, shared evenly between its layers and its head, and the amounts add up to
    the number of variants.
    """
    num_layers = tail.model.config.num_hidden_layers
    order = sorted(range(len(replacements)), key=lambda k: replacements[k].layer)
    share = [1.0 / (num_layers - r.layer + 1) for r in replacements]
    report = progress or (lambda amount: None)
    per_pass = max(1, (budget_bytes or STATE_BUDGET_BYTES) // max(1, state_bytes))
    for first in range(0, len(order), per_pass):
        wave = order[first:first + per_pass]
        states: dict[int, torch.Tensor] = {}
        for j in range(replacements[wave[0]].layer, num_layers):
            joining = [k for k in wave if replacements[k].layer == j]
            if not states and not any(replacements[k].kind == "attention" for k in joining):
                # Nothing in flight, and an FFN replacement needs no parent weights at its own layer.
                for k in joining:
                    block, val_in, val_mid = replacements[k].load()
                    states[k] = replaced_output(block, None, val_in, val_mid, tail.pos)
                report(sum(share[k] for k in joining))
                continue
            with layers.hold(j) as layer:
                for k in states:
                    states[k] = layer(states[k], tail.pos)
                for k in joining:
                    block, val_in, val_mid = replacements[k].load()
                    states[k] = replaced_output(block, layer, val_in, val_mid, tail.pos)
            report(sum(share[k] for k in states))
        for k in wave:
            metrics = tail.score(states.pop(k))
            report(share[k])
            yield k, metrics
