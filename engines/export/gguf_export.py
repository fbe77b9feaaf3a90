"""Write a model as one GGUF for llama.cpp's `deci` architecture (Nemotron-NAS), tensor by tensor.

What llama.cpp's deci loader and graph expect (src/models/deci.cpp):

* per-layer arrays `deci.attention.head_count`, `deci.attention.head_count_kv` and
  `deci.feed_forward_length`: a layer with 0 heads has no attention (its input passes on); one
  with heads but 0 KV heads is "linear attention", only `attn_norm` and an n_embd x n_embd
  `attn_output`; a layer with FFN length 0 has no FFN;
* q/k weights in GGML's RoPE layout (the HF halves interleaved per head, as its converter does);
* `output.weight` may be absent, then the token embedding is used (tied embeddings).

Two graph details make a literal encoding unfaithful, so those layers are encoded differently
(every such layer is listed in the notes, and both encodings add exactly zero):

* the graph `continue`s on a layer with FFN length 0 *before* adding the attention output to
  the residual, so an attention layer without FFN would lose its attention. Such a layer gets
  a width-1 FFN whose weights are zero (SiLU(0)·0 = 0, then ·0);
  the last layer needs the same when it has no FFN: the rows for the requested outputs are only
  selected inside a layer that runs to its end.
* head_dim and n_rot are read only when layer 0 has heads, so an attention-free layer 0 in a
  model with attention elsewhere would leave every attention layer with head size 0. That
  layer 0 becomes a linear-attention layer whose output weight is zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError
from mlxkit.engines.export.description import ExportPlan, ModelDescription
from mlxkit.engines.io.lazy_loader import LazyTensorLoader

ARCH = "deci"


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]   # numpy (= torch) order; GGUF stores it reversed
    qtype: Any               # gguf.GGMLQuantizationType
    load: Callable[[], np.ndarray]  # float32 data in `shape`


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half RoPE layout -> GGML's adjacent pairs, per head (llama.cpp's converter does the same)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _qtype(shape: tuple[int, ...], encoding: str):
    """llama.cpp's converter rule: 1-D tensors stay F32; q8_0 falls back to F16 where rows don't fit its blocks.

    Returns the type and whether it is such a fallback.
    """
    from gguf import GGMLQuantizationType as Q
    from gguf.constants import GGML_QUANT_SIZES

    if len(shape) == 1 or encoding == "f32":
        return Q.F32, False
    if encoding == "f16":
        return Q.F16, False
    if shape[-1] % GGML_QUANT_SIZES[Q.Q8_0][0]:
        return Q.F16, True
    return Q.Q8_0, False


def _llama3_rope_factors(model: ModelDescription) -> np.ndarray:
    """Per-frequency divisors of Llama 3's RoPE scaling, as llama.cpp's converter computes `rope_freqs`."""
    p = model.rope.parameters
    dim, base = model.head_dim, model.rope.theta
    factor = float(p.get("factor", 8.0))
    low, high = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old = float(p.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def gguf_tensors(plan: ExportPlan, loader: LazyTensorLoader) -> tuple[list[GGUFTensor], list[str]]:
    """The GGUF tensors in writing order, each with a loader; nothing is read yet."""
    model, encoding = plan.model, plan.encoding
    h, heads = model.hidden_size, model.num_heads
    fallbacks: list[str] = []
    tensors: list[GGUFTensor] = []

    def read(name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None) -> Callable[[], np.ndarray]:
        def load() -> np.ndarray:
            data = loader.get_tensor(name).float().numpy()
            return transform(data) if transform is not None else data
        return load

    def const(shape: tuple[int, ...], value: float) -> Callable[[], np.ndarray]:
        return lambda: np.full(shape, value, dtype=np.float32)

    def add(name: str, shape: tuple[int, ...], load: Callable[[], np.ndarray], stand_in: bool = False) -> None:
        qtype, fell_back = _qtype(shape, encoding)
        if fell_back and not stand_in:  # the constant stand-ins are exact in any type; not worth a note
            fallbacks.append(name)
        tensors.append(GGUFTensor(name, shape, qtype, load))

    def source(name: str, gguf_name: str, transform=None) -> None:
        if name in model.index:
            add(gguf_name, model.expected[name], read(name, transform))

    add("token_embd.weight", model.expected["model.embed_tokens.weight"], read("model.embed_tokens.weight"))
    if model.rope.rope_type == "llama3":
        factors = _llama3_rope_factors(model)
        add("rope_freqs.weight", factors.shape, lambda: factors)
    for layer, enc in zip(model.layers, plan.gguf_layers):
        p, b = f"model.layers.{layer.index}.", f"blk.{layer.index}."
        if enc.attention in ("gqa", "linear"):
            source(p + "input_layernorm.weight", b + "attn_norm.weight")
        if enc.attention == "gqa":
            n_kv = enc.n_head_kv
            source(p + "self_attn.q_proj.weight", b + "attn_q.weight", lambda w: _permute(w, heads))
            source(p + "self_attn.k_proj.weight", b + "attn_k.weight", lambda w, n=n_kv: _permute(w, n))
            source(p + "self_attn.v_proj.weight", b + "attn_v.weight")
            source(p + "self_attn.o_proj.weight", b + "attn_output.weight")
            source(p + "self_attn.q_proj.bias", b + "attn_q.bias", lambda w: _permute(w, heads))
            source(p + "self_attn.k_proj.bias", b + "attn_k.bias", lambda w, n=n_kv: _permute(w, n))
            source(p + "self_attn.v_proj.bias", b + "attn_v.bias")
            source(p + "self_attn.o_proj.bias", b + "attn_output.bias")
        elif enc.attention == "linear":
            source(p + "self_attn.linear_attn.weight", b + "attn_output.weight")
        elif enc.attention == "zero":
            add(b + "attn_norm.weight", (h,), const((h,), 1.0), stand_in=True)
            add(b + "attn_output.weight", (h, h), const((h, h), 0.0), stand_in=True)
        if enc.ffn == "mlp":
            source(p + "post_attention_layernorm.weight", b + "ffn_norm.weight")
            source(p + "mlp.gate_proj.weight", b + "ffn_gate.weight")
            source(p + "mlp.up_proj.weight", b + "ffn_up.weight")
            source(p + "mlp.down_proj.weight", b + "ffn_down.weight")
            source(p + "mlp.gate_proj.bias", b + "ffn_gate.bias")
            source(p + "mlp.up_proj.bias", b + "ffn_up.bias")
            source(p + "mlp.down_proj.bias", b + "ffn_down.bias")
        elif enc.ffn == "zero":
            w = enc.n_ff
            add(b + "ffn_norm.weight", (h,), const((h,), 1.0), stand_in=True)
            add(b + "ffn_gate.weight", (w, h), const((w, h), 0.0), stand_in=True)
            add(b + "ffn_up.weight", (w, h), const((w, h), 0.0), stand_in=True)
            add(b + "ffn_down.weight", (h, w), const((h, w), 0.0), stand_in=True)
    add("output_norm.weight", (h,), read("model.norm.weight"))
    if not model.tied:  # llama.cpp falls back to token_embd when output.weight is absent
        add("output.weight", model.expected["lm_head.weight"], read("lm_head.weight"))
    notes = [f"q8_0: {len(fallbacks)} tensors whose rows are not a multiple of 32 are F16 "
             f"({', '.join(fallbacks[:4])}{', ...' if len(fallbacks) > 4 else ''})"] if fallbacks else []
    return tensors, notes


def _file_type(encoding: str) -> int:
    from gguf import LlamaFileType

    return {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "q8_0": LlamaFileType.MOSTLY_Q8_0}[encoding]


def _add_metadata(writer, plan: ExportPlan, name: str) -> None:
    import gguf

    model, config = plan.model, plan.model.config
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_block_count(len(model.layers))
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(model.hidden_size)
    writer.add_feed_forward_length([l.n_ff for l in plan.gguf_layers])
    writer.add_head_count([l.n_head for l in plan.gguf_layers])
    writer.add_head_count_kv([l.n_head_kv for l in plan.gguf_layers])
    writer.add_key_length(model.head_dim)
    writer.add_value_length(model.head_dim)
    writer.add_rope_dimension_count(model.head_dim)
    writer.add_rope_freq_base(model.rope.theta)
    if model.rope.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(model.rope.parameters["factor"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(model.vocab_size)
    writer.add_file_type(_file_type(plan.encoding))
    if plan.encoding == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    plan.vocab.add_to(writer)


def write_gguf(plan: ExportPlan, path: Path, name: str, reporter: Reporter) -> dict:
    """Write the GGUF at `path` (a temporary file the caller renames): header, metadata, then one tensor at a time."""
    import gguf

    with LazyTensorLoader(plan.model.index) as loader:
        tensors, notes = gguf_tensors(plan, loader)
        writer = gguf.GGUFWriter(path, ARCH)
        try:
            total = _write(writer, plan, tensors, path, name, reporter)
        finally:
            writer.close()
    return {"tensors": len(tensors), "tensor_bytes": total, "notes": notes}


def _write(writer, plan: ExportPlan, tensors: list[GGUFTensor], path: Path, name: str, reporter: Reporter) -> int:
    """Tensor infos first (shapes and types are known from the plan), then each tensor as it is read."""
    import gguf

    Q = gguf.GGMLQuantizationType
    _add_metadata(writer, plan, name)
    for t in tensors:
        if t.qtype in (Q.F32, Q.F16):
            np_dtype = np.dtype(np.float32 if t.qtype == Q.F32 else np.float16)
            writer.add_tensor_info(t.name, t.shape, np_dtype, int(np.prod(t.shape)) * np_dtype.itemsize)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(t.shape, t.qtype)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), t.qtype)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = 0
    for t in reporter.track(tensors, "writing GGUF tensors", total=len(tensors)):
        data = t.load()
        if tuple(data.shape) != t.shape:
            raise InputError(f"tensor {t.name}: read shape {tuple(data.shape)}, planned {t.shape}")
        if not np.isfinite(data).all():
            raise InputError(f"tensor {t.name} holds NaN or infinite values")
        out = gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), t.qtype)
        writer.write_tensor_data(out)
        total += out.nbytes
    return total
