"""`mlx search`: Puzzle end to end, from a parent to a saved child checkpoint.

The stages, each in its own module (what exists is reused, what is missing is built):
  1. the block library for (model, recipe): built and scored by `mlx library build` if missing
     (`library/build.py`), cached under a digest of its inputs;
  2. the serving engine (`--engine`, else the hardware profile's) and `--export`'s format limit the
     search space to the blocks they hold (`serving_fit.py`): a library built once serves every
     engine, filtered here at solve time;
  3. pricing every variant on the hardware profile for the deployment scenario, and the MIP under
     the user's budgets, optionally swept over batch sizes, refined in context, and asked for
     several diverse solutions (`solution.py`, a typed `SolvedSearch`);
  4. the best child assembled from the library's trained blocks, evaluated against the parent on
     held-out tokens and saved; with `gkd_tokens`, staged under its stage key and distilled
     against the parent (GKD), then exported into `out` with `export` (`child.py`).

Every stage that keeps work between runs (the library, the staged child, the GKD run) follows the
stage-key rule of `engines/core/stage_key.py`: the same key resumes or reuses, another discards the
stale work with a notice and starts over. So a rerun of the same command resumes at the stage it
stopped in, and a rerun with other choices assembles and distils afresh.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError
from mlxkit.engines.hardware.costs import price_variants
from mlxkit.engines.hardware.profile import load_profile
from mlxkit.engines.models.decilm.blocks import ParentShape
from mlxkit.engines.puzzle.library.build import ensure_library, missing_variants
from mlxkit.engines.puzzle.library.schema import BlockLibrary
from mlxkit.engines.puzzle.library.store import read_library
from mlxkit.engines.puzzle.search.child import build_and_distil, build_child, export_child
from mlxkit.engines.puzzle.search.parent import SearchParent
from mlxkit.engines.puzzle.search.options import DEFAULT_THROUGHPUT, SearchOptions, budgets_of
from mlxkit.engines.puzzle.search.serving_fit import (engine_library, exportable_library, search_variants,
                                                        serving_engine)
from mlxkit.engines.puzzle.search.solution import solve_search
from mlxkit.engines.training.device import Placement, training_placement
from mlxkit.engines.training.distributed import Distributed

__all__ = ["SearchOptions", "costs_only", "run_search"]

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
    serving = serving_engine(SearchOptions(out=None, target=target, model=model, engine=engine), profile, model,
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
        engine = serving_engine(options, profile, options.model, reporter)
        if options.export is not None:
            from mlxkit.engines.export import check_exportable

            check_exportable(options.model, options.export, options.export_encoding, reporter)
    library_path, library = _library(options, reporter, dist, engine)
    if engine is None:
        engine = serving_engine(options, profile, library.parent.spec if library.parent else None, reporter)
        _note_missing_variants(library_path, library, engine, options.export, reporter)
    library, excluded = engine_library(library, engine, reporter)
    if options.export is not None:
        library = exportable_library(library, options.export, options.export_encoding, reporter)
    options = replace(options, engine=engine.name)
    shape = library.parent.shape if library.parent is not None else None
    parent = SearchParent(library.parent.spec, placement, options.allow_pickle, reporter) \
        if library.parent is not None else None
    solved = dist.broadcast_object(None, build=lambda: _shared_outcome(
        lambda: solve_search(options, library, library_path, shape, profile, scenario, budgets, defaulted, reporter,
                       placement, parent)))
    if isinstance(solved, BaseException):
        raise solved
    result = solved.report()
    result["engine"] = {"name": engine.name, "export_format": engine.export_format, "excluded": excluded,
                        "serve": engine.serve}
    if library.has_trained_blocks and options.out is not None:
        assert parent is not None
        if options.gkd_tokens:
            result.update(build_and_distil(options, library_path, library, solved, profile, started, reporter,
                                            dist, placement, parent))
        elif dist.is_main:
            result.update(build_child(options, library_path, library, solved, profile, started, reporter,
                                       placement, parent).to_dict())
        if options.export is not None and dist.is_main:
            result["export"] = export_child(Path(result["out"]), options, reporter)
    elif options.out is not None and dist.is_main:
        reporter.notice("an NVlabs/puzzle demo library has no trained blocks: the solution is reported, "
                        "no checkpoint is written")
    result["wall_time_s"] = round(time.time() - started, 1)
    return result


def _shared_outcome(stage):
    """`stage()`'s result, or the error it raised, so that rank 0 can hand either to the other ranks."""
    try:
        return stage()
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank by the caller
        return exc


def _note_missing_variants(path: Path, library: BlockLibrary, engine, export: str | None, reporter: Reporter) -> None:
    """A notice when a given library lacks variants of its recipe's space that the search could choose
    (one built for another engine's variants, say)."""
    if missing := missing_variants(library, search_variants(engine, export)):
        root = path if path.is_dir() else path.parent
        reporter.notice(f"the library '{path}' has no {', '.join(missing)} of its recipe's search space, which "
                        f"{engine.title} builds: the search chooses without them (`mlx library build --out {root} "
                        f"--engine {engine.name}` adds them)")


def _library(options: SearchOptions, reporter: Reporter, dist: Distributed, engine) -> tuple[Path, BlockLibrary]:
    """The library the search reads: `--library`, else the cache's, built or extended for what `engine`
    (and `--export`'s format) can use, so no block the search cannot choose is trained or scored."""
    if options.library is not None:
        if not options.library.exists():
            raise InputError(f"library '{options.library}' does not exist")
        return options.library, read_library(options.library)
    path = ensure_library(options.model, options.recipe or "quick", data=options.data, seed=options.seed,
                          allow_pickle=options.allow_pickle, device=options.device, dtype=options.dtype,
                          save_dtype=options.save_dtype, variants=search_variants(engine, options.export),
                          reporter=reporter)
    dist.barrier()  # rank 0 writes the library's index after the other ranks are done
    return path, read_library(path)
