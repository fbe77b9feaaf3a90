"""Price block libraries with the cost model, and turn any library into a MIP `SearchProblem`.

Two library formats are accepted:

* mlxkit's own (`"format": "mlxkit.block_library"`), written by the library builder:
  per layer, separate attention and FFN variants (decoupled BLD), each with its
  replace-1-subblock `metrics` and, once priced, `stats`;
* the public NVlabs/puzzle demo format (`nvlabs_library`): per layer, combined blocks.

`costs="library"` uses the stats stored in the file (for the demo: NVIDIA's H100
measurements); `costs="profile"` re-prices every variant from its shapes with a hardware
profile and a scenario.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from mlxkit.engines.errors import InputError
from mlxkit.engines.puzzle.costs import CostModel, Scenario, combine_stats, stats_context
from mlxkit.engines.puzzle.hw_profile import HardwareProfile
from mlxkit.engines.puzzle.mip import Group, Option, SearchProblem, Solution
from mlxkit.engines.puzzle.nvlabs_library import block_choice, is_nvlabs_library, read_nvlabs_library
from mlxkit.engines.puzzle.variants import AttentionVariant, BlockChoice, FFNVariant, ParentShape

LIBRARY_FORMAT = "mlxkit.block_library"
# Stats the MIP can cap; the rest of a variant's stats are informative only.
CONSTRAINABLE_STATS = ("memory_mib", "runtime_ms", "num_params", "prefill_runtime_ms", "decode_step_ms")
# Metrics where larger is better; everything else (kl_div, lm_loss, ...) is minimised.
_BIGGER_IS_BETTER = ("top1_agreement", "accuracy", "acc", "token_accuracy", "top1", "agreement")

CostsSource = Literal["library", "profile"]


def metric_bigger_is_better(metric: str) -> bool:
    name = metric.split(".")[-1].lower()
    return any(name.startswith(prefix) for prefix in _BIGGER_IS_BETTER)


def load_library(path: str | Path) -> dict[str, Any]:
    """Read a library JSON file of either format."""
    path = Path(path)
    if path.is_dir():
        path = path / "library.json"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not valid JSON: {exc}") from exc
    if library_format(data) is None:
        raise InputError(f"{path} is neither an mlxkit block library nor an NVlabs/puzzle demo library")
    return data


def library_format(data: Any) -> Literal["mlxkit", "nvlabs"] | None:
    if isinstance(data, dict) and data.get("format") == LIBRARY_FORMAT:
        return "mlxkit"
    return "nvlabs" if is_nvlabs_library(data) else None


def parent_shape(library: Mapping[str, Any]) -> ParentShape:
    """The parent dimensions recorded in an mlxkit library."""
    try:
        return ParentShape(**library["parent"]["shape"])
    except (KeyError, TypeError) as exc:
        raise InputError(f"library has no usable parent.shape ({exc})") from exc


def _attention_variant(entry: Mapping[str, Any]) -> AttentionVariant:
    spec = entry.get("variant") or {}
    return AttentionVariant(spec["kind"], spec.get("n_kv_heads"))


def _ffn_variant(entry: Mapping[str, Any]) -> FFNVariant:
    spec = entry.get("variant") or {}
    return FFNVariant(spec["kind"], spec.get("intermediate_size"))


def price_library(library: dict[str, Any], profile: HardwareProfile, scenario: Scenario) -> dict[str, Any]:
    """Fill every variant's `"stats"` of an mlxkit library with the cost model's predictions.

    Also sets the top-level `"stats_context"` (profile and scenario) and `"non_block"`
    (`{"stats": ...}` of embeddings, LM head and workspace). The library is updated in place
    and returned.
    """
    if library_format(library) != "mlxkit":
        raise InputError("price_library expects an mlxkit block library (format 'mlxkit.block_library')")
    cm = CostModel(parent_shape(library), profile, scenario)
    for layer in library["layers"]:
        for name, entry in layer.get("attention", {}).items():
            entry["stats"] = cm.attention(_attention_variant(entry)).stats()
        for name, entry in layer.get("ffn", {}).items():
            entry["stats"] = cm.ffn(_ffn_variant(entry)).stats()
    library["non_block"] = {"stats": cm.non_block().stats()}
    library["stats_context"] = stats_context(profile, scenario)
    return library


def _metric(entry: Mapping[str, Any], metric: str, where: str) -> float:
    metrics = entry.get("metrics") or {}
    key = metric.removeprefix("metrics.")
    if key not in metrics or metrics[key] is None:
        known = ", ".join(sorted(metrics)) or "none"
        raise InputError(f"{where} has no '{key}' metric (it has: {known}); score the library first")
    return float(metrics[key])


def _costs(stats: Mapping[str, Any]) -> dict[str, float]:
    return {k: float(stats[k]) for k in CONSTRAINABLE_STATS if k in stats and stats[k] is not None}


def library_problem(library: Mapping[str, Any], *, metric: str = "kl_div", costs: CostsSource = "profile",
                    profile: HardwareProfile | None = None, scenario: Scenario | None = None,
                    parent: ParentShape | None = None, bigger_is_better: bool | None = None,
                    include_non_block: bool = True) -> SearchProblem:
    """Build the MIP problem of a library (either format).

    Parameters
    ----------
    metric : the per-variant metric to sum (`kl_div`, `lm_loss`, `top1_agreement`, ...).
    costs : "profile" prices every variant with `profile` and `scenario`; "library" uses the stored stats.
    parent : the parent shape, needed to re-price an NVlabs library (it records none).
    bigger_is_better : default from the metric's name (`top1_agreement` is maximised, KL minimised).
    include_non_block : add embeddings / LM head / workspace as fixed costs (profile pricing, or the
        library's stored `non_block` stats).
    """
    fmt = library_format(library)
    if fmt is None:
        raise InputError("not a block library (mlxkit or NVlabs/puzzle format)")
    if costs not in ("library", "profile"):
        raise InputError(f"costs must be 'library' or 'profile' (got '{costs}')")
    if costs == "profile" and (profile is None or scenario is None):
        raise InputError("pricing with costs='profile' needs a hardware profile and a scenario")
    bigger = metric_bigger_is_better(metric) if bigger_is_better is None else bigger_is_better
    if fmt == "nvlabs":
        return _nvlabs_problem(library, metric, costs, profile, scenario, parent, bigger, include_non_block)
    return _mlxkit_problem(library, metric, costs, profile, scenario, bigger, include_non_block)


def _mlxkit_problem(library: Mapping[str, Any], metric: str, costs: CostsSource, profile: HardwareProfile | None,
                    scenario: Scenario | None, bigger: bool, include_non_block: bool) -> SearchProblem:
    cm = CostModel(parent_shape(library), profile, scenario) if costs == "profile" else None  # type: ignore[arg-type]
    groups: list[Group] = []
    for layer in library["layers"]:
        index = int(layer["layer"])
        for kind in ("attention", "ffn"):
            options = []
            for name, entry in (layer.get(kind) or {}).items():
                where = f"layer {index} {kind} variant '{name}'"
                if cm is not None:
                    variant = _attention_variant(entry) if kind == "attention" else _ffn_variant(entry)
                    stats = (cm.attention(variant) if kind == "attention" else cm.ffn(variant)).stats()  # type: ignore[arg-type]
                else:
                    stats = entry.get("stats")
                    if not stats:
                        raise InputError(f"{where} has no stats; price the library or use costs='profile'")
                options.append(Option(name, _metric(entry, metric, where), _costs(stats)))
            if options:
                groups.append(Group(index, kind, tuple(options)))
    fixed: dict[str, float] = {}
    if include_non_block:
        if cm is not None:
            fixed = _costs(cm.non_block().stats())
        elif library.get("non_block"):
            fixed = _costs(library["non_block"].get("stats") or {})
    tokens = scenario.tokens if scenario is not None else _context_tokens(library)
    return SearchProblem(groups, fixed, bigger, metric, tokens)


def _nvlabs_problem(library: Mapping[str, Any], metric: str, costs: CostsSource, profile: HardwareProfile | None,
                    scenario: Scenario | None, parent: ParentShape | None, bigger: bool,
                    include_non_block: bool) -> SearchProblem:
    layers = read_nvlabs_library(library)
    cm = None
    if costs == "profile":
        if parent is None:
            raise InputError("re-pricing an NVlabs library needs the parent's shape (pass --model)")
        cm = CostModel(parent, profile, scenario)  # type: ignore[arg-type]
    groups = []
    for index, variants in enumerate(layers):
        options = []
        for original, entry in variants.items():
            choice = block_choice(original, entry.get("stats"))
            where = f"layer_{index} variant '{original}'"
            stats = cm.block_stats(choice) if cm is not None else entry["stats"]
            options.append(Option(choice.name, _metric(entry, metric, where), _costs(stats), meta={"name": original}))
        groups.append(Group(index, "block", tuple(options)))
    fixed = _costs(cm.non_block().stats()) if cm is not None and include_non_block else {}
    # The demo measured batch 256 × 1200 tokens (measurement_info.json); with a scenario, use it.
    tokens = scenario.tokens if scenario is not None else None
    return SearchProblem(groups, fixed, bigger, metric, tokens)


def _context_tokens(library: Mapping[str, Any]) -> int | None:
    scenario = (library.get("stats_context") or {}).get("scenario")
    if not scenario:
        return None
    return int(scenario["batch"]) * (int(scenario["input_len"]) + int(scenario["output_len"]))


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


def parent_choice_names(problem: SearchProblem, parent: ParentShape | None = None) -> dict[tuple[int, str], str] | None:
    """The parent's option in every group (the variant with metric 0, or the parent's own names), if present."""
    picks: dict[tuple[int, str], str] = {}
    for group in problem.groups:
        names = {o.name for o in group.options}
        if parent is not None:
            att, ffn = f"kv{parent.num_key_value_heads}", f"ffn{parent.intermediate_size}"
            wanted = {"attention": att, "ffn": ffn, "block": f"{att}+{ffn}"}[group.kind]
            if wanted in names:
                picks[(group.layer, group.kind)] = wanted
                continue
        # Fallback: the heaviest option (most parameters) is the parent's in a Puzzle library.
        best = max(group.options, key=lambda o: (o.costs.get("num_params", 0.0), o.costs.get("runtime_ms", 0.0)))
        picks[(group.layer, group.kind)] = best.name
    return picks


def parent_totals(problem: SearchProblem, parent: ParentShape | None = None) -> dict[str, float]:
    """Summed stats of the parent architecture (for `--throughput 2x` and speed-ups)."""
    return problem.totals(parent_choice_names(problem, parent) or {})


def combined_stats(attention_stats: Mapping[str, Any], ffn_stats: Mapping[str, Any]) -> dict[str, Any]:
    """Re-export of `costs.combine_stats` for callers that only import this module."""
    return combine_stats(dict(attention_stats), dict(ffn_stats))


__all__: Sequence[str] = ("LIBRARY_FORMAT", "load_library", "library_format", "price_library", "library_problem",
                          "metric_bigger_is_better", "parent_shape", "parent_totals", "parent_choice_names",
                          "solution_block_choices", "combined_stats")
