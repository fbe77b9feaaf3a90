"""How each layer of a model is written to llama.cpp's `deci` GGUF: its per-layer head and FFN counts, and
what fills a subblock llama.cpp cannot leave out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mlxkit.engines.export.description import ModelDescription, layer_list

# llama.cpp skips the rest of a layer whose FFN length is 0, so a removed FFN is written 1 wide, all zeros.
ZERO_FFN_WIDTH = 1


@dataclass(frozen=True)
class GGUFLayer:
    """How one layer is written: llama.cpp's per-layer counts and what fills them."""

    n_head: int
    n_head_kv: int
    n_ff: int
    attention: Literal["gqa", "linear", "zero", "none"]  # "zero": linear attention with a zero output weight
    ffn: Literal["mlp", "zero", "none"]                  # "zero": a width-1 FFN with zero weights


def plan_gguf_layers(model: ModelDescription) -> tuple[list[GGUFLayer], list[str]]:
    heads = model.num_heads
    last = len(model.layers) - 1
    layers: list[GGUFLayer] = []
    zero_ffn, zero_attention = [], []
    for layer in model.layers:
        att, ffn = layer.attention, layer.ffn
        if att.kind == "gqa":
            n_head, n_kv, att_enc = heads, int(att.n_kv_heads), "gqa"  # type: ignore[arg-type]
        elif att.kind == "linear":
            n_head, n_kv, att_enc = heads, 0, "linear"
        elif layer.index == 0:
            n_head, n_kv, att_enc = heads, 0, "zero"
            zero_attention.append(layer.index)
        else:
            n_head, n_kv, att_enc = 0, 0, "none"
        if ffn.kind == "mlp":
            n_ff, ffn_enc = int(ffn.intermediate_size), "mlp"  # type: ignore[arg-type]
        elif att.kind != "no_op" or layer.index == last:
            n_ff, ffn_enc = ZERO_FFN_WIDTH, "zero"
            zero_ffn.append(layer.index)
        else:  # an empty layer: llama.cpp skips it whole, which is exactly right
            n_ff, ffn_enc = 0, "none"
        layers.append(GGUFLayer(n_head, n_kv, n_ff, att_enc, ffn_enc))  # type: ignore[arg-type]
    notes = []
    if zero_ffn:
        notes.append(f"layers {layer_list(zero_ffn)} have no FFN; written with a zero FFN of width "
                     f"{ZERO_FFN_WIDTH}, because llama.cpp's deci graph skips the rest of a layer (its attention "
                     "or the last layer's output rows) when the FFN length is 0")
    if zero_attention:
        notes.append("layer 0 has no attention; written as linear attention with a zero output weight, because "
                     "llama.cpp reads the head size from layer 0's head count")
    return layers, notes
