"""Puzzle architecture search: pick a per-layer child under hardware budgets and save it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mlxkit.cli._errors import fail, guarded
from mlxkit.cli._options import (AllowPickleOpt, DataOpt, DeviceOpt, DtypeOpt, JsonOpt, Output, OverwriteOpt,
                                 QuietOpt, RecipeOpt, SaveDtypeOpt, SeedOpt, ShardingOpt, VerboseOpt, check_placement,
                                 ModeOptions, claimed_output, console, flags_and_overrides, given_options,
                                 new_or_old, renamed_option, set_option)
from mlxkit.engines.core.sizes import SIZE_HELP

GkdSetOpt = set_option("--gkd-set", help="Override a field of the GKD recipe (--gkd-recipe), key=value "
                                         "(repeatable), e.g. --set optim.lr=3e-4; --gkd-set is the older spelling.")


_SEARCH = frozenset({"out", "throughput", "memory", "latency", "params", "library", "costs", "metric", "solutions",
                     "min_distance", "batch_sweep", "write_costs", "write_lp", "refine", "dry_run", "gkd_tokens",
                     "gkd_recipe", "gkd_set", "export", "encoding", "export_dtype", "data", "device", "dtype",
                     "save_dtype", "sharding", "seed", "overwrite", "allow_pickle"})
_MODES = ModeOptions("search", common=frozenset({"target", "model", "scenario", "recipe", "engine", "costs_only",
                                                "json_out", "quiet", "verbose"}),
                     modes={"--costs-only": frozenset(), "without --costs-only": _SEARCH})
# GKD of the saved child is the only stage that reads these; --out and --overwrite name a child --dry-run never saves
_GKD_ONLY = ("gkd_recipe", "gkd_set", "sharding")
_SAVED_ONLY = ("out", "overwrite")


@guarded
def search_command(
    ctx: typer.Context,
    target: Annotated[str, typer.Option("--target", "-t", help="Hardware profile name (h100, h200, a100-80gb, l40s, cpu, ...) or YAML path.")] = "h100",
    model: Annotated[str, typer.Option("--model", "-m", help="Parent model.")] = "smollm2-135m",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Where to save the child checkpoint. Default: ./puzzle-child-TARGET. With a frontier (several --throughput, --dry-run): a report directory for frontier.json and its picture.")] = None,
    throughput: Annotated[Optional[str], typer.Option("--throughput", help="Minimum throughput: tokens/s or a multiple of the parent's, e.g. 2x. Several, comma-separated, with --dry-run: the frontier.")] = None,
    memory: Annotated[Optional[str], typer.Option("--memory", help=f"Maximum memory: {SIZE_HELP}; e.g. 80GiB or 40GB.")] = None,
    latency: Annotated[Optional[str], typer.Option("--latency", help="Maximum runtime of one scenario batch, e.g. 30s.")] = None,
    params: Annotated[Optional[str], typer.Option("--params", help="Maximum parameter count, e.g. 100M.")] = None,
    scenario: Annotated[Optional[str], typer.Option("--scenario", help="Deployment scenario, e.g. batch=256,in=128,out=1024,weights=fp8; fields not given keep the target profile's default scenario.")] = None,
    recipe: RecipeOpt = None,
    library: Annotated[Optional[Path], typer.Option("--library", help="Block library (mlxkit dir/JSON, or an NVlabs/puzzle demo JSON).")] = None,
    costs: Annotated[str, typer.Option("--costs", help="'profile' (predict from shapes) or 'library' (the library's own stats).")] = "profile",
    metric: Annotated[str, typer.Option("--metric", help="Library metric to optimise (kl_div, lm_loss, top1_agreement).")] = "kl_div",
    solutions: Annotated[int, typer.Option("--solutions", min=1, help="Number of diverse solutions.")] = 1,
    min_distance: Annotated[Optional[int], typer.Option("--min-distance", min=1, help="Layers in which solutions must differ (default 20%).")] = None,
    batch_sweep: Annotated[Optional[str], typer.Option("--batch-sweep", help="Comma-separated batch sizes to solve for; keeps the best.")] = None,
    costs_only: Annotated[bool, typer.Option("--costs-only", help="Price the search space from the config alone (no weights).")] = False,
    write_costs: Annotated[Optional[Path], typer.Option("--write-costs", help="Write the priced variants of every layer (JSON).")] = None,
    write_lp: Annotated[Optional[Path], typer.Option("--write-lp", help="Write the MIP, caps included, in the LP file format.")] = None,
    refine: Annotated[Optional[int], typer.Option("--refine", min=0, help="Rounds of in-context refinement: measure the chosen child, correct the scores with what each replaced block costs in it, solve again (default 3 when a child is saved, 0 with --dry-run; corrections are kept beside the library and used by later solves on it).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Solve and report, but write no checkpoint (--write-costs and --write-lp still write their files).")] = False,
    gkd_tokens: Annotated[Optional[int], typer.Option("--gkd-tokens", min=1, help="Then distil the child against the parent (GKD) on this many tokens of --data (default: text sampled from the parent); resumable.")] = None,
    gkd_recipe: Annotated[str, typer.Option("--gkd-recipe", help="Distillation recipe for --gkd-tokens (name or YAML path).")] = "gkd",
    gkd_set: GkdSetOpt = [],
    engine: Annotated[Optional[str], typer.Option("--engine", help="The serving engine the child is for: vllm, sglang, trtllm, llamacpp or transformers. Searches only the blocks it builds (vllm/sglang: no linear attention or FFN, Nemotron-NAS widths) and is recorded in the manifest. Default: the target profile's (GPUs: vllm; cpu-llamacpp: llamacpp; cpu: transformers).")] = None,
    export: Annotated[Optional[str], typer.Option("--export", help="Search only what this serving format can hold (gguf: no linear FFN; nemotron-nas: widths exact as ffn_mult), then export the child into --out: model-ENCODING.gguf or export-FORMAT/.")] = None,
    encoding: Annotated[Optional[str], typer.Option("--encoding", help="How --export writes the weights: f32 | f16 "
                                                    "| q8_0 (q8_0: gguf only; default f32). Needs --export.")] = None,
    export_dtype: Annotated[Optional[str], renamed_option("--export-dtype")] = None,
    data: DataOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    save_dtype: SaveDtypeOpt = None,
    sharding: ShardingOpt = "auto",
    seed: SeedOpt = 0,
    overwrite: OverwriteOpt = False,
    allow_pickle: AllowPickleOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    from mlxkit.cli.search_render import render_costs, render_frontier, render_search
    from mlxkit.engines.puzzle.search.frontier import search_frontier, write_frontier_report
    from mlxkit.engines.puzzle.search.run import SearchOptions, costs_only as price_only, run_search

    check_placement(device, dtype, save_dtype)
    output = Output(json_out, quiet, verbose)
    reporter = output.reporter
    if costs not in ("profile", "library"):
        raise fail(f"--costs must be 'profile' or 'library' (got '{costs}')")
    _MODES.check(ctx, "--costs-only" if costs_only else "without --costs-only")
    if costs_only:
        report = price_only(model, target, scenario, recipe or "quick", reporter, engine=engine)
        output.emit(report, lambda r: render_costs(r, console))
        return
    flags_and_overrides({"schedule.tokens": ("--gkd-tokens", gkd_tokens)}, gkd_set, "--gkd-set")  # neither silently wins
    encoding = new_or_old("--encoding", encoding, "--export-dtype", export_dtype)
    if encoding is not None and export is None:
        raise fail("--encoding sets how the exported child is written; it needs --export")
    if gkd_tokens and dry_run:
        raise fail("--gkd-tokens trains the saved child; it cannot be combined with --dry-run")
    for name, flag in given_options(ctx, _GKD_ONLY if gkd_tokens is None else ()):
        raise fail(f"{flag} means nothing without --gkd-tokens, which would ignore it (it sets how the saved child "
                   "is distilled)")
    frontier = throughput is not None and "," in throughput
    for name, flag in given_options(ctx, _SAVED_ONLY if dry_run and not frontier else ()):
        raise fail(f"{flag} means nothing with --dry-run, which saves no child and would ignore it")
    try:
        sweep = tuple(int(b) for b in batch_sweep.split(",")) if batch_sweep else ()
    except ValueError:
        raise fail(f"--batch-sweep takes comma-separated integers (got '{batch_sweep}')") from None
    target_name = Path(target).stem if target.endswith((".yaml", ".yml")) else target
    options = SearchOptions(out=None if dry_run else (out or Path(f"puzzle-child-{target_name}")), target=target,
                            model=model, recipe=recipe, library=library, data=data, throughput=throughput,
                            memory=memory, latency=latency, params=params, scenario=scenario, costs=costs,  # type: ignore[arg-type]
                            metric=metric, solutions=solutions, min_distance=min_distance, batch_sweep=sweep,
                            write_costs=write_costs, write_lp=write_lp, seed=seed, overwrite=overwrite,
                            allow_pickle=allow_pickle, gkd_tokens=gkd_tokens, gkd_recipe=gkd_recipe,
                            gkd_overrides=flags_and_overrides({}, gkd_set), export=export,
                            export_encoding=encoding or "f32", engine=engine, device=device, dtype=dtype,
                            save_dtype=save_dtype, sharding=sharding, refine=refine)
    if frontier:
        if not dry_run:
            raise fail("several --throughput targets draw the frontier: add --dry-run (one checkpoint per run)")
        with claimed_output(out, kind="dir", inputs=[model, library, data]) as report_dir:
            result = search_frontier(options, [t.strip() for t in throughput.split(",")], reporter)
            if report_dir is not None and result:
                result["report"] = {"out": str(report_dir),
                                    **write_frontier_report(report_dir, result, options, overwrite=overwrite)}
        output.emit(result, lambda r: render_frontier(r, console))
        return
    with claimed_output(options.out, kind="dir", inputs=[model, library, data]):
        result = run_search(options, reporter)
    output.emit(result, lambda r: render_search(r, console, quiet))
