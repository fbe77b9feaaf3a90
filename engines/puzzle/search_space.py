"""Apply a recipe's search space to a parent: the variants every layer may choose from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mlxkit.engines.models.decilm.blocks import (AttentionVariant, FFNVariant, ParentShape, parent_attention,
                                                 parent_ffn)
from mlxkit.engines.puzzle.recipe import SearchSpaceSpec


@dataclass(frozen=True)
class SearchSpace:
    """The same attention and FFN options for every layer (the parent's first)."""

    parent: ParentShape
    attention: tuple[AttentionVariant, ...]
    ffn: tuple[FFNVariant, ...]

    def only(self, variants: "VariantFilter") -> "SearchSpace":
        """The variants `variants` accepts, and the parent's own always (a child can keep any layer whole)."""
        keep_attention = parent_attention(self.parent)
        keep_ffn = parent_ffn(self.parent)
        return SearchSpace(
            self.parent,
            tuple(v for v in self.attention if v == keep_attention or variants.attention(v, self.parent)),
            tuple(v for v in self.ffn if v == keep_ffn or variants.ffn(v, self.parent)))


@dataclass(frozen=True)
class VariantFilter:
    """The variants a library build covers: what a search can use, so nothing else is trained or scored.

    Each block's training seed and replace-1-block score depend on that block alone, so a library
    built for a subset holds the same blocks and scores as a full one, and can be extended later.
    `why` completes "the variants ..." in notices ("that vLLM builds").
    """

    attention: Callable[[AttentionVariant, ParentShape], bool]
    ffn: Callable[[FFNVariant, ParentShape], bool]
    why: str


def round_width(width: float, multiple: int) -> int:
    """Nearest multiple of `multiple`, never below one multiple."""
    return max(multiple, int(round(width / multiple)) * multiple)


def build_search_space(parent: ParentShape, spec: SearchSpaceSpec) -> SearchSpace:
    attention: list[AttentionVariant] = []
    if "parent" in spec.attention:
        attention.append(parent_attention(parent))
    if "kv_divisors" in spec.attention:
        # Fewer KV heads than the parent, each a divisor of the query heads (GQA groups stay whole).
        counts = [n for n in range(parent.num_key_value_heads - 1, 0, -1) if parent.num_attention_heads % n == 0]
        if spec.max_kv_options is not None:
            counts = counts[::-1][: spec.max_kv_options]
        attention += [AttentionVariant("gqa", n) for n in sorted(counts, reverse=True)]
    attention += [AttentionVariant(kind) for kind in ("linear", "no_op") if kind in spec.attention]

    widths = []
    for fraction in spec.ffn_fractions:
        width = parent.intermediate_size if fraction == 1.0 else \
            min(parent.intermediate_size, round_width(fraction * parent.intermediate_size, spec.width_multiple))
        if width not in widths:
            widths.append(width)
    widths.sort(reverse=True)
    if parent.intermediate_size in widths:  # the parent's own width first
        widths.remove(parent.intermediate_size)
        widths.insert(0, parent.intermediate_size)
    ffn = [FFNVariant("mlp", w) for w in widths]
    if spec.ffn_linear:
        ffn.append(FFNVariant("linear"))
    if spec.ffn_no_op:
        ffn.append(FFNVariant("no_op"))
    if parent_ffn(parent) not in ffn:
        ffn.insert(0, parent_ffn(parent))
    if parent_attention(parent) not in attention:
        attention.insert(0, parent_attention(parent))
    return SearchSpace(parent, tuple(attention), tuple(ffn))
