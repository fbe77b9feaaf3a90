"""A search frontier: one solve per throughput target (no checkpoint), and the report directory it can
be written to (`frontier.json` as the manifest's results, and its picture).

The frontier shows where a target stops being reachable: a target no child reaches is a row with its
reason, not an error.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.puzzle.search.options import SearchOptions
from mlxkit.engines.puzzle.search.run import run_search

FRONTIER_JSON = "frontier.json"


def search_frontier(options: SearchOptions, throughputs: list[str], reporter: Reporter | None = None) -> dict[str, Any]:
    """Solve once per throughput target (no checkpoint): the predicted speed / memory / quality trade-off."""
    from mlxkit.engines.errors import InfeasibleError

    rows = []
    for throughput in throughputs:
        try:
            result = run_search(replace(options, out=None, throughput=throughput, gkd_tokens=None), reporter)
        except InfeasibleError as exc:
            rows.append({"throughput": throughput, "infeasible": str(exc)})
            continue
        if not result:
            return {}  # a rank other than 0: rank 0 reports
        predicted = result["predicted"]
        rows.append({"throughput": throughput, "speedup": predicted["speedup"], "memory_mib": predicted["memory_mib"],
                     "num_params": predicted["num_params"], "objective": result["objective"],
                     "metric": result["metric"], "status": result["status"], "choices": result["choices"],
                     "estimate_corrected": result["estimate_corrected"],
                     "objective_isolated": result["objective_isolated"]})
    return {"target": options.target, "frontier": rows}


def write_frontier_report(out: Path, frontier: dict[str, Any], options: SearchOptions, *,
                          overwrite: bool = False) -> dict[str, Any]:
    """Write `frontier` into the report directory `out` whole: `frontier.json`, the manifest (whose results
    are the frontier, so `mlx report` redraws from it) and the picture. Returns the pictures drawn."""
    from mlxkit.engines.core.atomic import atomic_output_dir, atomic_write_json
    from mlxkit.engines.core.figures import draw_output_figures
    from mlxkit.engines.core.manifest import Manifest

    manifest = Manifest(verb="search")
    if options.library is not None:
        manifest.add_input("library", str(options.library), options.library)
    else:
        manifest.add_input("parent", options.model, options.model)
    manifest.settings = {"mode": "frontier", "target": options.target, "engine": options.engine,
                         "recipe": options.recipe, "scenario": options.scenario, "seed": options.seed}
    manifest.results = frontier
    with atomic_output_dir(out, overwrite=overwrite) as staging:
        atomic_write_json(staging / FRONTIER_JSON, frontier, indent=2)
        manifest.write(staging)
        figures = draw_output_figures(staging, manifest.to_dict())
    return {"drawn": [f.file for f in figures.drawn], "skipped": figures.skipped}
