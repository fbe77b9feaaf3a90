"""Price a block library, and turn a library and its prices into a MIP `SearchProblem`.

Pricing is a stage of its own: it reads a `BlockLibrary` and returns a new `LibraryCosts`
(the stats of every variant, per layer, in the NVlabs/puzzle vocabulary), leaving the
library untouched. Two sources:

* `price_library` predicts the stats with the cost model for a hardware profile and a
  deployment scenario (`mlx search --costs profile`, the default);
* `stored_costs` takes the stats recorded in the library itself (`--costs library`; for
  the NVlabs demo library, NVIDIA's H100 measurements).

`library_problem` then combines the library's scores with those stats. A library scored
per subblock (mlxkit's decoupled BLD) gives an attention group and an FFN group per layer;
one scored per whole block (the NVlabs demo) gives one group of combined blocks per layer.
"""

from __future__ import annotations

from typing import Literal, Mapping

from pydantic import BaseModel, ConfigDict

from mlxkit.engines.errors import InputError
from mlxkit.engines.hardware.costs import CostModel, stats_context
from mlxkit.engines.hardware.profile import HardwareProfile
from mlxkit.engines.hardware.scenario import Scenario
from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant, ParentShape
from mlxkit.engines.puzzle.library.schema import BlockLibrary, Metrics, Stats, StatsContext
from mlxkit.engines.puzzle.search.mip import Group, Option, SearchProblem, Solution

# Stats the MIP can cap; the rest of a variant's stats are informative only.
CONSTRAINABLE_STATS = ("memory_mib", "runtime_ms", "num_params", "prefill_runtime_ms", "decode_step_ms")
# Metrics where larger is better; everything else (kl_div, lm_loss, ...) is minimised.
_BIGGER_IS_BETTER = ("top1_agreement", "accuracy", "acc", "token_accuracy", "top1", "agreement")

CostsSource = Literal["library", "profile"]


class LayerCosts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    layer: int
    attention: dict[str, Stats] = {}
    ffn: dict[str, Stats] = {}
    blocks: dict[str, Stats] = {}  # whole blocks, for libraries scored per block


class LibraryCosts(BaseModel):
    """The priced variants of one library: what `mlx search --write-costs` writes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    context: StatsContext | None = None  # what the stats were priced or measured for
    non_block: Stats = {}  # embeddings, final norm, LM head, workspace: charged once per model
    layers: list[LayerCosts]


def metric_bigger_is_better(metric: str) -> bool:
    name = metric.split(".")[-1].lower()
    return any(name.startswith(prefix) for prefix in _BIGGER_IS_BETTER)


def price_library(library: BlockLibrary, profile: HardwareProfile, scenario: Scenario,
                  parent: ParentShape | None = None) -> LibraryCosts:
    """Predicted stats of every variant (and whole block) of `library` on `profile` in `scenario`.

    `parent` defaults to the shape the library records; a converted NVlabs library records
    none, so it can only be priced when the caller knows the parent's shape.
    """
    shape = parent or (library.parent.shape if library.parent is not None else None)
    if shape is None:
        raise InputError("re-pricing an NVlabs/puzzle demo library needs the parent's shape, which the demo "
                         "format does not record; use its own measurements (--costs library)")
    cm = CostModel(shape, profile, scenario)
    layers = [LayerCosts(layer=layer.layer,
                         attention={name: cm.attention(entry.variant).stats() for name, entry in layer.attention.items()},
                         ffn={name: cm.ffn(entry.variant).stats() for name, entry in layer.ffn.items()},
                         blocks={name: cm.block_stats(layer.block_choice(name)) for name in layer.blocks})
              for layer in library.layers]
    return LibraryCosts(context=StatsContext(**stats_context(profile, scenario)), non_block=cm.non_block().stats(),
                        layers=layers)


def stored_costs(library: BlockLibrary) -> LibraryCosts:
    """The stats recorded in the library itself.

    Raises
    ------
    InputError
        When a variant the search would choose from has no stats (a library built by
        `mlx distill` stores none: costs depend on the target).
    """
    layers = []
    for layer in library.layers:
        if layer.blocks:  # scored per whole block: only the blocks' stats enter the search
            missing = [name for name, block in layer.blocks.items() if block.stats is None]
            if missing:
                raise InputError(f"layer {layer.layer} block '{missing[0]}' has no stats; use --costs profile")
            layers.append(LayerCosts(layer=layer.layer, blocks={n: b.stats for n, b in layer.blocks.items()}))
            continue
        priced: dict[str, dict[str, Stats]] = {}
        for kind in ("attention", "ffn"):
            priced[kind] = {}
            for name, entry in layer.entries(kind).items():
                if entry.stats is None:
                    raise InputError(f"layer {layer.layer} {kind} variant '{name}' has no stats: this library "
                                     "records no costs; use --costs profile")
                priced[kind][name] = entry.stats
        layers.append(LayerCosts(layer=layer.layer, **priced))
    non_block = library.non_block.stats if library.non_block is not None else {}
    return LibraryCosts(context=library.stats_context, non_block=non_block, layers=layers)


def library_problem(library: BlockLibrary, costs: LibraryCosts, *, metric: str = "kl_div",
                    bigger_is_better: bool | None = None, tokens: int | None = None) -> SearchProblem:
    """The MIP over `library`'s scores (`metric`) and `costs`' stats.

    Parameters
    ----------
    metric : the per-variant metric to sum (`kl_div`, `lm_loss`, `top1_agreement`, ...).
    bigger_is_better : default from the metric's name (`top1_agreement` is maximised, KL minimised).
    tokens : batch × (in + out) of the scenario the costs stand for; only phrases runtime caps
        as throughput in messages.
    """
    if len(costs.layers) != len(library.layers):
        raise InputError(f"the costs cover {len(costs.layers)} layers, the library has {len(library.layers)}")
    bigger = metric_bigger_is_better(metric) if bigger_is_better is None else bigger_is_better
    groups: list[Group] = []
    for layer, priced in zip(library.layers, costs.layers):
        if layer.blocks:
            options = [Option(name, _metric(block.metrics, metric, f"layer {layer.layer} block '{name}'"),
                              _constrainable(_stats(priced.blocks, name, layer.layer, "block")),
                              meta={"name": block.original_name or name},
                              removes=(layer.attention[block.attention].variant.kind == "no_op"
                                       and layer.ffn[block.ffn].variant.kind == "no_op"))
                       for name, block in layer.blocks.items()]
            groups.append(Group(layer.layer, "block", tuple(options)))
            continue
        for kind in ("attention", "ffn"):
            stats = priced.attention if kind == "attention" else priced.ffn
            options = [Option(name, _metric(entry.metrics, metric, f"layer {layer.layer} {kind} variant '{name}'"),
                              _constrainable(_stats(stats, name, layer.layer, kind)),
                              removes=entry.variant.kind == "no_op")
                       for name, entry in layer.entries(kind).items()]
            groups.append(Group(layer.layer, kind, tuple(options)))
    return SearchProblem(groups, _constrainable(costs.non_block), bigger, metric, tokens)


def _metric(metrics: Metrics | None, metric: str, where: str) -> float:
    key = metric.removeprefix("metrics.")
    if not metrics or metrics.get(key) is None:
        known = ", ".join(sorted(metrics or {})) or "none"
        raise InputError(f"{where} has no '{key}' metric (it has: {known}); score the library first")
    return float(metrics[key])


def _stats(stats: Mapping[str, Stats], name: str, layer: int, kind: str) -> Stats:
    if name not in stats:
        raise InputError(f"the costs have no stats for layer {layer} {kind} '{name}'")
    return stats[name]


def _constrainable(stats: Mapping[str, float]) -> dict[str, float]:
    return {k: float(stats[k]) for k in CONSTRAINABLE_STATS if k in stats}


def solution_block_choices(solution: Solution) -> list[BlockChoice]:
    """Per-layer `BlockChoice`s of a solution of either problem layout, in layer order."""
    out = []
    for entry in solution.choices:
        if "block" in entry:
            attention_name, _, ffn_name = entry["block"].partition("+")
        else:
            attention_name, ffn_name = entry["attention"], entry["ffn"]
        out.append(BlockChoice(AttentionVariant.parse(attention_name), FFNVariant.parse(ffn_name)))
    return out


def parent_choice_names(problem: SearchProblem, parent: ParentShape | None = None) -> dict[tuple[int, str], str]:
    """The parent's option in every group: the parent's own names when known, else the heaviest option."""
    picks: dict[tuple[int, str], str] = {}
    for group in problem.groups:
        names = {o.name for o in group.options}
        if parent is not None:
            att, ffn = f"kv{parent.num_key_value_heads}", f"ffn{parent.intermediate_size}"
            wanted = {"attention": att, "ffn": ffn, "block": f"{att}+{ffn}"}[group.kind]
            if wanted in names:
                picks[(group.layer, group.kind)] = wanted
                continue
        # The heaviest option (most parameters, then slowest) is the parent's in a Puzzle library.
        best = max(group.options, key=lambda o: (o.costs.get("num_params", 0.0), o.costs.get("runtime_ms", 0.0)))
        picks[(group.layer, group.kind)] = best.name
    return picks


def parent_totals(problem: SearchProblem, parent: ParentShape | None = None) -> dict[str, float]:
    """Summed stats of the parent architecture (for `--throughput 2x` and speed-ups)."""
    return problem.totals(parent_choice_names(problem, parent))
