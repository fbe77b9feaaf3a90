"""Merge fine-tuned models: isotropic merging (Iso-C, Iso-CTS) and the standard baselines.

Examples: `mlx merge --isotropic ft-a ft-b ft-c --base base -o merged`,
`mlx merge --method ties a b --base base --set density=0.3 -o out`, `mlx merge --recipe merge.yaml -o out`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from mlxkit.cli._errors import fail, guarded
from mlxkit.cli._options import (DeviceOpt, JsonOpt, Output, OverwriteOpt, QuietOpt, RecipeOpt, TextFieldOpt,
                                 VerboseOpt, canonical_dtype, check_pairs, check_placement, claimed_output, console,
                                 flags_and_overrides, given_options, new_or_old, renamed_option, set_option)
from mlxkit.engines.core.sizes import SIZE_HELP
from mlxkit.engines.merge.params import ALPHA

Opt = typer.Option
ParamOpt = set_option("--param", help="Method parameter key=value (repeatable), e.g. density=0.3; each is checked "
                                      "against its method's type and range. --param is the older spelling.")


@guarded
def merge_command(
    ctx: typer.Context,
    models: Annotated[Optional[list[str]], typer.Argument(help="Fine-tuned models: HF dirs, hub ids or LoRA adapter dirs.")] = None,
    base: Annotated[Optional[str], Opt("--base", help="Base model (inferred from adapters / model cards if omitted).")] = None,
    out: Annotated[Optional[Path], Opt("--out", "-o", "--output", help="Output directory (--output is the older spelling).")] = None,
    method: Annotated[Optional[str], Opt("--method", help="iso-c|iso-cts|tsv-m|task-arithmetic|ties|dare-ties|dare-linear|breadcrumbs|breadcrumbs-ties|della|della-linear|sce|model-stock|arcee-fusion|linear|slerp|nuslerp|multislerp|karcher|passthrough|regmean|fisher")] = None,
    isotropic: Annotated[bool, Opt("--isotropic", help="Iso-CTS, the paper's best (same as --method iso-cts).")] = False,
    recipe: RecipeOpt = None,
    config_file: Annotated[Optional[str], Opt("--config", help="A mergekit YAML config, run as written (same schema as --recipe).")] = None,
    alpha: Annotated[Optional[str], Opt("--alpha", help=f"Scale of the merged task vector: {ALPHA.valid_values()}, or 'auto'.")] = None,
    eval_data: Annotated[Optional[list[str]], Opt("--eval-data", help="Validation text per model (for --alpha auto), in model order.")] = None,
    data: Annotated[Optional[Path], Opt("--data", help="Calibration text for regmean and fisher (required by them): .txt, .jsonl (with --text-field) or a directory of .txt files.")] = None,
    text_field: TextFieldOpt = "text",
    calibration_tokens: Annotated[Optional[int], Opt("--calibration-tokens", help="Calibration tokens each model runs for regmean/fisher (default 8192, in 512-token sequences).")] = None,
    common_frac: Annotated[Optional[str], Opt("--common-frac", help="Iso-CTS common-subspace fraction, a number in (0, 1] (default 0.8).")] = None,
    params: ParamOpt = [],
    tokenizer: Annotated[Optional[str], Opt("--tokenizer", metavar="base|union|PATH", help="Vocabulary of the output when the inputs' tokenizers differ (mergekit's tokenizer_source): the base's, the union of all, or a tokenizer directory's; embedding and LM-head rows are aligned by token.")] = None,
    average_embeddings: Annotated[Optional[bool], Opt("--average-embeddings/--matrix-embeddings", help="Average embeddings and LM head (default) or treat them as matrices.")] = None,
    save_dtype: Annotated[Optional[str], Opt("--save-dtype", metavar="auto|float32|bfloat16|float16", help="dtype of the merged weights: float32, bfloat16 or float16 (default, auto: the inputs'). The merge arithmetic always runs in float32.")] = None,
    dtype: Annotated[Optional[str], renamed_option("--dtype")] = None,
    max_shard_size: Annotated[Optional[str], Opt("--max-shard-size", help=f"Largest output shard: {SIZE_HELP}; e.g. 2GB = 2,000,000,000 bytes, 2GiB = 2,147,483,648 (default 5GB).")] = None,
    device: DeviceOpt = "auto",
    seed: Annotated[Optional[int], Opt("--seed", help="Seed for DARE and randomized SVDs.")] = None,
    dry_run: Annotated[bool, Opt("--dry-run", help="Print the per-tensor plan; read no weights.")] = False,
    check: Annotated[Optional[Path], Opt("--check", help="Text for the output check (a file or folder; default: a built-in paragraph set): the merged model's perplexity beside each input's, on screen and in mlxkit.json.")] = None,
    no_check: Annotated[bool, Opt("--no-check", help="Skip the output check.")] = False,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    from mlxkit.engines.merge.config import config_from_options
    from mlxkit.engines.merge.run import run_merge

    save_dtype = new_or_old("--save-dtype", save_dtype, "--dtype", dtype)
    check_placement(device, dtype=None, save_dtype=save_dtype)
    check_pairs(params)
    output = Output(json_out, quiet, verbose)
    out_dtype = canonical_dtype(save_dtype)
    if recipe and config_file:
        raise fail("give --recipe or --config, not both")
    config = config_from_options(models=models or [], recipe=recipe or config_file, base=base, method=method, isotropic=isotropic,
                                 alpha=alpha, eval_data=eval_data or [],
                                 parameters=flags_and_overrides({"common_frac": ("--common-frac", common_frac)}, params),
                                 average_embeddings=average_embeddings, dtype=out_dtype,
                                 max_shard_size=max_shard_size, seed=seed,
                                 calibration_data=str(data) if data is not None else None,
                                 # the shared option's default leaves a recipe's own text_field in place
                                 text_field=None if text_field == "text" else text_field,
                                 calibration_tokens=calibration_tokens, tokenizer=tokenizer)
    sources = [entry.model for entry in config.input_entries()] + [config.base_model, *config.eval_data, config.data]
    for _, flag in given_options(ctx, ("check", "no_check", "overwrite") if dry_run else ()):
        raise fail(f"{flag} means nothing with --dry-run, which reads no weights and writes nothing")
    if check is not None and no_check:
        raise fail("--check gives the check's text and --no-check skips the check: pass one of them")
    if check is not None:
        from mlxkit.engines.data.text import check_data_path

        check_data_path(check)
    with claimed_output(out, kind="dir", inputs=sources, lock=not dry_run):
        result = run_merge(config, out, overwrite=overwrite, dry_run=dry_run, device=device, reporter=output.reporter,
                           check=not no_check, check_text=check)
    output.emit(result, _render_plan if dry_run else (None if quiet else _render))


def _render_plan(result: dict) -> None:
    for line in result["plan"]:
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"{result['tensors']} tensors ({result['matrices']} as matrices), method {result['method']}, "
                  f"peak ≈ {result['estimated_peak_bytes'] / 2**20:.0f} MiB", highlight=False)


def _render(result: dict) -> None:
    table = Table(title=f"mlx merge ({result['method']})", show_header=False)
    for key in ("output", "base", "alpha", "tensors", "shards", "device", "wall_time_s"):
        table.add_row(key, str(result.get(key)))
    for point in result.get("alpha_curve", []):
        loss = point["mean_loss"]
        table.add_row(f"α={point['alpha']:g}", "loss not finite" if loss is None else f"mean loss {loss:.4f}")
    for row in result.get("check", {}).get("models", []):
        shown = row.get("error") or ("not finite" if row["perplexity"] is None else f"{row['perplexity']:.2f}")
        table.add_row(f"check: {'merged' if row['role'] == 'merged' else row['model']}", f"perplexity {shown}")
    console.print(table)
