"""List the packaged recipes each verb accepts as --recipe NAME (copy one to edit it), or, with
--methods, every `mlx merge` method with its parameters."""

from __future__ import annotations

from importlib import resources
from typing import Annotated

import typer
from rich.table import Table

from mlxkit.cli._errors import guarded
from mlxkit.cli._options import JsonOpt, Output, console
from mlxkit.engines.core.yaml_config import read_yaml_mapping, read_yaml_text


@guarded
def recipes_command(
    methods: Annotated[bool, typer.Option("--methods", help="List the merge methods (--method NAME, or "
                                                            "merge_method: in a mergekit config) and their parameters.")] = False,
    json_out: JsonOpt = False,
) -> None:
    if methods:
        Output(json_out).emit(_merge_methods(), _render_methods)
        return
    rows = []
    root = resources.files("mlxkit.recipes")
    for folder in sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")), key=lambda p: p.name):
        for item in sorted((p for p in folder.iterdir() if p.name.endswith(".yaml")), key=lambda p: p.name):
            origin = f"recipe {folder.name}/{item.name}"
            data = read_yaml_mapping(read_yaml_text(item, origin), origin)
            rows.append({"verb": folder.name, "name": item.name[:-5],
                         "description": str(data.get("description", "")).strip(), "path": str(item)})
    Output(json_out).emit(rows, _render)


def _render(rows: list[dict]) -> None:
    table = Table(title="packaged recipes (--recipe NAME, or a path to your own copy)")
    for column in ("verb", "name", "description", "path"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["verb"], row["name"], row["description"], row["path"])
    console.print(table)
    # A merge is configured by its method rather than by a recipe, so the methods are listed here too.
    _render_methods(_merge_methods())


def _merge_methods() -> list[dict]:
    from mlxkit.engines.merge.methods.registry import METHODS

    rows = []
    for name, method in METHODS.items():
        params = [{"name": p.name, "per_model": p.per_model, "required": p.required,
                   "default": None if p.required else p.default, "values": p.valid_values(), "help": p.help}
                  for p in method.all_parameters().values()]
        rows.append({"method": name, "mergekit_name": name.replace("-", "_"), "task_vectors": method.uses_deltas,
                     "needs_base": method.needs_base, "models": _model_count(method.min_models, method.max_models),
                     "reference": method.reference, "parameters": params})
    return rows


def _model_count(low: int, high: int | None) -> str:
    return str(low) if low == high else f"{low}+" if high is None else f"{low}-{high}"


def _render_methods(rows: list[dict]) -> None:
    table = Table(title="merge methods (--method NAME; --set KEY=VALUE for a parameter; * = per model)")
    for column in ("method", "models", "parameters", "reference"):
        table.add_column(column, overflow="fold")
    for row in rows:
        params = ", ".join(f"{p['name']}{'*' if p['per_model'] else ''}"
                           f"={'(required)' if p['required'] else p['default']}" for p in row["parameters"])
        table.add_row(row["method"], row["models"], params or "-", row["reference"])
    console.print(table)
