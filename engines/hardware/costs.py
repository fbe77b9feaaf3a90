"""Analytic cost model of Puzzle block variants on a hardware profile.

Every attention and FFN variant is priced from its shapes alone (`ParentShape` plus the
variant), so a 70B search space can be planned from a `config.json` before any weight is
downloaded. The model is a per-op roofline:

    op time = max(C, M) + (1 - overlap) · min(C, M) + kernels · overhead
    C = FLOPs / (peak · eff_compute),  M = bytes / (bandwidth · eff_memory)

(`overlap` = 1 is the classic roofline, right for GPUs; a single CPU core overlaps less)

with two ops per attention subblock (the projections, and the attention core that reads
the KV cache) and one per FFN. A deployment `Scenario` runs one prefill of `input_len`
tokens for `batch` sequences and then `output_len - 1` decode steps (the prefill already
yields the first output token, as in `generate`), each decode step at its own context
length, so KV reads and attention FLOPs grow step by step.

Conventions (the NVlabs/puzzle demo library's, so the two libraries compare directly)
-------------------------------------------------------------------------------------
* `runtime_ms` of a subblock: its share of one whole scenario (prefill + all decode steps)
  for one batch.
* `memory_mib`: weights plus the KV cache for `batch × (input_len + output_len)` tokens.
* Throughput: `batch × (input_len + output_len)` tokens over the total runtime, i.e. prompt
  and generated tokens both count, as the demo does (256 × 1200 tokens per measurement).
  ModelOpt counts generated tokens only; `ModelCost.generated_tokens_per_s` gives that.
* Embeddings, the final norm, the LM head, activation workspace and the per-step framework
  overhead are non-block costs, charged once per model (`CostModel.non_block()`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Literal, Sequence

import numpy as np

from mlxkit.engines.hardware.profile import HardwareProfile
from mlxkit.engines.hardware.scenario import DTYPE_BYTES, Scenario
from mlxkit.engines.models.decilm.blocks import (AttentionVariant, BlockChoice, FFNVariant, ParentShape,
                                                 parent_attention, parent_ffn)

MIB = float(1 << 20)
# Tokens whose activations are live at once during prefill (chunked prefill; vLLM's
# max_num_batched_tokens is of this order). Only sizes the workspace term.
PREFILL_CHUNK_TOKENS = 8192

# Kernel launches (GPU engines) per subblock forward; a profile may override them, e.g. the
# cpu profile counts PyTorch eager ops, which is what its per-kernel overhead was fitted on.
DEFAULT_KERNELS: dict[str, int] = {
    "gqa": 8,            # norm, fused qkv, rope, kv-cache write, attention, o_proj, residual
    "linear_attention": 3,
    "mlp": 5,            # norm, fused gate/up, activation·mul, down, residual
    "linear_ffn": 3,
    "non_block": 4,      # embedding, final norm, LM head, sampling
}


# --------------------------------------------------------------------------- op-level roofline

@dataclass(frozen=True)
class _Op:
    """Work of one op (or a group of ops priced together) for one forward step."""

    flops: float = 0.0
    bytes: float = 0.0
    compute: Literal["matmul", "attention"] = "matmul"
    dtype: str = "bf16"  # selects the peak rate
    kernels: int = 0
    rows: float = math.inf  # tokens per matmul (M); skinny matmuls are less efficient
    weight_bytes: float = 0.0  # the part of `bytes` that is weights (re-read when a GEMM packs them)


@dataclass(frozen=True)
class SubblockCost:
    """Predicted cost of one subblock (or of the non-block part) in one scenario."""

    name: str
    kind: Literal["attention", "ffn", "non_block"]
    num_params: int
    weights_mib: float
    kv_cache_mib: float
    workspace_mib: float
    prefill_runtime_ms: float
    decode_runtime_ms: float
    decode_steps: int
    num_kv_heads: int | None = None
    ffn_intermediate_size: int | None = None

    @property
    def memory_mib(self) -> float:
        return self.weights_mib + self.kv_cache_mib + self.workspace_mib

    @property
    def runtime_ms(self) -> float:
        return self.prefill_runtime_ms + self.decode_runtime_ms

    @property
    def decode_step_ms(self) -> float:
        """Mean time of one decode step over the scenario's growing context."""
        return self.decode_runtime_ms / self.decode_steps if self.decode_steps else 0.0

    def stats(self) -> dict[str, Any]:
        """Stats in the NVlabs/puzzle demo vocabulary, plus the prefill/decode split."""
        out: dict[str, Any] = {
            "memory_mib": self.memory_mib,
            "runtime_ms": self.runtime_ms,
            "num_params": self.num_params,
            "prefill_runtime_ms": self.prefill_runtime_ms,
            "decode_step_ms": self.decode_step_ms,
            "weights_mib": self.weights_mib,
            "kv_cache_mib": self.kv_cache_mib,
        }
        if self.kind == "attention":
            out["num_kv_heads"] = self.num_kv_heads or 0
        elif self.kind == "ffn":
            out["ffn_intermediate_size"] = self.ffn_intermediate_size or 0
        else:
            out["workspace_mib"] = self.workspace_mib
        return out


@dataclass(frozen=True)
class ModelCost:
    """Whole-model predictions: per-block sums plus the non-block costs."""

    scenario: Scenario
    runtime_ms: float
    prefill_runtime_ms: float
    decode_step_ms: float
    memory_mib: float
    num_params: int
    kv_cache_mib: float
    num_kv_heads: int

    @property
    def tokens_per_s(self) -> float:
        """Throughput convention of the NVlabs demo: batch × (in + out) tokens over the runtime."""
        return self.scenario.tokens / (self.runtime_ms / 1e3) if self.runtime_ms > 0 else math.inf

    @property
    def generated_tokens_per_s(self) -> float:
        """ModelOpt's convention: generated tokens only."""
        return self.scenario.batch * self.scenario.output_len / (self.runtime_ms / 1e3) if self.runtime_ms > 0 else math.inf

    @property
    def latency_ms(self) -> float:
        """End-to-end time of one request (the whole batch finishes together)."""
        return self.runtime_ms

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "scenario"}
        out.update(scenario=str(self.scenario), tokens_per_s=self.tokens_per_s,
                   generated_tokens_per_s=self.generated_tokens_per_s, latency_ms=self.latency_ms,
                   time_to_first_token_ms=self.prefill_runtime_ms)
        return out


class CostModel:
    """Prices variants of one parent on one profile in one scenario.

    Build one per (parent, profile, scenario); variant costs are cached, so pricing an
    80-layer, 54-combination space costs 15 distinct evaluations.

    Example
    -------
    >>> cm = CostModel(parent, load_profile("h100"), Scenario.parse("batch=256,in=128,out=1024,weights=fp8"))
    >>> cm.attention(AttentionVariant("gqa", 2)).runtime_ms < cm.attention(AttentionVariant("gqa", 8)).runtime_ms
    True
    """

    def __init__(self, parent: ParentShape, profile: HardwareProfile, scenario: Scenario) -> None:
        self.parent, self.profile, self.scenario = parent, profile, scenario
        self.kernels = {**DEFAULT_KERNELS, **(profile.kernels or {})}
        self.wbytes = DTYPE_BYTES[scenario.weight_dtype]
        self.kvbytes = DTYPE_BYTES[scenario.kv_dtype]
        self.abytes = 4.0 if scenario.weight_dtype == "fp32" else 2.0
        # Decode step k (k = 1 .. out-1) processes one token per sequence at context in + k.
        self._decode_ctx = scenario.input_len + np.arange(1, scenario.output_len, dtype=np.float64)
        self._cache: dict[Any, SubblockCost] = {}

    # ---- low-level step times, also used by `mlx calibrate` to predict what it measures

    def _op_time_s(self, op: _Op) -> np.ndarray | float:
        eff = self.profile.efficiency
        peak = self.profile.peak_flops(op.dtype)
        if op.compute == "attention":
            rate = eff.attention
        else:
            half = self.profile.matmul_half_rows
            rate = eff.matmul * (op.rows / (op.rows + half) if half > 0 and math.isfinite(op.rows) else 1.0)
        compute = op.flops / (peak * rate)
        nbytes = op.bytes
        if op.rows > 1 and self.profile.gemm_weight_passes:
            nbytes = nbytes + self.profile.gemm_weight_passes * op.weight_bytes
        memory = nbytes / (self.profile.bandwidth_bytes_s * eff.memory)
        overhead = op.kernels * self.profile.kernel_overhead_us * 1e-6
        # Partial-overlap roofline: max(c, m) + (1 - overlap) · min(c, m).
        serial = 1.0 - self.profile.overlap
        if isinstance(compute, float) and isinstance(memory, float):  # the common scalar case, without numpy
            return max(compute, memory) + serial * min(compute, memory) + overhead
        return np.maximum(compute, memory) + serial * np.minimum(compute, memory) + overhead

    def attention_ops(self, variant: AttentionVariant, n_seq: int, new_tokens: int, ctx: np.ndarray | float) -> list[_Op]:
        """Ops of one attention subblock forward: `n_seq` sequences, `new_tokens` each, at context `ctx`.

        `ctx` counts the keys each new token sees at the end of the step (prefill: ctx = new_tokens).
        """
        p, t = self.parent, n_seq * new_tokens
        wd = self.scenario.weight_dtype
        if variant.kind == "no_op":
            return []
        if variant.kind == "linear":
            h = p.hidden_size
            w = variant.num_params(p) * self.wbytes
            return [_Op(2.0 * t * h * h, w + 2 * t * h * self.abytes, "matmul", wd, self.kernels["linear_attention"],
                        rows=t, weight_bytes=w)]
        q_dim = p.num_attention_heads * p.head_dim
        kv_dim = variant.n_kv_heads * p.head_dim  # type: ignore[operator]
        proj_params = variant.num_params(p) - p.hidden_size  # without the norm: the matmul weights
        proj_act = t * (p.hidden_size + q_dim + 2 * kv_dim + q_dim + p.hidden_size) * self.abytes
        w = variant.num_params(p) * self.wbytes
        projections = _Op(2.0 * t * proj_params, w + proj_act, "matmul", wd, self.kernels["gqa"] - 1, rows=t,
                          weight_bytes=w)
        # Attention core: QK^T and PV, 4·d FLOPs per (query head, query, key) pair. A causal
        # prefill of n tokens has n(n+1)/2 pairs per head; a decode step has ctx pairs.
        ctx = float(ctx) if np.ndim(ctx) == 0 else np.asarray(ctx, dtype=np.float64)
        if new_tokens > 1:
            pairs = new_tokens * (new_tokens + 1) / 2.0 + new_tokens * (ctx - new_tokens)
        else:
            pairs = ctx
        kv_per_token = 2 * kv_dim * self.kvbytes
        core_flops = 4.0 * p.num_attention_heads * p.head_dim * n_seq * pairs
        # The cache is read once per step (flash-style kernels keep the tile on chip) and the
        # new keys/values are written once.
        core_bytes = n_seq * ctx * kv_per_token + t * kv_per_token + 2 * t * q_dim * self.abytes
        core = _Op(core_flops, core_bytes, "attention", self.scenario.kv_dtype, 1)
        return [projections, core]

    def ffn_ops(self, variant: FFNVariant, n_seq: int, new_tokens: int) -> list[_Op]:
        p, t, wd = self.parent, n_seq * new_tokens, self.scenario.weight_dtype
        if variant.kind == "no_op":
            return []
        h = p.hidden_size
        if variant.kind == "linear":
            w = variant.num_params(p) * self.wbytes
            return [_Op(2.0 * t * h * h, w + 2 * t * h * self.abytes, "matmul", wd, self.kernels["linear_ffn"],
                        rows=t, weight_bytes=w)]
        width = variant.intermediate_size or 0
        act = t * (2 * h + 3 * width) * self.abytes
        w = variant.num_params(p) * self.wbytes
        return [_Op(2.0 * t * 3 * h * width, w + act, "matmul", wd, self.kernels["mlp"], rows=t, weight_bytes=w)]

    def non_block_ops(self, n_seq: int, new_tokens: int) -> list[_Op]:
        """Embedding lookup, final norm and LM head; logits only for the last token of each sequence."""
        p = self.parent
        head = p.vocab_size * p.hidden_size
        logit_rows = n_seq  # serving engines (and `generate`) compute logits for the last position only
        flops = 2.0 * logit_rows * head
        nbytes = head * self.wbytes + n_seq * new_tokens * p.hidden_size * self.abytes + logit_rows * p.vocab_size * 4
        return [_Op(flops, nbytes, "matmul", self.scenario.weight_dtype, self.kernels["non_block"], rows=logit_rows,
                    weight_bytes=head * self.wbytes)]

    def step_ms(self, ops: Sequence[_Op]) -> np.ndarray | float:
        total: np.ndarray | float = 0.0
        for op in ops:
            total = total + self._op_time_s(op)
        return total * 1e3

    def attention_step_ms(self, variant: AttentionVariant, n_seq: int, new_tokens: int, ctx: Any) -> Any:
        """Time in ms of one attention forward (prefill when `new_tokens > 1`), vectorised over `ctx`."""
        return self.step_ms(self.attention_ops(variant, n_seq, new_tokens, ctx))

    def ffn_step_ms(self, variant: FFNVariant, n_seq: int, new_tokens: int) -> float:
        return float(self.step_ms(self.ffn_ops(variant, n_seq, new_tokens)))

    def non_block_step_ms(self, n_seq: int, new_tokens: int) -> float:
        """Non-block time of one forward step, including the profile's per-step framework overhead."""
        return float(self.step_ms(self.non_block_ops(n_seq, new_tokens))) + self.profile_step_overhead_ms

    @property
    def profile_step_overhead_ms(self) -> float:
        return self.profile.step_overhead_us * 1e-3

    # ---- scenario costs per variant

    def attention(self, variant: AttentionVariant) -> SubblockCost:
        """Cost of one attention subblock over the whole scenario."""
        key = ("attention", variant)
        if key not in self._cache:
            s, p = self.scenario, self.parent
            prefill = float(self.attention_step_ms(variant, s.batch, s.input_len, s.input_len))
            # Per-step times vary with the context for GQA; linear attention gives one scalar for all steps.
            steps = self.attention_step_ms(variant, s.batch, 1, self._decode_ctx)
            decode = float(np.sum(np.broadcast_to(steps, self._decode_ctx.shape))) if len(self._decode_ctx) else 0.0
            n_kv = variant.n_kv_heads if variant.kind == "gqa" else 0
            kv_mib = s.batch * s.seq_len * 2 * (n_kv or 0) * p.head_dim * self.kvbytes / MIB
            params = variant.num_params(p)
            self._cache[key] = SubblockCost(variant.name, "attention", params, params * self.wbytes / MIB, kv_mib, 0.0,
                                            prefill, decode, len(self._decode_ctx), num_kv_heads=n_kv)
        return self._cache[key]

    def ffn(self, variant: FFNVariant) -> SubblockCost:
        """Cost of one FFN subblock over the whole scenario."""
        key = ("ffn", variant)
        if key not in self._cache:
            s, p = self.scenario, self.parent
            prefill = self.ffn_step_ms(variant, s.batch, s.input_len)
            decode = self.ffn_step_ms(variant, s.batch, 1) * len(self._decode_ctx)
            params = variant.num_params(p)
            width = variant.intermediate_size if variant.kind == "mlp" else 0
            self._cache[key] = SubblockCost(variant.name, "ffn", params, params * self.wbytes / MIB, 0.0, 0.0,
                                            prefill, decode, len(self._decode_ctx), ffn_intermediate_size=width)
        return self._cache[key]

    def non_block(self) -> SubblockCost:
        """Embeddings, final norm, LM head, activation workspace and per-step overhead: charged once."""
        key = ("non_block",)
        if key not in self._cache:
            s, p = self.scenario, self.parent
            embed = p.vocab_size * p.hidden_size
            params = embed * (1 if p.tie_word_embeddings else 2) + p.hidden_size
            prefill = self.non_block_step_ms(s.batch, s.input_len)
            decode = self.non_block_step_ms(s.batch, 1) * len(self._decode_ctx)
            # Transient activations of the widest parent layer during prefill, plus the logits;
            # they are reused layer after layer, so charged once. Serving engines prefill in
            # chunks, so at most PREFILL_CHUNK_TOKENS tokens are live at a time.
            live = min(s.batch * s.input_len, PREFILL_CHUNK_TOKENS)
            act = live * (4 * p.hidden_size + 2 * p.intermediate_size) * self.abytes
            logits = s.batch * p.vocab_size * 4
            self._cache[key] = SubblockCost("non_block", "non_block", params, params * self.wbytes / MIB, 0.0,
                                            (act + logits) / MIB, prefill, decode, len(self._decode_ctx))
        return self._cache[key]

    def block_stats(self, choice: BlockChoice) -> dict[str, Any]:
        """Stats of one whole layer in the NVlabs demo format (totals plus attention_*/ffn_* splits)."""
        return combine_stats(self.attention(choice.attention).stats(), self.ffn(choice.ffn).stats())

    def model(self, choices: Iterable[BlockChoice]) -> ModelCost:
        """Whole-model cost of a child given one `BlockChoice` per layer."""
        nb = self.non_block()
        runtime, prefill, decode, memory, params, kv, heads = (nb.runtime_ms, nb.prefill_runtime_ms, nb.decode_step_ms,
                                                               nb.memory_mib, nb.num_params, 0.0, 0)
        for choice in choices:
            for sub in (self.attention(choice.attention), self.ffn(choice.ffn)):
                runtime += sub.runtime_ms
                prefill += sub.prefill_runtime_ms
                decode += sub.decode_step_ms
                memory += sub.memory_mib
                params += sub.num_params
                kv += sub.kv_cache_mib
                heads += sub.num_kv_heads or 0
        return ModelCost(self.scenario, runtime, prefill, decode, memory, params, kv, heads)

    def parent_model(self) -> ModelCost:
        choice = BlockChoice(parent_attention(self.parent), parent_ffn(self.parent))
        return self.model([choice] * self.parent.num_layers)


# --------------------------------------------------------------------------- helpers

def combine_stats(attention: dict[str, Any], ffn: dict[str, Any]) -> dict[str, Any]:
    """Merge two subblock stats into one block's stats with attention_*/ffn_* splits (NVlabs layout)."""
    out: dict[str, Any] = {"num_kv_heads": attention.get("num_kv_heads", 0),
                           "ffn_intermediate_size": ffn.get("ffn_intermediate_size", 0)}
    for key in ("memory_mib", "runtime_ms", "num_params", "prefill_runtime_ms", "decode_step_ms",
                "weights_mib", "kv_cache_mib"):
        if key in attention or key in ffn:
            out[key] = attention.get(key, 0) + ffn.get(key, 0)
    for prefix, sub in (("attention", attention), ("ffn", ffn)):
        for key in ("memory_mib", "runtime_ms", "num_params", "prefill_runtime_ms", "decode_step_ms"):
            if key in sub:
                out[f"{prefix}_{key}"] = sub[key]
    return out


def price_variants(parent: ParentShape, profile: HardwareProfile, scenario: Scenario,
                   attention: Iterable[AttentionVariant], ffn: Iterable[FFNVariant]) -> dict[str, Any]:
    """Predicted stats of every variant of a search space (the `--costs-only` table).

    Returns ``{"attention": {name: stats}, "ffn": {name: stats}, "non_block": stats,
    "parent": ModelCost dict, "stats_context": {...}}``.
    """
    cm = CostModel(parent, profile, scenario)
    return {
        "attention": {v.name: cm.attention(v).stats() for v in attention},
        "ffn": {v.name: cm.ffn(v).stats() for v in ffn},
        "non_block": cm.non_block().stats(),
        "parent": cm.parent_model().to_dict(),
        "stats_context": stats_context(profile, scenario),
    }


def stats_context(profile: HardwareProfile, scenario: Scenario) -> dict[str, Any]:
    """What a library's stats were priced for, recorded beside them."""
    return {"profile": profile.name, "scenario": scenario.to_dict(), "source": "mlxkit cost model",
            "throughput_convention": "batch*(input_len+output_len)/runtime"}
