"""Plan an export: read the model's config and shard headers (no tensor data), check the format can hold it.

A model to export is a local HF directory: a Puzzle child (`model_type="mlx_decilm"`) or a
Llama-family parent, which is described by its uniform child config (every layer at the
parent's shape), so every writer sees one layer list. Each format's limits are checked here,
before any output exists, and a refusal names every layer it concerns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError
from mlxkit.engines.export.description import ExportPlan, Layer, ModelDescription, Rope, layer_list
from mlxkit.engines.export.gguf_layers import plan_gguf_layers
from mlxkit.engines.io.lazy_loader import ShardedTensorIndex
from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant, nas_width_ok

ExportFormat = Literal["gguf", "nemotron-nas", "hf"]
FORMATS: tuple[str, ...] = ("gguf", "nemotron-nas", "hf")
# How the weights are written: an encoding of the file, not a compute dtype.
ENCODINGS: tuple[str, ...] = ("f32", "f16", "q8_0")
# Nemotron-NAS stores an FFN width as ffn_mult, read back as ceil_256(int(2·mult·hidden/3)):
# only multiples of 256 come back exactly.
NAS_WIDTH_MULTIPLE = 256
# Tensors a checkpoint may carry that no format needs (buffers some older savers kept).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
ROPE_TYPES_GGUF = ("default", "linear", "llama3")


def describe_model(spec: str, reporter: Reporter | None = None) -> ModelDescription:
    """Read config.json and the shard headers of a local model; check every tensor has its place."""
    import json

    from mlxkit.engines.models.decilm.convert import child_config
    from mlxkit.engines.models.loading import load_config, resolve_spec

    source = resolve_spec(spec, reporter)
    if source.kind not in ("directory", "alias") or source.path is None:
        raise InputError(f"export reads a local HF directory (or the alias smollm2-135m); '{spec}' is a "
                         f"{source.kind}: load and save it first (e.g. `mlx fetch`)")
    directory = source.path
    source_config = json.loads((directory / "config.json").read_text())
    config = load_config(str(directory))
    is_child = config.model_type == "mlx_decilm"
    if not is_child:
        config = child_config(config)  # checks the family (Llama-shaped) and gives the uniform layer list
    layers = tuple(Layer(i, AttentionVariant.from_block_config(b["attention"], config.num_attention_heads),
                         FFNVariant.from_block_config(b["ffn"], config.hidden_size))
                   for i, b in enumerate(config.block_configs))
    rope = rope_of(config)
    index = ShardedTensorIndex.from_path(directory)
    expected, optional = _expected_tensors(config, layers)
    _check_tensors(directory, index, expected, optional, tied=bool(config.tie_word_embeddings))
    return ModelDescription(spec, directory, config, source_config, is_child, layers, rope, index, expected,
                            frozenset(optional))


def rope_of(config) -> Rope:
    """RoPE from `rope_parameters` (transformers 5), the only place a child's config.json keeps it.

    A top-level `rope_theta` is what transformers 4 wrote; AutoConfig folds it into
    `rope_parameters`, so reading the dict covers both (a wrong theta still loads and runs,
    just with worse agreement, so it must not fall back to a default silently).
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = dict(params["full_attention"])
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise InputError("the model's config has no RoPE theta (rope_parameters.rope_theta)")
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    return Rope(rope_type, float(theta), params)


def _expected_tensors(config, layers: tuple[Layer, ...]) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Every tensor name (the public DeciLM / Llama names) and shape the layer list implies."""
    h, v, hd, heads = config.hidden_size, config.vocab_size, config.head_dim, config.num_attention_heads
    expected: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    optional: set[str] = set()
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = (v, h)
    for layer in layers:
        p = f"model.layers.{layer.index}."
        att, ffn = layer.attention, layer.ffn
        if att.kind != "no_op":
            expected[p + "input_layernorm.weight"] = (h,)
        if att.kind != "no_op" and getattr(config, "sandwich_norms", False):
            expected[p + "attention_output_norm.weight"] = (h,)
        if att.kind == "linear":
            expected[p + "self_attn.linear_attn.weight"] = (h, h)
        elif att.kind == "gqa":
            kv = att.n_kv_heads * hd  # type: ignore[operator]
            shapes = {"q_proj": (heads * hd, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, heads * hd)}
            for name, shape in shapes.items():
                expected[f"{p}self_attn.{name}.weight"] = shape
                if config.attention_bias:
                    expected[f"{p}self_attn.{name}.bias"] = (shape[0],)
            if config.attention_bias:
                # Qwen2 parents have q/k/v biases and no o bias; a missing one reads as zeros.
                optional.add(f"{p}self_attn.o_proj.bias")
            if getattr(config, "qk_norm", False):
                expected[f"{p}self_attn.q_norm.weight"] = (hd,)
                expected[f"{p}self_attn.k_norm.weight"] = (hd,)
        if ffn.kind != "no_op":
            expected[p + "post_attention_layernorm.weight"] = (h,)
        if ffn.kind != "no_op" and getattr(config, "sandwich_norms", False):
            expected[p + "ffn_output_norm.weight"] = (h,)
        if ffn.kind == "linear":
            expected[p + "mlp.linear_mlp.weight"] = (h, h)
        elif ffn.kind == "mlp":
            w = ffn.intermediate_size
            for name, shape in {"gate_proj": (w, h), "up_proj": (w, h), "down_proj": (h, w)}.items():
                expected[f"{p}mlp.{name}.weight"] = shape
                if config.mlp_bias:
                    expected[f"{p}mlp.{name}.bias"] = (shape[0],)
    return expected, optional


def _check_tensors(directory: Path, index: ShardedTensorIndex, expected: dict[str, tuple[int, ...]],
                   optional: set[str], tied: bool) -> None:
    missing = [n for n in expected if n not in index and n not in optional]
    extra = [n for n in index if n not in expected and not n.endswith(_IGNORED_SUFFIXES)
             and not (tied and n == "lm_head.weight")]
    wrong = [f"{n} {tuple(index.tensors[n].shape)} (config says {expected[n]})" for n in expected
             if n in index and tuple(index.tensors[n].shape) != expected[n]]
    problems = []
    if missing:
        problems.append(f"missing {_some(missing)}")
    if extra:
        problems.append(f"tensors with no place in the DeciLM/Llama layout: {_some(extra)}")
    if wrong:
        problems.append(f"wrong shapes: {_some(wrong)}")
    if problems:
        raise InputError(f"'{directory}' does not match its config: " + "; ".join(problems))


def _some(items: list[str], limit: int = 6) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def ffn_expressible(fmt: str, ffn: FFNVariant, hidden_size: int) -> bool:
    """Whether `fmt` can hold an FFN of this variant (`mlx search --export` searches only these)."""
    if fmt == "gguf":
        return ffn.kind != "linear"  # llama.cpp's deci graph has no linear FFN
    if fmt == "nemotron-nas":
        return ffn.kind != "mlp" or nas_width_ok(ffn.intermediate_size, hidden_size)  # type: ignore[arg-type]
    return True


def check_options(fmt: str, encoding: str) -> None:
    """The format and encoding on their own, before any file is read."""
    if fmt not in FORMATS:
        raise InputError(f"unknown export format '{fmt}' (expected one of {', '.join(FORMATS)})")
    if encoding not in ENCODINGS:
        raise InputError(f"unknown encoding '{encoding}' (expected one of {', '.join(ENCODINGS)})")
    if encoding == "q8_0" and fmt != "gguf":
        raise InputError("q8_0 is a GGUF type; HF formats take f32 or f16")


def check_format(model: ModelDescription, fmt: str, encoding: str) -> list[str]:
    """Refuse what `fmt` cannot hold (typed error naming the layers); return notes on how it is held."""
    check_options(fmt, encoding)
    notes: list[str] = []
    if fmt in ("gguf", "nemotron-nas"):
        _refuse_family_features(model, fmt)
    if fmt == "gguf":
        linear_ffn = [l.index for l in model.layers if not ffn_expressible(fmt, l.ffn, model.hidden_size)]
        if linear_ffn:
            raise InputError(f"llama.cpp's deci architecture has no linear FFN; layers {layer_list(linear_ffn)} "
                             "use one (search with `--export gguf` or `ffn_linear: false` in the recipe, "
                             "or export to nemotron-nas/hf)")
        if not any(l.attention.kind == "gqa" for l in model.layers):
            raise InputError("llama.cpp's deci architecture needs at least one layer with attention")
        if model.rope.rope_type not in ROPE_TYPES_GGUF:
            raise InputError(f"RoPE type '{model.rope.rope_type}' has no GGUF export here "
                             f"(supported: {', '.join(ROPE_TYPES_GGUF)})")
    if fmt == "nemotron-nas":
        h = model.hidden_size
        if model.head_dim * model.num_heads != h:
            raise InputError(f"Nemotron-NAS derives head_dim as hidden/heads ({h // model.num_heads}); "
                             f"this model's head_dim is {model.head_dim}")
        bad = [f"{l.index} (width {l.ffn.intermediate_size})" for l in model.layers
               if not ffn_expressible(fmt, l.ffn, h)]
        if bad:
            raise InputError(f"Nemotron-NAS stores FFN widths as ffn_mult, which reads back as a multiple of "
                             f"{NAS_WIDTH_MULTIPLE}; layers {', '.join(bad)} cannot be expressed exactly "
                             f"(search with `--export nemotron-nas` or `width_multiple: {NAS_WIDTH_MULTIPLE}` "
                             "in the recipe, or export to hf)")
        if model.config.attention_bias and any(n not in model.index for n in model.optional):
            notes.append("o_proj.bias absent in the source; written as zeros (the layout has one bias flag)")
        notes += _engine_notes(model)
    return notes


def _refuse_family_features(model: ModelDescription, fmt: str) -> None:
    """Neither llama.cpp's deci graph nor the Nemotron-NAS layout has q/k norms, a sliding window or Gemma's
    layer features."""
    from mlxkit.engines.models.families import sliding_window
    from mlxkit.engines.serving.capabilities import gemma_features, has_qk_norm

    missing = []
    if has_qk_norm(model.config):
        missing.append("per-head q/k RMSNorms (Qwen3's q_norm/k_norm)")
    missing += gemma_features(model.config)
    window = sliding_window(model.config)
    if window is not None:
        missing.append(f"sliding attention window (this model's is {window})")
    if missing:
        raise InputError(f"the {fmt} layout has no {' and no '.join(missing)}; export to hf, which holds them")


def _engine_notes(model: ModelDescription) -> list[str]:
    """Which engines that load the Nemotron-NAS layout cannot build this model, and why."""
    from mlxkit.engines.serving.capabilities import engines_for_format

    notes = []
    for engine in engines_for_format("nemotron-nas"):
        problems = engine.parent_problems(model.config, model.rope.rope_type)
        linear = [l.index for l in model.layers if not engine.holds_attention(l.attention)
                  or (l.ffn.kind == "linear" and "linear" not in engine.ffn)]
        if linear:
            problems.append(f"it builds no linear attention or FFN (layers {layer_list(linear)})")
        if problems:
            notes.append(f"{engine.title} cannot serve this export: {'; '.join(problems)}")
    return notes


def check_out(out: Path, fmt: str, overwrite: bool) -> Path:
    out = Path(out).expanduser().resolve()
    if fmt == "gguf":
        if out.suffix != ".gguf":
            raise InputError(f"--out for a GGUF export is a file ending in .gguf; got '{out}'")
        if out.is_dir():
            raise InputError(f"output '{out}' is a directory")
    elif out.exists() and not out.is_dir():
        raise InputError(f"output '{out}' exists and is not a directory")
    if out.exists() and not overwrite:
        raise InputError(f"output '{out}' already exists (pass --overwrite to replace it)")
    return out


def plan_export(spec: str, fmt: str, out: str | Path, encoding: str = "f32", *, overwrite: bool = False,
                reporter: Reporter | None = None) -> ExportPlan:
    """Everything checked, nothing written: the output path, the model, the per-format encoding."""
    check_options(fmt, encoding)
    out_path = check_out(Path(out), fmt, overwrite)
    return _plan(spec, fmt, encoding, out_path, reporter)


def check_exportable(spec: str, fmt: str, encoding: str = "f32", reporter: Reporter | None = None) -> None:
    """Raise what `plan_export` would raise for this model, whatever the output path.

    `mlx search --export` checks the parent with it before any work: a tokenizer or RoPE the
    format cannot hold is the parent's, and the child would inherit it.
    """
    check_options(fmt, encoding)
    _plan(spec, fmt, encoding, Path(f"unwritten.{fmt}"), reporter)


def _plan(spec: str, fmt: str, encoding: str, out_path: Path, reporter: Reporter | None) -> ExportPlan:
    model = describe_model(spec, reporter)
    notes = check_format(model, fmt, encoding)
    if fmt != "gguf":
        return ExportPlan(model, fmt, encoding, out_path, notes)
    from mlxkit.engines.export.gguf_vocab import build_vocab

    gguf_layers, layer_notes = plan_gguf_layers(model)
    vocab = build_vocab(model.directory, model.vocab_size)
    return ExportPlan(model, fmt, encoding, out_path, notes + layer_notes + [f"tokenizer: {vocab.source}"],
                      tuple(gguf_layers), vocab)
