"""BLD benchmark: wall time of `mlx library build` on SmolLM2-135M, and whether BLD pays off.

Runs, in order (each stage resumable: rerunning skips what is finished):
  1. `mlx library build --recipe RECIPE` into OUT/RECIPE   (timed: the budget is 10 min for quick, 45 for standard)
  2. the same blocks initialised only (`--init-only`) into OUT/RECIPE-init, reusing stage 1's
     calibration tokens and cached activations, so the two libraries differ only by BLD training
  3. the median replace-1-block KL over non-trivial variants (trained or initialised subblocks)
     of both libraries, and their ratio.

Usage: python bench/bench_bld.py [--recipe quick|standard] [--out runs/bench] [--data FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mlxkit", *args], check=True)
    return time.perf_counter() - start


def kl_table(library: Path) -> dict[tuple[int, str, str], tuple[str | None, float]]:
    from mlxkit.engines.puzzle.library.store import read_library

    return {(layer.layer, kind, name): (item.source, item.metrics["kl_div"])
            for layer in read_library(library).layers for kind in ("attention", "ffn")
            for name, item in layer.entries(kind).items() if item.metrics}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="quick")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--data", default=None)
    args = parser.parse_args()
    data = ["--data", args.data] if args.data else []
    bld_dir, init_dir = args.out / args.recipe, args.out / f"{args.recipe}-init"
    wall = run(["library", "build", "--recipe", args.recipe, "--out", str(bld_dir), "--quiet", "--keep-activations",
                *data])
    manifest = json.loads((bld_dir / "mlxkit.json").read_text())
    if not (init_dir / "library.json").exists():
        (init_dir / ".work").mkdir(parents=True, exist_ok=True)
        shutil.copy2(bld_dir / ".work" / "tokens.pt", init_dir / ".work" / "tokens.pt")
        if not (init_dir / ".work" / "activations").exists():
            shutil.copytree(bld_dir / ".work" / "activations", init_dir / ".work" / "activations")
    run(["library", "build", "--init-only", "--recipe", args.recipe, "--out", str(init_dir), "--quiet", *data])
    bld, init = kl_table(bld_dir), kl_table(init_dir)
    # The same subblocks in both libraries: those BLD trained, and their initialised-only twins.
    trained = [key for key, (source, _) in bld.items() if source == "bld"]
    nontrivial = [key for key, (source, _) in bld.items() if source in ("bld", "init")]
    trained_kl = statistics.median(bld[k][1] for k in trained)
    init_kl = statistics.median(init[k][1] for k in trained)
    report = {"recipe": args.recipe, "wall_time_s_this_invocation": round(wall, 1),
              "library_wall_time_s": manifest["wall_time_s"], "trained_subblocks": len(trained),
              "median_kl_trained_after_bld": trained_kl, "median_kl_same_blocks_init_only": init_kl,
              "kl_ratio_bld_over_init": trained_kl / init_kl if init_kl else None,
              "median_kl_all_nontrivial_after_bld": statistics.median(bld[k][1] for k in nontrivial),
              "median_kl_all_nontrivial_init_only": statistics.median(init[k][1] for k in nontrivial)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
