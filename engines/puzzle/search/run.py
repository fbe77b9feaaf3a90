"""`mlx search`: Puzzle end to end, from a parent to a saved child checkpoint.

Plan (what exists is reused, what is missing is built):
  1. the block library for (model, recipe): built and scored by `distill` if missing;
  2. pricing: every variant's stats on the hardware profile for the deployment scenario
     (the profile's own default scenario unless `--scenario` changes it), or the stats the
     library records (`--costs library`); optionally written out (`--write-costs`);
  3. the MIP (one binary per layer and attention / FFN variant) under the user's budgets,
     optionally swept over batch sizes and asked for several diverse solutions; optionally
     written out in the LP format (`--write-lp`);
  4. the best child assembled from the library's trained blocks, saved atomically with
     its manifest, and evaluated against the parent on held-out tokens;
  5. with `gkd_tokens`, global distillation of that child against the parent: the assembled
     child waits in `.<out>.search-work/` under its stage key (the library's index, the
     choices, the evaluation and the dtypes), and GKD keeps its own work directory under its
     run key, so a rerun of the same command resumes at the stage it stopped in, a rerun with
     other choices assembles and distils afresh, and the distilled child is what lands at
     `out`, its manifest recording every stage;

The parent is read once for the stages before GKD (`SearchParent`) and freed before GKD reads
it as the teacher.
  6. the serving engine (`engine`, else the hardware profile's) limits the search space to the
     blocks it builds (engines/serving/capabilities.py): a library built once serves every
     engine, filtered here at solve time. With `export`, the space also keeps only what that
     format can hold, and the saved child is exported into `out`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from mlxkit.engines.core.atomic import atomic_write_json
from mlxkit.engines.core.manifest import Manifest
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError
from mlxkit.engines.hardware.costs import price_variants
from mlxkit.engines.hardware.profile import HardwareProfile, load_profile
from mlxkit.engines.hardware.scenario import Scenario
from mlxkit.engines.models.attention import prefer_sdpa
from mlxkit.engines.models.decilm.blocks import BlockChoice, ParentShape, parent_attention, parent_ffn
from mlxkit.engines.puzzle.search.budgets import Budgets
from mlxkit.engines.puzzle.library.build import ensure_library
from mlxkit.engines.puzzle.library.store import LibraryDir, read_library
from mlxkit.engines.puzzle.search.pricing import (LibraryCosts, library_problem, parent_choice_names, parent_totals,
                                                   price_library, solution_block_choices, stored_costs)
from mlxkit.engines.puzzle.library.schema import BlockLibrary
from mlxkit.engines.puzzle.search.mip import SearchProblem, Solution, Solver, sweep_batch_sizes
from mlxkit.engines.puzzle.search.refine import (ChildMeasurement, Corrections, RefinementResult, isolated_sum,
                                          measure_child, refine, tokens_hash)
from mlxkit.engines.training.device import Placement, training_placement
from mlxkit.engines.training.distributed import Distributed

DEFAULT_THROUGHPUT = "1.5x"


@dataclass(frozen=True)
class SearchOptions:
    out: Path | None
    target: str = "h100"
    model: str = "smollm2-135m"
    recipe: str | None = None  # the library recipe (default "quick"); only when no --library is given
    library: Path | None = None
    data: Path | None = None
    throughput: str | None = None
    memory: str | None = None
    latency: str | None = None
    params: str | None = None
    scenario: str | None = None
    costs: Literal["profile", "library"] = "profile"
    metric: str = "kl_div"
    solutions: int = 1
    min_distance: int | None = None
    batch_sweep: tuple[int, ...] = ()
    write_costs: Path | None = None
    write_lp: Path | None = None
    seed: int = 0
    overwrite: bool = False
    eval_sequences: int = 4
    allow_pickle: bool = False
    extra_caps: dict[str, float] = field(default_factory=dict)
    gkd_tokens: int | None = None
    gkd_recipe: str = "gkd"
    gkd_overrides: dict[str, Any] = field(default_factory=dict)
    export: str | None = None  # a format of `mlx export`: searched for, then written into `out`
    engine: str | None = None  # the serving engine; None: the profile's (engines/serving/capabilities.py)
    export_dtype: str = "f32"
    device: str = "auto"                 # see engines/training/device.py for the device and dtype rule
    dtype: str = "auto"
    save_dtype: str | None = None
    sharding: str = "auto"  # of GKD's models (engines/training/sharding.py)
    # Rounds of in-context refinement (engines/puzzle/search/refine.py); None: 3 when a child is built, else 0.
    refine: int | None = None

    def __post_init__(self) -> None:
        if self.export is not None:
            from mlxkit.engines.export.plan import check_options

            check_options(self.export, self.export_dtype)
        if self.engine is not None:
            from mlxkit.engines.serving.capabilities import get_engine

            get_engine(self.engine)  # an unknown name fails before any work
        if self.library is not None and self.recipe is not None:
            # The recipe fixes the search space of a library to build; a given library has its own.
            raise InputError(f"--recipe '{self.recipe}' builds a block library; --library '{self.library}' "
                             "already fixes the search space, so drop one of them")


def budgets_of(options: SearchOptions) -> tuple[Budgets, bool]:
    """The user's budgets; with none given, a 1.5x throughput target (and say so)."""
    given = any(v is not None for v in (options.throughput, options.memory, options.latency, options.params)) \
        or bool(options.extra_caps)
    budgets = Budgets.parse(memory=options.memory, throughput=options.throughput if given else DEFAULT_THROUGHPUT,
                            latency=options.latency, params=options.params, **options.extra_caps)
    return budgets, not given


# --------------------------------------------------------------------------- pricing without weights

_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def _require_written_shape(model: str) -> None:
    """A local config.json must state the widths: transformers fills missing ones with Llama-7B defaults."""
    import json
    from types import SimpleNamespace

    from mlxkit.engines.models.decilm.blocks import check_shape_fields
    from mlxkit.engines.models.loading import resolve_spec

    source = resolve_spec(model)
    if source.kind != "directory" or source.path is None:
        return
    try:
        written = json.loads((source.path / "config.json").read_text())
    except ValueError:
        return  # load_config reports the parse error
    if not isinstance(written, dict):
        return
    missing = [key for key in _SHAPE_KEYS if key not in written]
    if missing:
        raise InputError(f"'{model}' does not state {', '.join(missing)}; refusing to price default "
                         "(Llama-7B) widths")
    check_shape_fields(SimpleNamespace(**written))


def costs_only(model: str, target: str, scenario_text: str | None, recipe_name: str,
               reporter: Reporter | None = None, engine: str | None = None) -> dict[str, Any]:
    """Price every variant of the recipe's search space that the serving engine builds, from the config alone."""
    from mlxkit.engines.models.decilm.convert import check_parent
    from mlxkit.engines.models.loading import load_config
    from mlxkit.engines.puzzle.recipe import load_recipe
    from mlxkit.engines.puzzle.search_space import build_search_space

    _require_written_shape(model)
    config = load_config(model, reporter=reporter)
    check_parent(config)
    shape = ParentShape.from_config(config)
    profile = load_profile(target)
    scenario = profile.scenario(scenario_text)
    space = build_search_space(shape, load_recipe(recipe_name).search_space)
    serving = _serving_engine(SearchOptions(out=None, target=target, model=model, engine=engine), profile, model,
                              reporter or Reporter())
    attention = [v for v in space.attention if serving.holds_attention(v)]
    ffn = [v for v in space.ffn if serving.holds_ffn(v, shape.hidden_size)]
    table = price_variants(shape, profile, scenario, attention, ffn)
    return {
        "model": model, "target": profile.name, "engine": serving.name, "scenario": scenario.to_dict(),
        "parent_shape": shape.__dict__,
        "attention": table["attention"], "ffn": table["ffn"], "non_block": table["non_block"],
        "parent_model": table["parent"], "memory_capacity_mib": profile.capacity_mib,
    }


# --------------------------------------------------------------------------- the full search

def run_search(options: SearchOptions, reporter: Reporter | None = None) -> dict[str, Any]:
    """The whole search; under a launcher every rank runs it, and only rank 0 returns a result.

    One process group serves every distributed stage (the library build, then GKD). The serial
    stages (pricing, the MIP, assembly, evaluation, export) run on rank 0 while the other ranks
    wait for it; rank 0 alone writes and reports, and the other ranks return `{}`.
    """
    placement = training_placement(options.device, options.dtype)  # BLD and GKD train
    dist = Distributed.from_env(placement.device)
    try:
        result = _search(options, reporter or Reporter(), dist, placement)
        return result if dist.is_main else {}
    finally:
        dist.close()


def _search(options: SearchOptions, reporter: Reporter, dist: Distributed, placement: Placement) -> dict[str, Any]:
    started = time.time()
    if options.out is not None and options.out.exists() and not options.overwrite:
        raise InputError(f"output '{options.out}' already exists (pass --overwrite to replace it)")
    profile = load_profile(options.target)
    scenario = profile.scenario(options.scenario)
    budgets, defaulted = budgets_of(options)
    if defaulted:
        reporter.notice(f"no budget given: searching for {DEFAULT_THROUGHPUT} the parent's throughput "
                        f"on {profile.name} ({scenario})")

    engine = None
    if options.library is None:
        # Before the library is built: a parent the engine or format cannot hold fails in seconds, not after BLD.
        engine = _serving_engine(options, profile, options.model, reporter)
        if options.export is not None:
            from mlxkit.engines.export import check_exportable

            check_exportable(options.model, options.export, options.export_dtype, reporter)
    library_path, library = _library(options, reporter, dist)
    if engine is None:
        engine = _serving_engine(options, profile, library.parent.spec if library.parent else None, reporter)
    library, excluded = _engine_library(library, engine, reporter)
    if options.export is not None:
        library = _exportable_library(library, options.export, options.export_dtype, reporter)
    options = replace(options, engine=engine.name)
    shape = library.parent.shape if library.parent is not None else None
    parent = SearchParent(library.parent.spec, placement, options.allow_pickle, reporter) \
        if library.parent is not None else None
    solved = dist.broadcast_object(None, build=lambda: _shared_outcome(
        lambda: _solve(options, library, library_path, shape, profile, scenario, budgets, defaulted, reporter,
                       placement, parent)))
    if isinstance(solved, BaseException):
        raise solved
    result, scenario = solved.result, solved.scenario
    result["engine"] = {"name": engine.name, "export_format": engine.export_format, "excluded": excluded,
                        "serve": engine.serve}
    if library.has_trained_blocks and options.out is not None:
        assert parent is not None
        if options.gkd_tokens:
            result.update(_build_and_distil(options, library_path, library, solved, profile, started, reporter,
                                            dist, placement, parent))
        elif dist.is_main:
            result.update(_build_child(options, library_path, library, solved, profile, started, reporter,
                                       placement, parent).to_dict())
        if options.export is not None and dist.is_main:
            result["export"] = _export_child(Path(result["out"]), options, reporter)
    elif options.out is not None and dist.is_main:
        reporter.notice("an NVlabs/puzzle demo library has no trained blocks: the solution is reported, "
                        "no checkpoint is written")
    result["wall_time_s"] = round(time.time() - started, 1)
    return result


@dataclass(frozen=True)
class SolvedSearch:
    """The solve stage's outcome: its report, the block chosen for each layer, and the scenario (batch
    included, after a sweep) the choice was priced for."""

    result: dict[str, Any]
    choices: list[BlockChoice]
    scenario: Scenario


@dataclass(frozen=True)
class StagedChild:
    """The assemble stage's outcome: the saved child, its size, and its evaluation against the parent."""

    out: Path
    num_params: int
    evaluation: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"out": str(self.out), "num_params": self.num_params, "evaluation": self.evaluation}


class SearchParent:
    """The parent, read once into the compute dtype on the device for the stages before GKD: refinement
    measures children against it, assembly copies its kept blocks, evaluation compares with it.
    `release()` frees it before GKD loads the parent as its teacher."""

    def __init__(self, spec: str, placement: Placement, allow_pickle: bool, reporter: Reporter):
        self.spec, self.placement, self.allow_pickle, self.reporter = spec, placement, allow_pickle, reporter
        self._loaded: Any = None
        self._converted: Any = None

    @property
    def loaded(self):
        """The parent as `load_model` returns it (model, tokenizer, source)."""
        if self._loaded is None:
            from mlxkit.engines.models.loading import load_model

            self._loaded = load_model(self.spec, dtype=self.placement.dtype, device=self.placement.device,
                                      allow_pickle=self.allow_pickle, reporter=self.reporter)
        return self._loaded

    @property
    def converted(self):
        """The parent in the child's (DeciLM) form, run by assembly, refinement and evaluation."""
        if self._converted is None:
            from mlxkit.engines.models.decilm.convert import from_parent

            self._converted = from_parent(self.loaded.model)
            prefer_sdpa(self._converted.config)
        return self._converted

    def release(self) -> None:
        import gc

        self._loaded = self._converted = None
        gc.collect()


def _solve(options: SearchOptions, library: BlockLibrary, library_path: Path, shape: ParentShape | None,
           profile: HardwareProfile, scenario: Scenario, budgets: Budgets, defaulted: bool, reporter: Reporter,
           placement: Placement, parent: SearchParent | None) -> SolvedSearch:
    """Price the library, solve the MIP (refined in context when asked) and describe the best solution
    (rank 0's stage)."""
    stored = stored_costs(library) if options.costs == "library" else None

    def price(batch: int) -> LibraryCosts:
        # The stored stats stand for whatever they were measured for; only profile prices follow the batch.
        return stored if stored is not None else price_library(library, profile, scenario.with_batch(batch), shape)

    def make(batch: int) -> tuple[SearchProblem, dict[str, float]]:
        tokens = scenario.with_batch(batch).tokens
        problem = library_problem(library, price(batch), metric=options.metric, tokens=tokens)
        return problem, budgets.constraints(tokens, parent_totals(problem, shape).get("runtime_ms"))

    t0 = time.perf_counter()
    sweep_report = None
    if options.batch_sweep:
        sweep = sweep_batch_sizes(make, options.batch_sweep)
        scenario = scenario.with_batch(sweep.best_batch)
        sweep_report = {b: (s.objective if isinstance(s, Solution) else s) for b, s in sweep.per_batch.items()}
    costs = price(scenario.batch)
    problem, caps = make(scenario.batch)
    held_out = _held_out_scoring(options, library, library_path, problem)
    rounds = options.refine if options.refine is not None else (3 if options.out is not None else 0)
    sampled = library.calibration is not None and library.calibration.startswith("sampled")
    if options.refine is None and rounds and sampled and held_out is not None:
        # Measured: on text sampled from the parent, refining chose children that were better on that
        # text and much worse on real text (BENCHMARKS.md, "In-context refinement").
        rounds = 0
        reporter.notice("not refining by default: the library was calibrated on text sampled from the parent, "
                        "where refinement chose children worse on real text; --refine N forces it, and a "
                        "library built with --data refines by default")
    refining = bool(rounds) and held_out is not None
    # Every search solves on the isolated scores first: a refining one then measures and corrects, so the
    # same command gives the same child whatever ran before it; one that does not refine only estimates
    # its child with this target's last corrections (measured: they predict a child's KL better than the
    # isolated sum, but a solve on corrections from another budget's child can pick a worse child).
    corrections = (Corrections.read(held_out.root, options.metric, held_out.tokens_hash, profile.name)
                   if held_out is not None and not refining else None)
    parents = parent_choice_names(problem, shape)
    solver = Solver.build(problem)
    # Written before solving, so that an infeasible budget can be inspected too.
    written = _write_costs_and_lp(options, costs, solver, caps)
    min_distance = options.min_distance or max(1, round(0.2 * len(problem.layers)))
    solutions = solver.solve_many(caps, k=options.solutions, min_distance=min_distance)
    solve_s = time.perf_counter() - t0
    parent_stats = parent_totals(problem, shape)
    best = solutions[0]
    refinement = None
    if refining:
        assert held_out is not None
        corrections = Corrections(options.metric, held_out.tokens_hash, profile.name)
        assert parent is not None  # held_out needs trained blocks, so the library records its parent
        outcome = refine(problem, lambda p: Solver.build(p).solve(caps), _child_measurer(held_out, parent, reporter),
                         parents, corrections, max_rounds=rounds, first=best)
        corrections.write(held_out.root)
        solved = corrections.corrected(problem, parents)
        best = outcome.solution
        solutions = [best] + [s for s in Solver.build(solved).solve_many(caps, k=options.solutions,
                                                                          min_distance=min_distance)
                              if s.choices != best.choices][:options.solutions - 1]
        refinement = outcome.to_dict()
        _announce_refinement(outcome, reporter)
    elif options.refine and held_out is None:
        reporter.notice("--refine skipped: it needs a library with trained blocks and its held-out tokens, "
                        "scored by a loss (kl_div or lm_loss)")
    choices = solution_block_choices(best)
    _check_attention_kept(choices, options)

    result: dict[str, Any] = {
        "target": profile.name, "scenario": scenario.to_dict(), "budgets": budgets.describe(), "caps": caps,
        "budgets_defaulted": defaulted, "library": str(library_path), "metric": options.metric,
        "costs": options.costs, "objective": best.objective, "status": best.status,
        "objective_isolated": isolated_sum(problem, best),
        # The kept child's KL as this target's in-context corrections estimate it (None without any).
        "estimate_corrected": isolated_sum(corrections.corrected(problem, parents), best) if corrections else None,
        "corrected": refinement is not None and refinement["best_round"] > 0,  # chosen by a corrected solve
        "solve_time_s": round(solve_s, 3),
        "choices": [{"layer": i, "attention": c.attention.name, "ffn": c.ffn.name} for i, c in enumerate(choices)],
        "predicted": _predicted(best.totals, parent_stats, scenario, profile),
        "alternatives": [{"objective": s.objective, "totals": s.totals, "choices": s.choices,
                          "distance_from_best": s.distance(best)} for s in solutions[1:]],
        **written,
    }
    if sweep_report is not None:
        result["batch_sweep"] = sweep_report
    if refinement is not None:
        result["refinement"] = refinement
    return SolvedSearch(result, choices, scenario)


@dataclass(frozen=True)
class _HeldOutScoring:
    """The library's directory and the held-out tokens its variants were scored on."""

    root: Path
    val_ids: torch.Tensor
    tokens_hash: str


def _held_out_scoring(options: SearchOptions, library: BlockLibrary, library_path: Path,
                      problem: SearchProblem) -> _HeldOutScoring | None:
    """What in-context refinement needs, or None where it cannot run: no trained blocks (an NVlabs demo
    library), no held-out tokens kept, or a bigger-is-better metric."""
    if not library.has_trained_blocks or problem.bigger_is_better:
        return None
    val = _held_out_tokens(library_path, options.eval_sequences)
    return None if val is None else _HeldOutScoring(_library_root(library_path).root, val, tokens_hash(val))


def _library_root(library_path: Path) -> LibraryDir:
    return LibraryDir(library_path if library_path.is_dir() else library_path.parent)


def _held_out_tokens(library_path: Path, sequences: int) -> torch.Tensor | None:
    """The first `sequences` held-out sequences the library was scored on (None where it kept none)."""
    tokens_file = _library_root(library_path).work / "tokens.pt"
    if not tokens_file.exists():
        return None
    return torch.load(tokens_file, weights_only=True)["val"][:sequences]


def _child_measurer(held_out: _HeldOutScoring, search_parent: SearchParent, reporter: Reporter):
    """`measure(solution)` for `refine`: the solution's child assembled and measured against the parent."""
    from mlxkit.engines.puzzle.search.assemble import assemble_child

    library = read_library(held_out.root)
    assert library.parent is not None
    round_index = 0

    def measure(solution: Solution) -> ChildMeasurement:
        nonlocal round_index
        round_index += 1
        parent = search_parent.converted
        choices = solution_block_choices(solution)
        child = assemble_child(parent, LibraryDir(held_out.root), choices).eval()
        replaced = sum((c.attention != parent_attention(library.parent.shape))
                       + (c.ffn != parent_ffn(library.parent.shape)) for c in choices)
        with reporter.task(f"refinement round {round_index}: the child's {replaced} replaced subblocks in context",
                           total=replaced) as task:
            return measure_child(parent, child, choices, held_out.val_ids, on_subblock=task.advance)

    return measure


def _announce_refinement(outcome: RefinementResult, reporter: Reporter) -> None:
    for index, entry in enumerate(outcome.rounds):
        reporter.notice(f"refinement round {index + 1}: predicted KL {entry.predicted_isolated:.4f} from isolated "
                        f"scores, {entry.predicted_corrected:.4f} corrected; measured {entry.measured:.4f}")
    reporter.notice(f"refinement kept round {outcome.best_round + 1}'s child ({outcome.stopped})")


def _shared_outcome(stage):
    """`stage()`'s result, or the error it raised, so that rank 0 can hand either to the other ranks."""
    try:
        return stage()
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank by the caller
        return exc


def _library(options: SearchOptions, reporter: Reporter, dist: Distributed) -> tuple[Path, BlockLibrary]:
    if options.library is not None:
        if not options.library.exists():
            raise InputError(f"library '{options.library}' does not exist")
        return options.library, read_library(options.library)
    path = ensure_library(options.model, options.recipe or "quick", data=options.data, seed=options.seed,
                          allow_pickle=options.allow_pickle, device=options.device, dtype=options.dtype,
                          save_dtype=options.save_dtype, reporter=reporter)
    dist.barrier()  # rank 0 writes the library's index after the other ranks are done
    return path, read_library(path)


def _exportable_library(library: BlockLibrary, fmt: str, dtype: str, reporter: Reporter) -> BlockLibrary:
    """`library` without the FFN variants that `fmt` cannot hold (attention variants all export)."""
    from mlxkit.engines.export import check_exportable, ffn_expressible

    if library.parent is None:
        raise InputError(f"--export {fmt} needs a library that records its parent's shape (an mlxkit library); "
                         "an NVlabs/puzzle demo library has none")
    check_exportable(library.parent.spec, fmt, dtype, reporter)
    hidden = library.parent.shape.hidden_size
    dropped = sorted({name for layer in library.layers for name, entry in layer.ffn.items()
                      if not ffn_expressible(fmt, entry.variant, hidden)})
    if dropped:
        reporter.notice(f"--export {fmt}: searching without the FFN variants {', '.join(dropped)}, "
                        f"which {fmt} cannot hold")
    return library.with_ffn_only(lambda variant: ffn_expressible(fmt, variant, hidden), f"that {fmt} can hold")


def _serving_engine(options: SearchOptions, profile: HardwareProfile, parent_spec: str | None,
                    reporter: Reporter):
    """The engine the child is searched for: `--engine`, else the one `--export` implies, else the profile's.

    An engine the user named that cannot hold the parent is an error; the profile's default engine
    that cannot hold it gives way to transformers, with a notice that says why.
    """
    from mlxkit.engines.serving.capabilities import (ENGINES, check_engine_format, check_engine_holds_parent,
                                                     engines_for_format, get_engine)

    if options.engine is not None:
        engine, named = get_engine(options.engine), True
        if options.export is not None:
            check_engine_format(engine, options.export)
    else:
        engine, named = get_engine(profile.serving_engine), False
        if options.export is not None and engine.export_format != options.export:
            engine = engines_for_format(options.export)[0]
            reporter.notice(f"--export {options.export}: searching for {engine.title}, which loads it "
                            f"({profile.name}'s usual engine is {profile.serving_engine}; --engine overrides)")
    if parent_spec is None:
        return engine
    config, rope_type = _parent_config_and_rope(parent_spec, reporter)
    try:
        check_engine_holds_parent(engine, config, rope_type)
    except InputError as exc:
        if named:
            raise
        fallback = ENGINES["transformers"]
        reporter.notice(f"{exc}: searching for {fallback.title} instead (pass --engine to choose)")
        return fallback
    return engine


def _parent_config_and_rope(spec: str, reporter: Reporter) -> tuple[Any, str]:
    from mlxkit.engines.export.plan import rope_of
    from mlxkit.engines.models.loading import load_config

    config = load_config(spec, reporter=reporter)
    return config, rope_of(config).rope_type


def _engine_library(library: BlockLibrary, engine, reporter: Reporter) -> tuple[BlockLibrary, dict[str, list[str]]]:
    """`library` without the variants `engine` cannot build, and the names of those it dropped, per subblock."""
    hidden = library.parent.shape.hidden_size if library.parent is not None else None
    # Without the parent's shape (an NVlabs demo library) only the kinds can be checked, not the widths.
    keep_ffn = (lambda v: engine.holds_ffn(v, hidden)) if hidden is not None else (lambda v: v.kind in engine.ffn)
    excluded = {
        "attention": sorted({name for layer in library.layers for name, entry in layer.attention.items()
                             if not engine.holds_attention(entry.variant)}),
        "ffn": sorted({name for layer in library.layers for name, entry in layer.ffn.items()
                       if not keep_ffn(entry.variant)}),
    }
    if excluded["attention"] or excluded["ffn"]:
        parts = [f"{label} {', '.join(names)}" for label, names in (("attention", excluded["attention"]),
                                                                     ("FFN", excluded["ffn"])) if names]
        keeps = "" if engine.name in ("trtllm", "transformers") else " (--engine trtllm or transformers keeps them)"
        reporter.notice(f"--engine {engine.name}: searching without {' and '.join(parts)}, which {engine.title} "
                        f"cannot build{keeps}")
    why = f"that {engine.title} can build"
    library = library.with_attention_only(engine.holds_attention, why).with_ffn_only(keep_ffn, why)
    return library, excluded


def _check_attention_kept(choices: list[BlockChoice], options: SearchOptions) -> None:
    from mlxkit.engines.errors import InfeasibleError
    from mlxkit.engines.serving.capabilities import get_engine

    engine = get_engine(options.engine or "transformers")
    needs = engine.needs_attention_layer or options.export == "gguf"
    if needs and not any(c.attention.kind == "gqa" for c in choices):
        raise InfeasibleError(f"the solution keeps attention in no layer, and {engine.title} needs at least one: "
                              "loosen the budget, or choose another --engine")


def export_path(out: Path, fmt: str, dtype: str) -> Path:
    """Where `--export` writes inside the child directory: `model-<dtype>.gguf`, or `export-<format>/`."""
    return out / (f"model-{dtype}.gguf" if fmt == "gguf" else f"export-{fmt}")


def _export_child(out: Path, options: SearchOptions, reporter: Reporter) -> dict[str, Any]:
    from mlxkit.engines.export import export_model

    assert options.export is not None
    with reporter.task(f"exporting the child to {options.export} ({options.export_dtype})"):
        written = export_model(out, options.export, export_path(out, options.export, options.export_dtype),
                               options.export_dtype, overwrite=True, reporter=reporter)
    return {"format": written["format"], "dtype": written["dtype"], "out": written["out"],
            "manifest": written["manifest"], "notes": written["notes"]}


def _write_costs_and_lp(options: SearchOptions, costs: LibraryCosts, solver: Solver,
                        caps: dict[str, float]) -> dict[str, str]:
    written = {}
    if options.write_costs is not None:
        atomic_write_json(options.write_costs, costs.model_dump(mode="json", exclude_none=True))
        written["costs_file"] = str(options.write_costs)
    if options.write_lp is not None:
        written["lp_file"] = str(solver.write_lp(options.write_lp, caps))
    return written


def _predicted(totals: dict[str, float], parent: dict[str, float], scenario: Scenario,
               profile: HardwareProfile) -> dict[str, Any]:
    runtime, parent_runtime = totals.get("runtime_ms"), parent.get("runtime_ms")
    return {
        "memory_mib": totals.get("memory_mib"), "parent_memory_mib": parent.get("memory_mib"),
        "memory_capacity_mib": profile.capacity_mib,
        "runtime_ms": runtime, "parent_runtime_ms": parent_runtime,
        "tokens_per_s": scenario.tokens / runtime * 1e3 if runtime else None,
        "parent_tokens_per_s": scenario.tokens / parent_runtime * 1e3 if parent_runtime else None,
        "speedup": parent_runtime / runtime if runtime and parent_runtime else None,
        "num_params": totals.get("num_params"), "parent_num_params": parent.get("num_params"),
    }


def search_work_dir(out: Path) -> Path:
    """Where `--gkd-tokens` keeps the assembled child until its distilled version is saved."""
    out = Path(out).expanduser().resolve()
    return out.parent / f".{out.name}.search-work"


def _build_and_distil(options: SearchOptions, library_path: Path, library: BlockLibrary, solved: SolvedSearch,
                      profile: HardwareProfile, started: float, reporter: Reporter, dist: Distributed,
                      placement: Placement, parent: SearchParent) -> dict[str, Any]:
    """Assemble the child (or reuse the one an earlier run staged under the same stage key), then GKD it.

    Rank 0 assembles and stages the child while the other ranks wait; then every rank takes part in GKD,
    which resumes its own work only while the staged child it trains is the same.
    """
    import shutil

    from mlxkit.engines.distill.recipe import load_distill_recipe
    from mlxkit.engines.distill.trainer import DistillationOptions, run_distillation

    assert library.parent is not None and options.out is not None
    result, scenario = solved.result, solved.scenario
    recipe = load_distill_recipe(options.gkd_recipe).with_overrides(options.gkd_overrides)  # fail before work
    staged_dir = search_work_dir(options.out) / "child-before-gkd"
    staged: StagedChild | None = None
    if dist.is_main:
        key = _child_stage_key(library_path, solved, options, placement)
        staged = _staged_child(staged_dir, key)
        if staged is not None:
            reporter.notice(f"reusing the child assembled by an earlier run at {staged_dir}")
        else:
            staged = _build_child(replace(options, out=staged_dir, overwrite=True), library_path, library, solved,
                                  profile, started, reporter, placement, parent, stage_key=key)
        parent.release()  # GKD reads the parent again, as its teacher
    staged = dist.broadcast_object(staged)
    assert staged is not None
    search_stages = {"library": str(library_path), "target": profile.name, "engine": options.engine,
                     "scenario": scenario.to_dict(),
                     "budgets": result["budgets"], "caps": result["caps"], "mip": {
                         "objective": result["objective"], "status": result["status"],
                         "metric": options.metric, "solve_time_s": result["solve_time_s"]},
                     "predicted": result["predicted"], "choices": result["choices"],
                     "child_before_gkd": {"num_params": staged.num_params, "evaluation": staged.evaluation}}
    reporter.notice(f"global distillation of the child on {options.gkd_tokens} tokens "
                    f"({'--data ' + str(options.data) if options.data else 'text sampled from the parent'})")
    summary = run_distillation(DistillationOptions(
        mode="gkd", teacher=library.parent.spec, student=str(staged.out), out=options.out, recipe=recipe,
        data=options.data, tokens=options.gkd_tokens, seed=options.seed, overwrite=options.overwrite,
        allow_pickle=options.allow_pickle, device=options.device, dtype=options.dtype, save_dtype=options.save_dtype,
        sharding=options.sharding, discard_other_runs=True, manifest_extra={"search": search_stages}), reporter)
    if not dist.is_main:
        return {}
    after = _evaluate_saved_child(Path(summary["out"]), library_path, library, options, placement, reporter)
    shutil.rmtree(search_work_dir(options.out), ignore_errors=True)
    return {"out": summary["out"], "num_params": staged.num_params, "evaluation": staged.evaluation,
            "evaluation_after_gkd": after, "gkd": {k: v for k, v in summary.items() if k != "out"}}


def _child_stage_key(library_path: Path, solved: SolvedSearch, options: SearchOptions,
                     placement: Placement) -> dict[str, Any]:
    """What the assembled child depends on: the library's index (its blocks and scores), the choices, the
    held-out evaluation and the dtypes it is computed and saved in."""
    from mlxkit.engines.core.manifest import content_hash

    return {"library": content_hash(_library_root(library_path).index_file), "choices": solved.result["choices"],
            "eval_sequences": options.eval_sequences, "compute_dtype": str(placement.dtype),
            "save_dtype": options.save_dtype}


def _staged_child(staged_dir: Path, key: dict[str, Any]) -> StagedChild | None:
    """The child an earlier run staged in `staged_dir` under the same stage key, else None."""
    import json

    try:
        recorded = json.loads((staged_dir / "mlxkit.json").read_text())["results"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if recorded.get("stage_key") != json.loads(json.dumps(key)):
        return None
    return StagedChild(staged_dir, recorded.get("num_params"), recorded.get("evaluation") or {})


def _evaluate_saved_child(child_dir: Path, library_path: Path, library: BlockLibrary, options: SearchOptions,
                          placement: Placement, reporter: Reporter) -> dict[str, Any]:
    """The saved child against the parent on the held-out tokens the undistilled child was evaluated on."""
    from mlxkit.engines.models.loading import load_model

    assert library.parent is not None
    val = _held_out_tokens(library_path, options.eval_sequences)
    if val is None:
        return {}
    parent = load_model(library.parent.spec, dtype=placement.dtype, device=placement.device,
                        allow_pickle=options.allow_pickle, with_tokenizer=False, reporter=reporter).model
    child = load_model(str(child_dir), dtype=placement.dtype, device=placement.device, with_tokenizer=False,
                       reporter=reporter).model
    return _held_out_evaluation(child, parent, val.to(placement.device), reporter)


def _held_out_evaluation(child, parent, val: torch.Tensor, reporter: Reporter) -> dict[str, Any]:
    from mlxkit.engines.eval.language_model import evaluate

    with reporter.task("evaluating child against parent on held-out tokens"):
        child_eval = evaluate(child, val, reference=parent)
        parent_eval = evaluate(parent, val)
    return {"perplexity": child_eval.perplexity, "parent_perplexity": parent_eval.perplexity,
            "kl_div": child_eval.kl_div, "top1_agreement": child_eval.top1_agreement, "tokens": child_eval.tokens}


def _build_child(options: SearchOptions, library_path: Path, library: BlockLibrary, solved: SolvedSearch,
                 profile: HardwareProfile, started: float, reporter: Reporter, placement: Placement,
                 parent: SearchParent, stage_key: dict[str, Any] | None = None) -> StagedChild:
    from mlxkit.engines.models.loading import source_dtype
    from mlxkit.engines.models.saving import save_model
    from mlxkit.engines.puzzle.search.assemble import assemble_child

    assert library.parent is not None  # has_trained_blocks
    result, scenario = solved.result, solved.scenario
    root = _library_root(library_path)
    # Assembly and evaluation only run forwards: the parent is held in the compute dtype on the device.
    loaded, converted = parent.loaded, parent.converted
    save_dtype = placement.save_dtype(source_dtype(loaded.source), options.save_dtype)
    child = assemble_child(converted, root, solved.choices)
    n_params = sum(p.numel() for p in child.parameters())

    val = _held_out_tokens(library_path, options.eval_sequences)
    evaluation = {} if val is None else _held_out_evaluation(child, converted, val.to(placement.device), reporter)

    manifest = Manifest(verb="search", started=started)
    manifest.add_input("parent", parent.spec, loaded.source.path)
    manifest.add_input("library", str(library_path), root.index_file)
    manifest.seeds = {"seed": options.seed}
    manifest.settings = {"target": profile.name, "engine": options.engine, "scenario": scenario.to_dict(),
                         "budgets": result["budgets"], "caps": result["caps"], "metric": options.metric,
                         "costs": options.costs,
                         "recipe": None if options.library is not None else options.recipe or "quick"}
    manifest.results = {"objective": result["objective"], "predicted": result["predicted"],
                        "choices": result["choices"], "evaluation": evaluation, "num_params": n_params,
                        **({"stage_key": stage_key} if stage_key is not None else {})}
    child.generation_config = loaded.model.generation_config
    out = save_model(child, loaded.tokenizer, options.out, manifest, overwrite=options.overwrite, dtype=save_dtype)
    return StagedChild(Path(out), n_params, evaluation)
