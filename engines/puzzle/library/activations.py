"""The parent's residual-stream states at every subblock boundary, computed once and cached.

For each layer i we keep `in` (the layer's input) and `mid` (after its attention
subblock), for the training sequences and the held-out scoring sequences; `final` is
the last layer's output. BLD trains on them and scoring streams from them, so the
parent's earlier layers are never recomputed. Each layer's file is written as soon as the
layer has run, so a killed run resumes at the first layer without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
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
            mids.append(mid)
            outs.append(_ffn_output(layer, mid))
        tensors[f"{split}_in"], tensors[f"{split}_mid"] = h, torch.cat(mids)
        outputs[split] = torch.cat(outs)
    return tensors, outputs


def _ffn_output(layer, mid: torch.Tensor) -> torch.Tensor:
    delta = layer.ffn_delta(mid)
    return mid if delta is None else mid + delta


def layer_outputs(layer, mids: dict[str, torch.Tensor], batch_sequences: int = 8) -> dict[str, torch.Tensor]:
    """The states leaving a layer, from its cached mid-states: its FFN half alone, chunked as
    `layer_states` chunks, so the result is the one `layer_states` returned."""
    # Each chunk is a fresh allocation, as the mid-states `layer_states` fed the FFN were.
    return {split: torch.cat([_ffn_output(layer, chunk.clone()) for chunk in mid.split(batch_sequences)])
            for split, mid in mids.items()}


def finished_layers(root: Path, num_layers: int) -> int:
    """How many leading layers are cached: each layer's file is its completion mark."""
    done = 0
    while done < num_layers and _layer_file(root, done).exists():
        done += 1
    return done


def _holds(path: Path, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether `path` is a whole safetensors file of exactly these tensors and shapes."""
    try:
        with safe_open(str(path), framework="pt") as cached:
            return set(cached.keys()) == set(shapes) and all(
                tuple(cached.get_slice(name).get_shape()) == shape for name, shape in shapes.items())
    except (SafetensorError, OSError):
        return False


def _drop_damaged(root: Path, done: int, num_layers: int, train_ids: torch.Tensor, val_ids: torch.Tensor,
                  hidden: int, reporter: Reporter) -> int:
    """The leading layers whose cached files are whole and of this run's shapes; the files from the first
    damaged one on are removed with a notice, so the run computes them again from the layer before.

    The cache is derived from the parent and the calibration tokens alone (the library's run key
    guards both), so recomputing gives the states the first run had.
    """
    shapes = {f"{split}_{where}": (ids.shape[0], ids.shape[1], hidden)
              for split, ids in (("train", train_ids), ("val", val_ids)) for where in ("in", "mid")}
    final_shapes = {"train_out": shapes["train_in"], "val_out": shapes["val_in"]}
    good = next((i for i in range(done) if not _holds(_layer_file(root, i), shapes)), done)
    final = root / "final.safetensors"
    final_bad = final.exists() and not _holds(final, final_shapes)
    if good == done and not final_bad:
        return done
    where = _layer_file(root, good) if good < done else final
    reporter.notice(f"the cached parent activations at {where} are unreadable or of other shapes; "
                    "computing them again from there")
    for i in range(good, num_layers):
        _layer_file(root, i).unlink(missing_ok=True)
    final.unlink(missing_ok=True)
    return good


@torch.inference_mode()
def cache_states(parent_model, train_ids: torch.Tensor, val_ids: torch.Tensor, root: Path,
                 reporter: Reporter | None = None, batch_sequences: int = 8, layers=None) -> None:
    """Run the parent over both splits and write one file per layer, resuming after the last layer cached.

    `layers` gives the parent's decoder layers one at a time (`hold(i)`: a `StreamedParent` reads
    each from disk only while it runs); by default they are `parent_model`'s own. The states
    are computed on the parent's device in its dtype (the compute dtype: an inference-only model
    is held in it) and stored in that dtype.

    A killed run restarts at the first layer without a file. The last cached layer's output is
    not stored (the next layer's file would hold it, as its input), so it is recomputed from that
    layer's cached mid-states by its FFN half alone: exactly the states the first run had, at the
    cost of one FFN, where storing each output twice would add half again to the cache's writes.
    """
    from mlxkit.engines.models.decilm.convert import ResidentParent

    reporter = reporter or Reporter()
    layers = layers if layers is not None else ResidentParent(parent_model)
    num_layers = parent_model.config.num_hidden_layers
    done = _drop_damaged(root, finished_layers(root, num_layers), num_layers, train_ids, val_ids,
                         parent_model.config.hidden_size, reporter)
    # final.safetensors is written last, so it marks a complete cache.
    if done == num_layers and (root / "final.safetensors").exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    pos = position_embeddings(parent_model, train_ids.shape[1])
    if done == 0:
        states = embedded_states(parent_model, {"train": train_ids, "val": val_ids})
    else:
        cached = load_file(str(_layer_file(root, done - 1)), device=str(module_device(parent_model)))
        with layers.hold(done - 1) as layer:
            states = layer_outputs(layer, {"train": cached["train_mid"], "val": cached["val_mid"]}, batch_sequences)
        del cached
    for i in reporter.track(range(done, num_layers), "caching parent activations"):
        with layers.hold(i) as layer:
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


def load_val_states(root: Path, layer: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out states entering layer `layer` and after its attention (`val_in`, `val_mid`), on
    `device`: all that scoring reads, without the training split."""
    with safe_open(str(_layer_file(root, layer)), framework="pt", device=str(device)) as cached:
        return cached.get_tensor("val_in"), cached.get_tensor("val_mid")
