"""Solve a sparse linear system: SSI for 9-point grid systems, a sparse direct solver otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from mlxkit.cli._errors import guarded
from mlxkit.cli._options import (JsonOpt, ModeOptions, Output, OverwriteOpt, QuietOpt, VerboseOpt, check_placement,
                                 claimed_output, console, new_or_old, renamed_option)


# The sparse direct solvers factorise the matrix as given, in float64, on the CPU. With --method auto the
# choice is made after reading the system, so those runs say what they ignored in a notice instead.
_SPARSE = "--method superlu|pardiso"
_MODES = ModeOptions("solve", common=frozenset({"rhs", "method", "nullspace", "refine", "out", "overwrite", "json_out",
                                               "quiet", "verbose"}),
                     modes={"--method auto|ssi": frozenset({"grid", "precision", "dtype", "leaf", "device"}),
                            _SPARSE: frozenset()})


@guarded
def solve_command(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="System: .npz (scipy save_npz + optional keys b, grid_shape; or "
                                              "stencil form: key 'stencil' [H,W,3,3] and b) or .mtx with --rhs.")],
    rhs: Annotated[Optional[Path], typer.Option("--rhs", help="Right-hand side (.npy, .npz, .mtx, .txt).")] = None,
    grid: Annotated[Optional[str], typer.Option("--grid", help="Grid shape HxW (default: grid_shape key or inferred).")] = None,
    method: Annotated[str, typer.Option("--method", help="auto | ssi | superlu | pardiso.")] = "auto",
    nullspace: Annotated[str, typer.Option("--nullspace", help="none | constant (mean-zero solution of A1=0 systems).")] = "none",
    precision: Annotated[Optional[str], typer.Option("--precision", metavar="float64|float32",
                                                     help="SSI working precision (default float64; the sparse "
                                                          "direct solvers always use float64). float32 stores "
                                                          "and applies the factor in float32 and refines x in "
                                                          "float64 (--refine).")] = None,
    dtype: Annotated[Optional[str], renamed_option("--dtype")] = None,
    refine: Annotated[Optional[int], typer.Option("--refine", min=0, help="At most N iterative-refinement "
                                                  "steps: residual b - Ax in float64 with the sparse A, "
                                                  "correction solved with the factor; stops once the "
                                                  "residual reaches sqrt(N) float64 epsilons or a step no "
                                                  "longer halves it. Default: 8 with --precision "
                                                  "float32, else 0.", metavar="N")] = None,
    leaf: Annotated[int, typer.Option("--leaf", min=1, help="Minimum cells per SSI leaf-patch side.")] = 4,
    device: Annotated[str, typer.Option("--device", help="Where SSI factorises and solves: auto (CUDA when "
                                                         "available, else CPU), cpu, cuda or cuda:N. The sparse "
                                                         "direct solvers run on the CPU.",
                                        metavar="auto|cpu|cuda|cuda:N")] = "auto",
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write x and the report to this .npz.")] = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    from mlxkit.engines.solve.runner import run_solve

    _MODES.check(ctx, _SPARSE if method in ("superlu", "pardiso") else "--method auto|ssi")
    precision = new_or_old("--precision", precision, "--dtype", dtype) or "float64"
    check_placement(device, dtype=None)
    output = Output(json_out, quiet, verbose)
    with claimed_output(out, kind="file", inputs=[file, rhs]):
        report, _ = run_solve(file, rhs=rhs, grid=grid, method=method, nullspace=nullspace, precision=precision,
                              leaf=leaf, refine=refine, out=out, overwrite=overwrite, device=device, reporter=output.reporter,
                              tune_allocator=True)  # this process is ours
    output.emit(report, lambda r: _render(file, out, r, quiet))


def _render(file: Path, out: Optional[Path], report: dict, quiet: bool) -> None:
    if quiet:
        console.print(f"{report['residual']:.3e}")
        return
    table = Table(title=f"mlx solve {file}", show_header=False)
    table.add_row("method", report["method"] + (f" ({report['dtype']}, {report['device']})"
                                                if report["method"] == "ssi" else ""))
    grid_text = "x".join(map(str, report["grid"])) if report["grid"] else "none"
    table.add_row("unknowns", f"{report['unknowns']:,} (grid {grid_text}, {report['systems']} system(s), "
                              f"{report['rhs_columns']} rhs column(s))")
    table.add_row("relative residual", f"{report['residual']:.3e}")
    if "refine" in report:
        refine = report["refine"]
        table.add_row("refinement", f"{refine['steps']} of at most {refine['max_steps']} step(s), from "
                                    f"{refine['unrefined_residual']:.3e}")
    if "nullspace" in report:
        table.add_row("residual vs compatible b", f"{report['compatible_residual']:.3e}")
    table.add_row("factor / solve", f"{report['factor_s']:.3f} s / {report['solve_s']:.3f} s")
    if out is not None:
        table.add_row("output", str(out))
    console.print(table)
