"""Perplexity of a model on text, and KL / top-1 agreement against a reference model."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from mlxkit.cli._errors import fail, guarded
from mlxkit.cli._options import (AllowPickleOpt, DataOpt, DeviceOpt, DtypeOpt, JsonOpt, Output, QuietOpt, SeedOpt,
                                 TextFieldOpt, VerboseOpt, check_placement, console, given_options)


@guarded
def eval_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Model: HF directory, .gguf file, hub id, or 'smollm2-135m'.")],
    data: DataOpt = None,
    reference: Annotated[Optional[str], typer.Option("--reference", help="Reference model for KL and top-1 agreement.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=2, help="Tokens of the data to evaluate on.")] = 8192,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", min=2, help="Sequence length of each evaluated "
                                                   "window (default 512, or the model's positions if fewer).")] = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    text_field: TextFieldOpt = "text",
    seed: SeedOpt = 0,
    allow_pickle: AllowPickleOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    from mlxkit.engines.eval.runner import run_eval

    # --seed seeds the text sampled when no --data is given; --text-field reads a --data .jsonl
    for _, flag in given_options(ctx, ("seed",) if data is not None else ("text_field",)):
        raise fail(f"{flag} means nothing {'with' if data is not None else 'without'} --data, which would ignore it")
    check_placement(device, dtype)
    output = Output(json_out, quiet, verbose)
    result = run_eval(model, data=data, reference=reference, max_tokens=max_tokens, seq_len=seq_len,
                      text_field=text_field, seed=seed, allow_pickle=allow_pickle, device=device, dtype=dtype,
                      reporter=output.reporter)
    output.emit(result, lambda r: _render(model, r, quiet))


def _render(model: str, result: dict, quiet: bool) -> None:
    if quiet:
        console.print(f"{result['perplexity']:.4f}")
        return
    table = Table(title=f"mlx eval {model}", show_header=False)
    table.add_row("data", result["data"])
    table.add_row("perplexity", f"{result['perplexity']:.4f}")
    table.add_row("tokens", f"{result['tokens']:,} ({result['sequences']} x {result['seq_len']})")
    table.add_row("tokens/s", f"{result['tokens_per_s']:,.0f} ({result['device']}, {result['dtype']})")
    if "kl_div" in result:
        table.add_row("KL(reference || model)", f"{result['kl_div']:.5f}")
        table.add_row("top-1 agreement", f"{result['top1_agreement']:.4f}")
        table.add_row("reference perplexity", f"{result['reference_perplexity']:.4f}")
    console.print(table)
