"""The Puzzle block library: `mlx library build` trains and scores every block variant of a parent (BLD)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from mlxkit.cli._errors import fail, guarded
from mlxkit.cli._options import (AllowPickleOpt, DataOpt, DeviceOpt, DtypeOpt, JsonOpt, Output, QuietOpt, RecipeOpt,
                                 SaveDtypeOpt, SeedOpt, TextFieldOpt, VerboseOpt, check_placement, claimed_output,
                                 console)

library_app = typer.Typer(name="library", help=__doc__, no_args_is_help=True, rich_markup_mode="rich")

LibraryOutOpt = Annotated[Path, typer.Option("--out", "-o", help="Library directory; an unfinished build there is "
                                             "resumed.")]
ParentOpt = Annotated[str, typer.Option("--model", "-m", help="Parent model.")]
ScoreOnlyOpt = Annotated[bool, typer.Option("--score-only", help="Only (re)score an existing library.")]
NoScoreOpt = Annotated[bool, typer.Option("--no-score", help="Build the blocks but do not score them.")]
InitOnlyOpt = Annotated[bool, typer.Option("--init-only", help="Initialise blocks without BLD training (ablation).")]
LibraryEngineOpt = Annotated[Optional[str], typer.Option("--engine", help="Build only the blocks this serving "
                             "engine builds (vllm, sglang, trtllm, llamacpp or transformers), as `mlx search "
                             "--engine` would; a later search for another engine extends the library. Default: "
                             "every block of the recipe's search space.")]
KeepActivationsOpt = Annotated[bool, typer.Option("--keep-activations", help="Keep the parent's cached activations "
                                                  "in the finished library's .work/ (hundreds of MB; baselines and "
                                                  "block initialisation studies read them; --score-only recomputes "
                                                  "them when they are gone).")]


@library_app.command("build", help="Blockwise local distillation of the block library. The parent is streamed from "
                     "its safetensors files: memory is a few decoder layers, one layer's cached activations, and the "
                     "embedding and head (a .gguf or hub parent, and sampling without --data, hold the whole "
                     "parent). Resumable; scales out under torchrun.")
@guarded
def build_command(
    out: LibraryOutOpt,
    model: ParentOpt = "smollm2-135m",
    data: DataOpt = None,
    recipe: RecipeOpt = None,
    score_only: ScoreOnlyOpt = False,
    no_score: NoScoreOpt = False,
    init_only: InitOnlyOpt = False,
    keep_activations: KeepActivationsOpt = False,
    engine: LibraryEngineOpt = None,
    text_field: TextFieldOpt = "text",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    save_dtype: SaveDtypeOpt = None,
    seed: SeedOpt = 0,
    allow_pickle: AllowPickleOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    build_library(out=out, model=model, data=data, recipe=recipe, score_only=score_only, no_score=no_score,
                  init_only=init_only, keep_activations=keep_activations, text_field=text_field, device=device,
                  dtype=dtype, save_dtype=save_dtype, seed=seed, allow_pickle=allow_pickle,
                  output=Output(json_out, quiet, verbose), engine=engine)


def build_library(*, out: Path, model: str, data: Optional[Path], recipe: Optional[str], score_only: bool,
                  no_score: bool, init_only: bool, keep_activations: bool, text_field: str, device: str, dtype: str,
                  save_dtype: Optional[str], seed: int, allow_pickle: bool, output: Output,
                  engine: Optional[str] = None) -> None:
    """Build and score the library at `out` and report it; `mlx library build` and `mlx distill --bld` both run this."""
    from mlxkit.engines.puzzle.library.build import LibraryBuildOptions, run_library_build
    from mlxkit.engines.puzzle.recipe import load_recipe

    check_placement(device, dtype, save_dtype)
    if score_only and (no_score or init_only):
        raise fail("--score-only cannot be combined with --no-score or --init-only")
    variants = None
    if engine is not None:
        from mlxkit.engines.puzzle.search.serving_fit import named_engine_variants

        variants = named_engine_variants(engine, model, output.reporter)
    options = LibraryBuildOptions(model=model, out=out, recipe=load_recipe(recipe or "quick"), data=data,
                                  text_field=text_field, seed=seed, train=not init_only, score=not no_score,
                                  score_only=score_only, allow_pickle=allow_pickle, device=device, dtype=dtype,
                                  save_dtype=save_dtype, keep_activations=keep_activations, variants=variants)
    with claimed_output(out, kind="dir", inputs=[model, data]):
        summary = run_library_build(options, output.reporter)
    if not summary:  # a non-zero rank of a distributed run: rank 0 reports
        return
    output.emit(summary, lambda s: _render_library(s, output.quiet))


def _render_library(summary: dict, quiet: bool) -> None:
    if not quiet:
        render_library_table(summary)
    console.print(f"[green]library[/green] {summary['library']}  ({summary['subblocks_trained']} subblocks trained, "
                  f"{summary['variants_scored']} variants scored{_scope_note(summary)}, median KL "
                  f"{_fmt(summary['median_kl_nontrivial'])}, {summary['wall_time_s']} s)")


def _scope_note(summary: dict) -> str:
    built_for = summary.get("built_for", "")
    return f" ({built_for})" if built_for.startswith("the variants") else ""


def render_library_table(summary: dict) -> None:
    """The replace-1-block KL of every variant, one row per layer."""
    table = Table(title="replace-1-block KL(parent || child) per layer")
    table.add_column("layer", justify="right")
    table.add_column("attention")
    table.add_column("ffn")
    for row in summary["per_layer"]:
        table.add_row(str(row["layer"]), *(" ".join(f"{name} {_fmt(kl)}" for name, kl in row[kind].items())
                                          for kind in ("attention", "ffn")))
    console.print(table)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3g}"
