"""Shared option types and output helpers for every verb."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from mlxkit.cli._errors import fail
from mlxkit.engines.core.progress import Reporter, RichReporter

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Model: HF directory, .gguf file, hub id, or 'smollm2-135m'.")]
DataOpt = Annotated[Optional[Path], typer.Option("--data", help="Text: .txt, .jsonl (with --text-field) or a directory of .txt files. Default: text sampled from the model.")]
TextFieldOpt = Annotated[str, typer.Option("--text-field", help="Field holding the text in a .jsonl file.")]
RecipeOpt = Annotated[Optional[str], typer.Option("--recipe", help="Recipe name (see `mlx recipes`) or path to a YAML file.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object with the result on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or notices.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="More detail on stderr.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]
AllowPickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="Allow loading pickle (.bin) weights. Only for checkpoints you trust.")]

console = Console()


def make_reporter(json_out: bool, quiet: bool, verbose: bool) -> Reporter:
    """Progress goes to stderr; with --json or --quiet the user asked for silence."""
    if quiet or json_out:
        return Reporter()
    return RichReporter(verbose=verbose)


def emit_json(payload: Any) -> None:
    """The one machine-readable object a verb prints with --json."""
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    sys.stdout.flush()


def parse_overrides(pairs: list[str]) -> dict[str, object]:
    """`--set optim.lr=3e-4` → {"optim.lr": 0.0003}; values are read as YAML scalars."""
    import yaml

    overrides: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise fail(f"--set takes key=value (got '{pair}')")
        try:
            overrides[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise fail(f"--set {key.strip()}: cannot read the value '{raw}'") from None
    return overrides
