"""Redraw an output's pictures (a child's architecture, training curves, a search frontier) and its model card."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mlxkit.cli._errors import guarded
from mlxkit.cli._options import JsonOpt, Output, QuietOpt, VerboseOpt, console


@guarded
def report_command(
    out: Annotated[Path, typer.Argument(help="A directory mlxkit wrote (a child, a distilled, merged or fine-tuned "
                                             "model, or a search frontier's report).")],
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    from mlxkit.engines.core.report import redraw_output

    output = Output(json_out, quiet, verbose)
    result = redraw_output(out)
    output.emit(result, lambda r: _render(r, quiet))


def _render(result: dict, quiet: bool) -> None:
    if quiet:
        return
    drawn = ", ".join(result["drawn"]) or "nothing to draw (no per-layer child, training log or frontier)"
    console.print(f"[green]drew[/green] {drawn} in {result['out']}")
    if result["card"]:
        console.print(f"[green]card[/green] {result['card']}")
