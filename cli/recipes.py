"""List the packaged recipes each verb accepts as --recipe NAME (copy one to edit it)."""

from __future__ import annotations

from importlib import resources

import yaml
from rich.table import Table

from mlxkit.cli._errors import guarded
from mlxkit.cli._options import JsonOpt, Output, console


@guarded
def recipes_command(json_out: JsonOpt = False) -> None:
    rows = []
    root = resources.files("mlxkit.recipes")
    for folder in sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")), key=lambda p: p.name):
        for item in sorted((p for p in folder.iterdir() if p.name.endswith(".yaml")), key=lambda p: p.name):
            data = yaml.safe_load(item.read_text()) or {}
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
