"""Distillation: the Puzzle block library (--bld), global distillation of a child (--gkd), or plain KD (--kd)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from mlxkit.cli._errors import fail, guarded
from mlxkit.cli._options import (AllowPickleOpt, DataOpt, DeviceOpt, DtypeOpt, JsonOpt, Output, OverwriteOpt,
                                 QuietOpt, RecipeOpt, SaveDtypeOpt, SeedOpt, SetOpt, ShardingOpt, TextFieldOpt,
                                 VerboseOpt, ModeOptions, check_placement, claimed_output, console)


_MODES = ModeOptions("distill", common=frozenset({"out", "bld", "gkd", "kd", "data", "recipe", "text_field", "device",
                                                 "dtype", "save_dtype", "seed", "allow_pickle", "json_out", "quiet",
                                                 "verbose"}),
                     modes={"--bld": frozenset({"model", "score_only", "no_score", "init_only", "keep_activations"}),
                            "--gkd": frozenset({"teacher", "student", "tokens", "overrides", "overwrite", "sharding"}),
                            "--kd": frozenset({"teacher", "student", "tokens", "overrides", "overwrite", "sharding"})})


@guarded
def distill_command(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", "-o", help="Library directory (--bld) or distilled model (--gkd/--kd); "
                                      "an unfinished run there is resumed.")],
    bld: Annotated[bool, typer.Option("--bld", help="Blockwise local distillation of the block library. The parent "
                                      "is streamed from its safetensors files: memory is a few decoder layers, one "
                                      "layer's cached activations, and the embedding and head (a .gguf or hub parent, "
                                      "and sampling without --data, hold the whole parent).")] = False,
    gkd: Annotated[bool, typer.Option("--gkd", help="Global distillation of an assembled child against its parent "
                                      "(cosine on every layer's hidden states + logit KL).")] = False,
    kd: Annotated[bool, typer.Option("--kd", help="Plain KD: forward KL at a temperature mixed with cross-entropy.")] = False,
    teacher: Annotated[Optional[str], typer.Option("--teacher", help="Teacher (--gkd/--kd): the parent model.")] = None,
    student: Annotated[Optional[str], typer.Option("--student", help="Student (--gkd/--kd): e.g. a searched child.")] = None,
    tokens: Annotated[Optional[int], typer.Option("--tokens", help="Training tokens (--gkd/--kd; default: the recipe's).")] = None,
    overrides: SetOpt = [],
    overwrite: OverwriteOpt = False,
    model: Annotated[str, typer.Option("--model", "-m", help="Parent model.")] = "smollm2-135m",
    data: DataOpt = None,
    recipe: RecipeOpt = None,
    score_only: Annotated[bool, typer.Option("--score-only", help="Only (re)score an existing library.")] = False,
    no_score: Annotated[bool, typer.Option("--no-score", help="Build the blocks but do not score them.")] = False,
    init_only: Annotated[bool, typer.Option("--init-only", help="Initialise blocks without BLD training (ablation).")] = False,
    keep_activations: Annotated[bool, typer.Option("--keep-activations", help="Keep the parent's cached activations "
                                                   "in the finished library's .work/ (hundreds of MB; baselines and "
                                                   "block initialisation studies read them; --score-only recomputes "
                                                   "them when they are gone).")] = False,
    text_field: TextFieldOpt = "text",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    save_dtype: SaveDtypeOpt = None,
    sharding: ShardingOpt = "auto",
    seed: SeedOpt = 0,
    allow_pickle: AllowPickleOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    from mlxkit.engines.puzzle.library.build import DistillOptions, run_distill
    from mlxkit.engines.puzzle.recipe import load_recipe

    if bld + gkd + kd != 1:
        raise fail("choose one distillation mode: --bld (block library), --gkd (global distillation) or --kd")
    _MODES.check(ctx, "--bld" if bld else "--gkd" if gkd else "--kd")
    check_placement(device, dtype, save_dtype)
    output = Output(json_out, quiet, verbose)
    if gkd or kd:
        from mlxkit.cli.distill_global import run_global_distillation

        with claimed_output(out, kind="dir", inputs=[teacher, student, data]):
            return run_global_distillation(mode="gkd" if gkd else "kd", teacher=teacher, student=student, out=out,
                                           data=data, text_field=text_field, recipe=recipe, tokens=tokens,
                                           overrides=overrides, seed=seed, overwrite=overwrite,
                                           allow_pickle=allow_pickle, device=device, dtype=dtype,
                                           save_dtype=save_dtype, sharding=sharding, output=output)
    if score_only and (no_score or init_only):
        raise fail("--score-only cannot be combined with --no-score or --init-only")
    options = DistillOptions(model=model, out=out, recipe=load_recipe(recipe or "quick"), data=data,
                             text_field=text_field, seed=seed, train=not init_only, score=not no_score,
                             score_only=score_only, allow_pickle=allow_pickle, device=device, dtype=dtype,
                             save_dtype=save_dtype, keep_activations=keep_activations)
    with claimed_output(out, kind="dir", inputs=[model, data]):
        summary = run_distill(options, output.reporter)
    if not summary:  # a non-zero rank of a distributed run: rank 0 reports
        return
    output.emit(summary, lambda s: _render_library(s, quiet))


def _render_library(summary: dict, quiet: bool) -> None:
    if not quiet:
        render_library_table(summary)
    console.print(f"[green]library[/green] {summary['library']}  ({summary['subblocks_trained']} subblocks trained, "
                  f"{summary['variants_scored']} variants scored, median KL "
                  f"{_fmt(summary['median_kl_nontrivial'])}, {summary['wall_time_s']} s)")


def render_library_table(summary: dict) -> None:
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
