"""What each serving engine can build: one declarative entry per engine.

`mlx search --engine NAME` searches only the blocks the engine builds, and refuses up front a
parent the engine cannot hold (its RoPE, its head layout, its architecture). Each entry
cites the engine source it was read from; adding an engine is adding one entry to `ENGINES`.

Widths: the Nemotron-NAS layout stores an FFN width as `ffn_mult`, which every engine that
loads it turns back into a width as ceil_256(int(2·ffn_mult·hidden/3)); only widths that
rule gives back exactly can be served from that layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxkit.engines.errors import InputError
from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant, nas_width_ok
from mlxkit.engines.models.families import sliding_window

# RoPE scalings that vLLM's `get_rope` builds (vllm/model_executor/layers/rotary_embedding/__init__.py).
_VLLM_ROPE = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclass(frozen=True)
class ServingEngine:
    """One engine's capabilities, as far as a Puzzle child is concerned.

    attention / ffn : the block kinds its layer builds (`gqa`/`linear`/`no_op`, `mlp`/`linear`/`no_op`).
    export_format : the `mlx export` layout it loads.
    nas_widths : FFN widths must survive the Nemotron-NAS `ffn_mult` rule.
    rope_types : the RoPE types it builds (None: any that transformers builds).
    head_dim_from_hidden : it derives head_dim as hidden/heads, so a parent with another head_dim cannot load.
    qk_norm : it applies per-head q/k RMSNorms (Qwen3).
    sliding_window : it keeps a sliding attention window from the layout it loads.
    gemma_layers : it builds Gemma's layer features (`gemma_features`).
    needs_attention_layer : a child must keep attention in at least one layer.
    """

    name: str
    title: str
    export_format: str
    attention: frozenset[str]
    ffn: frozenset[str]
    nas_widths: bool
    rope_types: tuple[str, ...] | None
    head_dim_from_hidden: bool
    qk_norm: bool
    sliding_window: bool
    gemma_layers: bool
    needs_attention_layer: bool
    source: str
    serve: str  # how a user starts it on the exported child (EXPORT stands for the exported path)

    def holds_attention(self, variant: AttentionVariant) -> bool:
        return variant.kind in self.attention

    def holds_ffn(self, variant: FFNVariant, hidden_size: int) -> bool:
        if variant.kind not in self.ffn:
            return False
        if variant.kind == "mlp" and self.nas_widths:
            return nas_width_ok(int(variant.intermediate_size), hidden_size)  # type: ignore[arg-type]
        return True

    def ffn_width_problem(self, width: int, hidden_size: int) -> str | None:
        if self.holds_ffn(FFNVariant("mlp", width), hidden_size):
            return None
        return (f"it reads FFN widths from ffn_mult, which gives back only some multiples of 256, and the "
                f"parent's width {width} is not one of them (hidden {hidden_size})")

    def parent_problems(self, config: Any, rope_type: str) -> list[str]:
        """What of the parent (or child) `config` this engine cannot hold; empty if it holds it all."""
        problems = []
        heads, hidden = int(config.num_attention_heads), int(config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        if self.head_dim_from_hidden and head_dim * heads != hidden:
            problems.append(f"it derives head_dim as hidden/heads ({hidden // heads}), and this model's head_dim "
                            f"is {head_dim}")
        if not self.qk_norm and has_qk_norm(config):
            problems.append("its attention has no per-head q/k RMSNorm (Qwen3's q_norm/k_norm)")
        gemma = gemma_features(config)
        if gemma and not self.gemma_layers:
            problems.append(f"its layer has no {', no '.join(gemma)}")
        window = sliding_window(config)
        if window is not None and not self.sliding_window:
            problems.append(f"the layout it loads keeps no sliding attention window (this model's is {window})")
        width = int(getattr(config, "parent_intermediate_size", None) or config.intermediate_size)
        if self.ffn_width_problem(width, hidden):
            problems.append(self.ffn_width_problem(width, hidden))  # type: ignore[arg-type]
        if self.rope_types is not None and rope_type not in self.rope_types:
            problems.append(f"it has no RoPE type '{rope_type}' (it builds {', '.join(self.rope_types)})")
        return problems


def has_qk_norm(config: Any) -> bool:
    """Whether a parent or child config applies per-head q/k norms (Qwen3, or a child converted from one)."""
    return bool(getattr(config, "qk_norm", False)) or getattr(config, "model_type", None) == "qwen3"


def gemma_features(config: Any) -> list[str]:
    """Gemma's features beyond Llama's layer that a parent or child config has, each described."""
    from mlxkit.engines.models import families

    names = ("norm_weight_offset", "embedding_multiplier", "sandwich_norms", "query_pre_attn_scalar",
             "attn_logit_softcapping", "final_logit_softcapping", "hidden_act")
    values = {name: getattr(config, name, None) for name in names}
    if getattr(config, "model_type", None) != "mlx_decilm":
        try:
            values.update(families.family_of(config).fields_for(config))
        except InputError:  # not a family's config: it has only what its fields say
            pass
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    found = []
    if values["norm_weight_offset"]:
        found.append("RMSNorm scaled by (1 + weight)")
    if values["embedding_multiplier"] is not None:
        found.append(f"embedding scale ({values['embedding_multiplier']:g})")
    if values["sandwich_norms"]:
        found.append("norm after each subblock")
    if values["query_pre_attn_scalar"] is not None and float(values["query_pre_attn_scalar"]) != float(head_dim):
        found.append(f"query_pre_attn_scalar ({values['query_pre_attn_scalar']:g}) in place of head_dim")
    if values["attn_logit_softcapping"] is not None:
        found.append("attention soft-capping")
    if values["final_logit_softcapping"] is not None:
        found.append("logit soft-capping")
    if (values["hidden_act"] or "silu") != "silu":
        found.append(f"{values['hidden_act']} FFN gate (SwiGLU's is silu)")
    return found


_NAS_LAYER = frozenset({"gqa", "no_op"}), frozenset({"mlp", "no_op"})

ENGINES: dict[str, ServingEngine] = {engine.name: engine for engine in (
    ServingEngine(
        name="vllm", title="vLLM", export_format="nemotron-nas",
        attention=_NAS_LAYER[0], ffn=_NAS_LAYER[1], nas_widths=True, rope_types=_VLLM_ROPE,
        head_dim_from_hidden=True, qk_norm=False, sliding_window=False, gemma_layers=False,
        needs_attention_layer=True,
        source="vllm/model_executor/models/nemotron_nas.py (vLLM 0.32.0): DeciLMDecoderLayer builds no-op or "
               "LlamaAttention with num_heads // n_heads_in_group KV heads, and no-op or LlamaMLP of width "
               "ceil_256(int(2·ffn_mult·hidden/3)); no linear attention or FFN",
        serve="vllm serve EXPORT --trust-remote-code"),
    ServingEngine(
        name="sglang", title="SGLang", export_format="nemotron-nas",
        attention=_NAS_LAYER[0], ffn=_NAS_LAYER[1], nas_widths=True, rope_types=_VLLM_ROPE,
        head_dim_from_hidden=True, qk_norm=False, sliding_window=False, gemma_layers=False,
        needs_attention_layer=True,
        source="python/sglang/srt/models/nemotron_nas.py (SGLang 0.5.23, read from its wheel): the same layer "
               "kinds and ffn_mult rule as vLLM's; its PyPI package needs CUDA (cuda-python, flashinfer, "
               "sglang-kernel), so it is not run on a CPU",
        serve="python -m sglang.launch_server --model-path EXPORT --trust-remote-code"),
    ServingEngine(
        name="trtllm", title="TensorRT-LLM", export_format="nemotron-nas",
        attention=frozenset({"gqa", "linear", "no_op"}), ffn=frozenset({"mlp", "linear", "no_op"}),
        nas_widths=True, rope_types=("default", "linear", "dynamic", "llama3"),
        head_dim_from_hidden=True, qk_norm=False, sliding_window=False, gemma_layers=False,
        needs_attention_layer=True,
        source="tensorrt_llm/models/nemotron_nas/config.py and convert.py (TensorRT-LLM 0.16+): "
               "AttentionImplementation ATTENTION/LINEAR/NO_OP, FFNImplementation MLP/LINEAR/NO_OP, widths "
               "from ffn_mult by the DeciLM rule; read from source, not run here",
        serve="trtllm-serve EXPORT --trust_remote_code"),
    ServingEngine(
        name="llamacpp", title="llama.cpp", export_format="gguf",
        attention=frozenset({"gqa", "linear", "no_op"}), ffn=frozenset({"mlp", "no_op"}),
        nas_widths=False, rope_types=("default", "linear", "llama3"),
        head_dim_from_hidden=False, qk_norm=False, sliding_window=False, gemma_layers=False,
        needs_attention_layer=True,
        source="src/llama-model.cpp, LLM_ARCH_DECI (llama-cpp-python 0.3.x): per-layer head_count_kv and "
               "feed_forward_length, a zero-KV-head layer for linear attention, no linear FFN; run in the "
               "`llamacpp` tests",
        serve="llama-server -m EXPORT"),
    ServingEngine(
        name="transformers", title="transformers", export_format="hf",
        attention=frozenset({"gqa", "linear", "no_op"}), ffn=frozenset({"mlp", "linear", "no_op"}),
        nas_widths=False, rope_types=None, head_dim_from_hidden=False, qk_norm=True, sliding_window=True,
        gemma_layers=True, needs_attention_layer=False,
        source="the child's own modeling code, shipped with the export (trust_remote_code)",
        serve="AutoModelForCausalLM.from_pretrained(EXPORT, trust_remote_code=True)"),
)}


def get_engine(name: str) -> ServingEngine:
    engine = ENGINES.get(str(name).lower())
    if engine is None:
        raise InputError(f"unknown serving engine '{name}' (expected one of {', '.join(ENGINES)})")
    return engine


def engines_for_format(fmt: str) -> list[ServingEngine]:
    return [engine for engine in ENGINES.values() if engine.export_format == fmt]


def check_engine_holds_parent(engine: ServingEngine, config: Any, rope_type: str) -> None:
    """Refuse, before any work, a model the engine cannot hold; the message names engines that can."""
    problems = engine.parent_problems(config, rope_type)
    if not problems:
        return
    others = [e.name for e in ENGINES.values() if e is not engine and not e.parent_problems(config, rope_type)]
    instead = f"; --engine {' or '.join(others)} can hold it" if others else ""
    raise InputError(f"{engine.title} cannot serve this model: {'; '.join(problems)}{instead}")


def check_engine_format(engine: ServingEngine, fmt: str) -> None:
    """`--export FORMAT` must be the layout the engine loads."""
    if fmt != engine.export_format:
        loaders = ", ".join(e.name for e in engines_for_format(fmt)) or "no listed engine"
        raise InputError(f"--engine {engine.name} loads the {engine.export_format} layout, not {fmt} "
                         f"({fmt} is for {loaders}): use --export {engine.export_format} or --engine "
                         f"{engines_for_format(fmt)[0].name if engines_for_format(fmt) else 'transformers'}")
