"""Export a child (or parent) for serving: a llama.cpp GGUF, the Nemotron-NAS layout, or a self-contained HF dir."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from mlxkit.cli._errors import guarded
from mlxkit.cli._options import (JsonOpt, Output, OverwriteOpt, QuietOpt, VerboseOpt, claimed_output, console,
                                 new_or_old, renamed_option)


@guarded
def export_command(
    model: Annotated[str, typer.Argument(help="Child or parent: a local HF directory, or 'smollm2-135m'.")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="gguf | nemotron-nas | hf.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The .gguf file (its manifest goes beside it as "
                                                          "<file>.mlxkit.json), or the output directory.")],
    encoding: Annotated[Optional[str], typer.Option("--encoding", metavar="f32|f16|q8_0",
                                                    help="How the weights are written (default f32; q8_0: GGUF "
                                                         "only).")] = None,
    dtype: Annotated[Optional[str], renamed_option("--dtype")] = None,
    overwrite: OverwriteOpt = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check everything, print what would be written, "
                                                          "write nothing (reads no weights).")] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    from mlxkit.engines.export import describe_plan, plan_export, run_export

    encoding = new_or_old("--encoding", encoding, "--dtype", dtype) or "f32"
    output = Output(json_out, quiet, verbose)
    with claimed_output(out, kind="file" if fmt == "gguf" else "dir", inputs=[model], lock=not dry_run):
        plan = plan_export(model, fmt, out, encoding, overwrite=overwrite, reporter=output.reporter)
        result = describe_plan(plan) if dry_run else run_export(plan, overwrite=overwrite, reporter=output.reporter)
    output.emit(result, lambda r: _render(model, fmt, r, dry_run, quiet))


def _render(model: str, fmt: str, result: dict, dry_run: bool, quiet: bool) -> None:
    if quiet:
        console.print(result["out"])
        return
    table = Table(title=f"mlx export {model} --format {fmt}", show_header=False)
    table.add_row("output", result["out"] + (" (dry run: nothing written)" if dry_run else ""))
    table.add_row("encoding", result["dtype"])
    size = "" if dry_run else f" ({result['tensors']} tensors, {result['tensor_bytes'] / 2**20:.1f} MiB)"
    table.add_row("layers", f"{result['layers']}{size}")
    table.add_row("RoPE", f"{result['rope']['type']}, theta {result['rope']['theta']:g}")
    if "gguf" in result:
        table.add_row("heads / KV heads", f"{result['gguf']['head_count']} / {result['gguf']['head_count_kv']}")
        table.add_row("FFN lengths", str(result["gguf"]["feed_forward_length"]))
    if dry_run:
        for note in result["notes"]:
            table.add_row("note", note)
    else:
        table.add_row("manifest", result["manifest"])
    console.print(table)
