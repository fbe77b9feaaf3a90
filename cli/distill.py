"""Distillation: global distillation of a child (--gkd) or plain KD (--kd); --bld is `mlx library build`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from mlxkit.cli._errors import fail, guarded
from mlxkit.cli._options import (AllowPickleOpt, DataOpt, DeviceOpt, DtypeOpt, JsonOpt, Output, OverwriteOpt,
                                 QuietOpt, RecipeOpt, SaveDtypeOpt, SeedOpt, SetOpt, ShardingOpt, TextFieldOpt,
                                 VerboseOpt, ModeOptions, check_placement, claimed_output, print_notice)


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
    bld: Annotated[bool, typer.Option("--bld", help="The block library: the older spelling of `mlx library build`, "
                                      "which takes the same options.")] = False,
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
    if bld + gkd + kd != 1:
        raise fail("choose one distillation mode: --bld (block library), --gkd (global distillation) or --kd")
    _MODES.check(ctx, "--bld" if bld else "--gkd" if gkd else "--kd")
    if bld:
        from mlxkit.cli.library import build_library

        print_notice("--bld is now `mlx library build`; `mlx distill --bld` runs the same build")
        return build_library(out=out, model=model, data=data, recipe=recipe, score_only=score_only,
                             no_score=no_score, init_only=init_only, keep_activations=keep_activations,
                             text_field=text_field, device=device, dtype=dtype, save_dtype=save_dtype, seed=seed,
                             allow_pickle=allow_pickle, output=Output(json_out, quiet, verbose))
    check_placement(device, dtype, save_dtype)
    from mlxkit.cli.distill_global import run_global_distillation

    with claimed_output(out, kind="dir", inputs=[teacher, student, data]):
        return run_global_distillation(mode="gkd" if gkd else "kd", teacher=teacher, student=student, out=out,
                                       data=data, text_field=text_field, recipe=recipe, tokens=tokens,
                                       overrides=overrides, seed=seed, overwrite=overwrite,
                                       allow_pickle=allow_pickle, device=device, dtype=dtype,
                                       save_dtype=save_dtype, sharding=sharding,
                                       output=Output(json_out, quiet, verbose))
