"""The parent's residual-stream states at every subblock boundary, computed once and cached.

For each layer i we keep `in` (the layer's input) and `mid` (after its attention
subblock), for the training sequences and the held-out scoring sequences; `final` is
the last layer's output. BLD trains on them and scoring streams from them, so the
parent's earlier layers are never recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mlxkit.engines.core.atomic import atomic_file
from mlxkit.engines.core.progress import Reporter


@dataclass
class LayerStates:
    train_in: torch.Tensor
    train_mid: torch.Tensor
    train_out: torch.Tensor
    val_in: torch.Tensor
    val_mid: torch.Tensor
    val_out: torch.Tensor


def _layer_file(root: Path, layer: int) -> Path:
    return root / f"layer{layer:03d}.safetensors"


def position_embeddings(parent_model, seq_len: int):
    """RoPE cos/sin for positions 0..seq_len-1 (every cached sequence starts at 0)."""
    positions = torch.arange(seq_len).unsqueeze(0)
    dummy = torch.zeros(1, seq_len, parent_model.config.hidden_size)
    return parent_model.model.rotary_emb(dummy, position_ids=positions)


@torch.inference_mode()
def cache_states(parent_model, train_ids: torch.Tensor, val_ids: torch.Tensor, root: Path,
                 reporter: Reporter | None = None, batch_sequences: int = 8) -> None:
    """Run the parent once over both splits and write one file per layer (skips if complete)."""
    reporter = reporter or Reporter()
    layers = parent_model.model.layers
    # final.safetensors is written last, so it marks a complete cache.
    if (root / "final.safetensors").exists() and all(_layer_file(root, i).exists() for i in range(len(layers))):
        return
    root.mkdir(parents=True, exist_ok=True)
    pos = position_embeddings(parent_model, train_ids.shape[1])
    states = {"train": parent_model.model.embed_tokens(train_ids), "val": parent_model.model.embed_tokens(val_ids)}
    for i, layer in enumerate(reporter.track(layers, "caching parent activations")):
        tensors = {}
        for split, h in states.items():
            mids, outs = [], []
            for chunk in h.split(batch_sequences):
                delta = layer.attention_delta(chunk, pos)
                mid = chunk if delta is None else chunk + delta
                delta = layer.ffn_delta(mid)
                mids.append(mid)
                outs.append(mid if delta is None else mid + delta)
            tensors[f"{split}_in"], tensors[f"{split}_mid"] = h, torch.cat(mids)
            states[split] = torch.cat(outs)
        with atomic_file(_layer_file(root, i)) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    with atomic_file(root / "final.safetensors") as tmp:
        save_file({f"{s}_out": v.contiguous() for s, v in states.items()}, str(tmp))


def load_layer(root: Path, layer: int, num_layers: int) -> LayerStates:
    """The cached states of one layer, with its output (the next layer's input)."""
    here = load_file(str(_layer_file(root, layer)))
    if layer + 1 < num_layers:
        nxt = load_file(str(_layer_file(root, layer + 1)))
        train_out, val_out = nxt["train_in"], nxt["val_in"]
    else:
        final = load_file(str(root / "final.safetensors"))
        train_out, val_out = final["train_out"], final["val_out"]
    return LayerStates(here["train_in"], here["train_mid"], train_out, here["val_in"], here["val_mid"], val_out)


def load_final(root: Path) -> dict[str, torch.Tensor]:
    return load_file(str(root / "final.safetensors"))
