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
from mlxkit.engines.training.device import module_device, module_dtype


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


def position_embeddings(parent_model, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin for positions 0..seq_len-1 (every cached sequence starts at 0).

    On the model's device and in its compute dtype, as the full model's forward makes them.
    """
    device, dtype = module_device(parent_model), module_dtype(parent_model)
    positions = torch.arange(seq_len, device=device).unsqueeze(0)
    dummy = torch.zeros(1, seq_len, parent_model.config.hidden_size, device=device, dtype=dtype)
    return parent_model.model.rotary_emb(dummy, position_ids=positions)


def embedded_states(parent_model, splits: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each split's token ids embedded: the residual stream entering layer 0, on the model's device."""
    device = module_device(parent_model)
    return {name: parent_model.model.embed_tokens(ids.to(device)) for name, ids in splits.items()}


def layer_states(layer, states: dict[str, torch.Tensor], pos,
                 batch_sequences: int = 8) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One parent layer over every split: the tensors cached for it (`{split}_in`, `{split}_mid`) and
    the states entering the next layer. Pure tensor math, on the device (and in the dtype) of `states`."""
    tensors, outputs = {}, {}
    for split, h in states.items():
        mids, outs = [], []
        for chunk in h.split(batch_sequences):
            delta = layer.attention_delta(chunk, pos)
            mid = chunk if delta is None else chunk + delta
            delta = layer.ffn_delta(mid)
            mids.append(mid)
            outs.append(mid if delta is None else mid + delta)
        tensors[f"{split}_in"], tensors[f"{split}_mid"] = h, torch.cat(mids)
        outputs[split] = torch.cat(outs)
    return tensors, outputs


@torch.inference_mode()
def cache_states(parent_model, train_ids: torch.Tensor, val_ids: torch.Tensor, root: Path,
                 reporter: Reporter | None = None, batch_sequences: int = 8) -> None:
    """Run the parent once over both splits and write one file per layer (skips if complete).

    The states are computed on the parent's device in its dtype (the compute dtype: an
    inference-only model is held in it) and stored in that dtype.
    """
    reporter = reporter or Reporter()
    layers = parent_model.model.layers
    # final.safetensors is written last, so it marks a complete cache.
    if (root / "final.safetensors").exists() and all(_layer_file(root, i).exists() for i in range(len(layers))):
        return
    root.mkdir(parents=True, exist_ok=True)
    pos = position_embeddings(parent_model, train_ids.shape[1])
    states = embedded_states(parent_model, {"train": train_ids, "val": val_ids})
    for i, layer in enumerate(reporter.track(layers, "caching parent activations")):
        tensors, states = layer_states(layer, states, pos, batch_sequences)
        _save(tensors, _layer_file(root, i))
    _save({f"{s}_out": v for s, v in states.items()}, root / "final.safetensors")


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    with atomic_file(path) as tmp:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp))


def load_layer(root: Path, layer: int, num_layers: int, device: torch.device | str = "cpu") -> LayerStates:
    """The cached states of one layer, with its output (the next layer's input), on `device`."""
    where = str(device)
    here = load_file(str(_layer_file(root, layer)), device=where)
    if layer + 1 < num_layers:
        nxt = load_file(str(_layer_file(root, layer + 1)), device=where)
        train_out, val_out = nxt["train_in"], nxt["val_in"]
    else:
        final = load_file(str(root / "final.safetensors"), device=where)
        train_out, val_out = final["train_out"], final["val_out"]
    return LayerStates(here["train_in"], here["train_mid"], train_out, here["val_in"], here["val_mid"], val_out)


def load_final(root: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    return load_file(str(root / "final.safetensors"), device=str(device))
