"""The typed schema of a block library's `library.json` (format "mlxkit.block_library", version 1).

Layout, in the NVlabs/puzzle vocabulary (`metrics`, `stats`, `kl_div`, `runtime_ms`, ...)::

    {"format": "mlxkit.block_library", "version": 1,
     "parent": {"spec", "shape", "config"}, "recipe": {...}, "run_key": {...},
     "calibration": "...", "seed": 0,
     "layers": [{"layer": 0,
                 "attention": {"kv3": {"variant", "file", "source", "init", "training", "metrics", "stats"}, ...},
                 "ffn": {...},
                 "blocks": {}},              # only in libraries scored per whole block (NVlabs demo)
                ...],
     "non_block": {"stats": {...}},          # optional, with the per-variant stats
     "stats_context": {...}}                 # optional: what the stored stats were priced or measured for

Each variant's `metrics` are its replace-1-block scores (lower KL is better) and its
optional `stats` its costs; a library built by `mlx distill` stores no stats, because costs
depend on the target (`mlx search` prices them, see `search/pricing.py`). Libraries scored per
whole block (the NVlabs demo format, converted on read by `library/nvlabs.py`) keep the
scores and stats of each attention+FFN combination under `blocks`.

Only `engines/puzzle/library/store.py` reads and writes the file; every other module works on
these types. Validation rejects what would silently mislead a search: missing layers or
subblocks, non-finite scores, negative or non-finite costs.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal

from pydantic import Field, field_validator, model_validator

from mlxkit.engines.core.yaml_config import StrictSpec
from mlxkit.engines.errors import InputError
from mlxkit.engines.hardware.scenario import Scenario
from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant, ParentShape
from mlxkit.engines.puzzle.recipe import BLDSpec, PuzzleData, PuzzleRecipe, SearchSpaceSpec

LIBRARY_FORMAT = "mlxkit.block_library"
LIBRARY_VERSION = 1

SubblockKind = Literal["attention", "ffn"]
# A replace-1-block score: KL, LM loss, top-1 agreement, ... (NaN would make the MIP meaningless).
Score = Annotated[float, Field(allow_inf_nan=False)]
# A cost in the NVlabs vocabulary (memory_mib, runtime_ms, num_params, num_kv_heads, ...): never negative.
Cost = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Metrics = dict[str, Score]
Stats = dict[str, Cost]


class TrainingInfo(StrictSpec):
    """How BLD trained one subblock (non-finite losses of a diverging run are recorded as null)."""

    steps: int = Field(ge=0)
    tokens: int = Field(ge=0)
    val_nmse_init: float | None
    val_nmse: float | None
    curve: list[tuple[int, float | None]] = []
    seconds: float = Field(0.0, ge=0)
    loss: str = "normalized_mse"
    reverted_to_init: bool = False


class BlockRecord(StrictSpec):
    """The sidecar written beside a block's safetensors file; its presence marks the block as finished."""

    layer: int = Field(ge=0)
    kind: SubblockKind
    variant: dict[str, Any]
    init: str
    trained: bool
    training: TrainingInfo


class _VariantEntry(StrictSpec):
    file: str | None = None  # the block's safetensors file, relative to the library directory
    source: Literal["parent", "no_op", "bld", "init", "nvlabs"] | None = None
    init: str | None = None  # how the block was initialised from the parent
    training: TrainingInfo | None = None
    metrics: Metrics | None = None
    stats: Stats | None = None


class AttentionEntry(_VariantEntry):
    variant: AttentionVariant


class FFNEntry(_VariantEntry):
    variant: FFNVariant


class BlockEntry(StrictSpec):
    """A whole block (attention + FFN) scored as one, as in NVlabs/puzzle demo libraries."""

    attention: str  # names of the layer's attention and FFN variants
    ffn: str
    original_name: str | None = None  # the demo library's own variant name
    metrics: Metrics
    stats: Stats | None = None


class LayerEntry(StrictSpec):
    layer: int = Field(ge=0)
    attention: dict[str, AttentionEntry]
    ffn: dict[str, FFNEntry]
    blocks: dict[str, BlockEntry] = {}

    @model_validator(mode="after")
    def _consistent(self) -> "LayerEntry":
        for kind, entries in (("attention", self.attention), ("ffn", self.ffn)):
            if not entries:
                raise ValueError(f"layer {self.layer} has no {kind} variants")
            for name, entry in entries.items():
                if entry.variant.name != name:
                    raise ValueError(f"layer {self.layer} {kind} variant '{name}' describes '{entry.variant.name}'")
        for name, block in self.blocks.items():
            if block.attention not in self.attention or block.ffn not in self.ffn:
                raise ValueError(f"layer {self.layer} block '{name}' names variants the layer does not list")
        return self

    def entries(self, kind: SubblockKind) -> dict[str, AttentionEntry] | dict[str, FFNEntry]:
        return self.attention if kind == "attention" else self.ffn

    def block_choice(self, name: str) -> BlockChoice:
        """The attention and FFN variants of the whole block `name` (a key of `blocks`)."""
        block = self.blocks[name]
        return BlockChoice(self.attention[block.attention].variant, self.ffn[block.ffn].variant)


class ParentInfo(StrictSpec):
    spec: str  # how the parent was named on the command line
    shape: ParentShape
    config: dict[str, Any] | None = None


class RunKey(StrictSpec):
    """Everything a library's blocks depend on; a directory is resumed only when its key matches."""

    parent: str  # fingerprint of the parent's weights
    data: dict[str, str] | Literal["sampled"]
    seed: int
    data_settings: PuzzleData
    train: bool
    bld: BLDSpec
    search_space: SearchSpaceSpec
    block_seed: str  # the rule that seeds each block; a new rule must not resume an old run
    # Precision: the dtype the parent ran in (activations, BLD autocast, scoring) and the dtype of
    # the block files. Keys written before these fields existed were float32 runs.
    compute_dtype: str = "float32"
    save_dtype: str = "float32"

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The JSON value of every field that has a default: what a key written without that field means."""
        return {name: field.default for name, field in cls.model_fields.items() if not field.is_required()}


class StatsContext(StrictSpec):
    """What a library's stored stats were priced (or measured) for."""

    profile: str
    scenario: Scenario | None = None
    source: str = "mlxkit cost model"
    throughput_convention: str = "batch*(input_len+output_len)/runtime"


class NonBlockEntry(StrictSpec):
    stats: Stats


class BlockLibrary(StrictSpec):
    format: Literal["mlxkit.block_library"] = LIBRARY_FORMAT
    version: Literal[1] = LIBRARY_VERSION
    parent: ParentInfo | None = None  # None for a converted NVlabs demo library (no parent weights)
    recipe: PuzzleRecipe | None = None
    run_key: RunKey | None = None
    calibration: str | None = None
    seed: int | None = None
    converted_from: str | None = None  # e.g. "NVlabs/puzzle demo library"
    layers: list[LayerEntry]
    non_block: NonBlockEntry | None = None
    stats_context: StatsContext | None = None

    @field_validator("layers")
    @classmethod
    def _layers_in_order(cls, layers: list[LayerEntry]) -> list[LayerEntry]:
        if not layers:
            raise ValueError("a library needs at least one layer")
        indices = [layer.layer for layer in layers]
        if indices != list(range(len(layers))):
            raise ValueError(f"layers must be numbered 0..{len(layers) - 1} in order (got {indices})")
        return layers

    @property
    def has_trained_blocks(self) -> bool:
        """True for an mlxkit-built library, whose variants a child can be assembled from."""
        return self.parent is not None and self.converted_from is None

    def with_attention_only(self, keep: Callable[[AttentionVariant], bool], why: str) -> "BlockLibrary":
        """The same library with only the attention variants `keep` accepts (and the whole blocks that use them).

        `why` completes the error raised when a layer would be left with no attention variant at all.
        """
        return self._with_variants_only("attention", keep, why)

    def with_ffn_only(self, keep: Callable[[FFNVariant], bool], why: str) -> "BlockLibrary":
        """The same library with only the FFN variants `keep` accepts (and the whole blocks that use them).

        `why` completes the error raised when a layer would be left with no FFN variant at all.
        """
        return self._with_variants_only("ffn", keep, why)

    def _with_variants_only(self, kind: Literal["attention", "ffn"], keep: Callable[[Any], bool],
                            why: str) -> "BlockLibrary":
        layers = []
        for layer in self.layers:
            entries = getattr(layer, kind)
            kept = {name: entry for name, entry in entries.items() if keep(entry.variant)}
            if not kept:
                raise InputError(f"layer {layer.layer} has no {'FFN' if kind == 'ffn' else kind} variant left "
                                 f"{why} (it has: {', '.join(entries)})")
            blocks = {name: block for name, block in layer.blocks.items() if getattr(block, kind) in kept}
            layers.append(layer.model_copy(update={kind: kept, "blocks": blocks}))
        return self.model_copy(update={"layers": layers})
