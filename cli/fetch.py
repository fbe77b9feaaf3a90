"""Resolve a model spec once and cache it (the embedded default converts from its GGUF)."""

from __future__ import annotations

from typing import Annotated

import typer

from mlxkit.cli._errors import guarded
from mlxkit.cli._options import JsonOpt, Output, QuietOpt, console


@guarded
def fetch_command(
    model: Annotated[str, typer.Argument(help="Model spec; default: the embedded SmolLM2-135M-Instruct.")] = "smollm2-135m",
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    from mlxkit.engines.models.loading import check_local_weights, describe_source, load_config, resolve_spec

    output = Output(json_out, quiet)
    source = resolve_spec(model, output.reporter)
    check_local_weights(source)  # "ready" promises loadable weights, not just a config
    config = load_config(str(source.path) if source.path else model)
    info = {"spec": model, "kind": source.kind, "path": str(source.path) if source.path else None,
            "model_type": config.model_type, "layers": getattr(config, "num_hidden_layers", None),
            "hidden_size": getattr(config, "hidden_size", None)}
    where = describe_source(source)
    output.emit(info, None if quiet else lambda shown: _render(where, shown))


def _render(where: str, info: dict) -> None:
    console.print(f"[green]ready[/green] {where}: {info['model_type']}, {info['layers']} layers, "
                  f"hidden {info['hidden_size']}", soft_wrap=True)
