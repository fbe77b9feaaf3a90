"""Fine-tune a model: H-Tuning (mix-order LoRA), LoRA, or every weight; resumable, data-parallel under torchrun.

`--recipe crt` (or a YAML with `method: crt`) is continual robust training of a small
classifier instead: `--attacks` to train, `--new-attack` to fine-tune a trained one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mlxkit.cli._errors import fail, guarded
from mlxkit.cli._options import (AllowPickleOpt, DeviceOpt, DtypeOpt, JsonOpt, Output, OverwriteOpt, QuietOpt,
                                 SaveDtypeOpt, SeedOpt, ShardingOpt, TextFieldOpt, VerboseOpt, check_placement,
                                 ModeOptions, claimed_output, console, flags_and_overrides, set_option)

SetOpt = set_option(help="Override any recipe field, key=value (repeatable), e.g. --set htuning.mix_coef=0.9.")


# crt trains a classifier in float32 on .npz arrays: it reads no text field, dtype, save dtype, sharding or pickle
_LM = "--recipe htuning|lora|full"
_MODES = ModeOptions("finetune", common=frozenset({"out", "data", "recipe", "model", "steps", "batch", "lr", "eval_data",
                                                  "overrides", "device", "seed", "overwrite", "json_out", "quiet",
                                                  "verbose"}),
                     modes={_LM: frozenset({"objective", "merge", "text_field", "dtype", "save_dtype", "sharding",
                                            "allow_pickle"}),
                            "--recipe crt": frozenset({"attacks", "new_attack"})})


@guarded
def finetune_command(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", "-o", help="Output: a peft adapter directory (htuning, lora), a "
                                      "whole checkpoint (full, --merge) or a classifier directory (crt); an "
                                      "unfinished run there is resumed.")],
    data: Annotated[Optional[Path], typer.Option("--data", help="Training data: text (.txt, .jsonl with --text-field, "
                                                 "a directory of .txt) or, for classification, .jsonl with text "
                                                 "and label fields; crt: .npz with arrays x and y.")] = None,
    recipe: Annotated[str, typer.Option("--recipe", help="htuning, lora, full, crt (see `mlx recipes`) or a path "
                                        "to a YAML file.")] = "htuning",
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Base model: HF directory, .gguf file, hub "
                                                 "id, or 'smollm2-135m' (the default); crt: a classifier config "
                                                 "(.json/.yaml) or a trained classifier directory.")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Optimiser steps (recipe: schedule.steps).")] = None,
    batch: Annotated[Optional[int], typer.Option("--batch", help="Sequences per step, over all processes "
                                                 "(recipe: optim.batch_sequences).")] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Peak learning rate (recipe: optim.lr).")] = None,
    objective: Annotated[Optional[str], typer.Option("--objective", help="causal_lm or classification "
                                                     "(recipe: objective).")] = None,
    eval_data: Annotated[Optional[Path], typer.Option("--eval-data", help="Held-out text for the validation loss "
                                                      "(default: data.held_out_sequences of --data).")] = None,
    merge: Annotated[bool, typer.Option("--merge", help="Fold the adapter into the base and write a merged "
                                        "safetensors checkpoint instead of the adapter.")] = False,
    attacks: Annotated[Optional[str], typer.Option("--attacks", help="crt: attacks to train against, comma-separated "
                                                   "(linf, l2, l1, stadv); with --new-attack, the old attacks "
                                                   "(default: those the model records).")] = None,
    new_attack: Annotated[Optional[str], typer.Option("--new-attack", help="crt: fine-tune a trained classifier for "
                                                      "this attack, replaying the old ones.")] = None,
    overrides: SetOpt = [],
    text_field: TextFieldOpt = "text",
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
    from mlxkit.engines.finetune.recipe import load_finetune_recipe
    from mlxkit.engines.finetune.trainer import FinetuneOptions, run_finetune
    from mlxkit.engines.robust.recipe import CrtRecipe

    if data is None:
        raise fail("finetune needs --data (text, or JSONL with text and label fields for classification; "
                   ".npz for crt)")
    check_placement(device, dtype, save_dtype)
    output = Output(json_out, quiet, verbose)
    placement = {"device": device, "dtype": dtype, "save_dtype": save_dtype}
    base = load_finetune_recipe(recipe)
    _MODES.check(ctx, "--recipe crt" if isinstance(base, CrtRecipe) else _LM)
    if isinstance(base, CrtRecipe):
        phase = "train" if new_attack is None else "finetune"
        crt_flags = {f"{phase}.steps": ("--steps", steps), "optim.batch_size": ("--batch", batch),
                     f"{phase}.lr": ("--lr", lr)}
        with claimed_output(out, kind="dir", inputs=[model, data, eval_data]):
            _crt(base.with_overrides(flags_and_overrides(crt_flags, overrides)), model, data, out, attacks,
                 new_attack, eval_data, seed, overwrite, placement, output)
        return
    flags = {"schedule.steps": ("--steps", steps), "optim.batch_sequences": ("--batch", batch), "optim.lr": ("--lr", lr),
             "objective": ("--objective", objective)}
    loaded = base.with_overrides(flags_and_overrides(flags, overrides))
    options = FinetuneOptions(model=model or "smollm2-135m", data=data, out=out, recipe=loaded, eval_data=eval_data,
                              text_field=text_field, merge=merge, seed=seed, overwrite=overwrite,
                              allow_pickle=allow_pickle, sharding=sharding, **placement)
    with claimed_output(out, kind="dir", inputs=[model, data, eval_data]):
        summary = run_finetune(options, output.reporter)
    if not summary:  # a non-zero rank of a distributed run: rank 0 reports
        return
    output.emit(summary, _render)


def _render(summary: dict) -> None:
    before, after = summary["before"], summary["after"]
    extra = f", accuracy {before['accuracy']:.3f} → {after['accuracy']:.3f}" if "accuracy" in after else ""
    console.print(f"[green]{summary['method']}[/green] {summary['out']} ({summary['format']}): {summary['steps']} "
                  f"steps, {summary['trainable_parameters']:,} trainable parameters; held-out loss "
                  f"{before['loss']:.4f} → {after['loss']:.4f}{extra} ({summary['wall_time_s']} s, peak RSS "
                  f"{summary['peak_rss_mib']:.0f} MiB)")


def _names(value: str | None) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split(",") if name.strip()) if value else ()


def _crt(recipe, model: str | None, data: Path, out: Path, attacks: str | None, new_attack: str | None,
         eval_data: Optional[Path], seed: int, overwrite: bool, placement: dict[str, str | None],
         output: Output) -> None:
    from mlxkit.engines.robust.trainer import CrtOptions, run_crt

    if model is None:
        raise fail("crt needs --model: a classifier config (.json/.yaml) to train, or a trained classifier "
                   "directory")
    options = CrtOptions(model=model, data=data, out=out, recipe=recipe, attacks=_names(attacks),
                         new_attack=new_attack.strip() if new_attack else None, eval_data=eval_data, seed=seed,
                         overwrite=overwrite, **placement)
    output.emit(run_crt(options, output.reporter), _render_crt)


def _render_crt(summary: dict) -> None:
    before, after = summary["before"], summary["after"]
    robust = ", ".join(f"{name} {before['attacks'][name]:.3f} → {after['attacks'][name]:.3f}"
                       for name in summary["attacks"])
    console.print(f"[green]crt {summary['phase']}[/green] {summary['out']}: {summary['steps']} steps, regulariser "
                  f"{summary['regularizer']}; held-out accuracy clean {before['clean']:.3f} → {after['clean']:.3f}, "
                  f"{robust}, union {before['union']:.3f} → {after['union']:.3f} ({summary['wall_time_s']} s)")
