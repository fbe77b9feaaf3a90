"""Benchmark `mlx solve`'s SSI against SciPy, PARDISO and PyAMG on 2-D grid problems, side by side.

Every (solver, problem, size) runs in its own subprocess, so its peak memory (ru_maxrss) is its own.

    .venv/bin/python bench/bench_solve.py --sizes 257,513,1025 --json /tmp/solve_bench.json

Problems (Dirichlet boundary, n x n nodes):
  poisson5  5-point Laplacian (4 on the diagonal, -1 to the 4 neighbours)
  varcoef9  variable-coefficient 9-point operator: a_ij = -w (c_i + c_j) / 2 with a log-normal field c
            (w = 1 on axes, 1/2 on diagonals), diagonal = sum of |a_ij| with ghost neighbours: SPD
Solvers: ssi (fp64, factor + solve; re-solve with the cached factors), ssi32 (`factorized(A,
dtype="float32")`: the float32 factor, each solve refined in float64 to its default 3 steps), spsolve (SuperLU, COLAMD),
splu (SuperLU, MMD_AT_PLUS_A: the fastest ordering on these problems), pardiso (pypardiso, first call and
a cached re-solve), pyamg (smoothed aggregation setup + CG solve to a relative residual of 1e-10).
`--batch` adds the throughput test: 64 varcoef9 systems at 257^2, one batched SSI call (float64; float32
refined in float64) vs a SciPy loop.

Every worker, whatever its solver, first calls `keep_freed_memory()` (glibc keeps freed blocks in the
heap instead of unmapping them), as `mlx solve` does; `--system-malloc` runs them all with glibc's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

SOLVERS = ("ssi", "ssi32", "spsolve", "splu", "pardiso", "pyamg")
PROBLEMS = ("poisson5", "varcoef9")
# (solver, size) pairs skipped up front, with the reason printed in the table.
SKIP = {
    ("spsolve", 2049): "COLAMD SuperLU: ~30 s at 1025^2 growing ~8x per doubling (>200 s estimated from that growth)",
    ("spsolve", 4097): "COLAMD SuperLU: >1,600 s estimated (~8x per doubling from 2049^2)",
    ("splu", 4097): "SuperLU: 58-70 s and 6.9-9.1 GB at 2049^2, growing ~8x in time and ~4x in memory per doubling "
                    "(~500 s, ~30 GB estimated)",
}


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def make_stencil(kind: str, n: int, seed: int = 0) -> np.ndarray:
    from mlxkit.engines.solve.grid import stencil_mask

    s = np.zeros((n, n, 3, 3))
    if kind == "poisson5":
        s[..., 1, 1] = 4.0
        s[..., 0, 1] = s[..., 2, 1] = s[..., 1, 0] = s[..., 1, 2] = -1.0
        return s * stencil_mask(n, n)
    rng = np.random.default_rng(seed)
    c = np.exp(rng.standard_normal((n, n)))
    padded = np.pad(c, 1, mode="edge")  # ghost neighbours outside carry the node's own coefficient
    for iy in range(3):
        for ix in range(3):
            if (iy, ix) == (1, 1):
                continue
            w = 0.5 if iy != 1 and ix != 1 else 1.0
            s[..., iy, ix] = -w * (c + padded[iy:iy + n, ix:ix + n]) / 2
    s[..., 1, 1] = -s.sum((-1, -2))
    return s * stencil_mask(n, n)  # the diagonal keeps the ghost couplings: strictly dominant rows at the edge


def _warm_up(solver: str) -> None:
    """Solve a tiny system first so lazy library loading (MKL, LAPACK, caches) is not timed."""
    import scipy.sparse.linalg as spla
    import torch

    from mlxkit.engines.solve.grid import stencil_to_csr

    s = make_stencil("poisson5", 17)
    a, b = stencil_to_csr(s), np.ones(17 * 17)
    if solver == "ssi":
        from mlxkit.engines.solve.ssi import SSIFactor

        SSIFactor(torch.from_numpy(s)).solve(torch.from_numpy(b.reshape(17, 17)))
    elif solver == "ssi32":
        from mlxkit.engines.solve.matrix import factorized

        factorized(a, dtype="float32")(b)
    elif solver == "pardiso":
        import pypardiso

        pypardiso.spsolve(a, b)
    elif solver == "pyamg":
        import pyamg

        pyamg.smoothed_aggregation_solver(a).solve(b, tol=1e-10)
    else:
        spla.spsolve(a.tocsc(), b)


def _allocator() -> None:
    from mlxkit.engines.core.memory import keep_freed_memory

    if not os.environ.get("BENCH_SYSTEM_MALLOC"):
        keep_freed_memory()


def worker(solver: str, kind: str, n: int) -> dict:
    import scipy.sparse.linalg as spla
    import torch

    from mlxkit.engines.solve.grid import stencil_to_csr

    _allocator()

    torch.set_num_threads(2)
    stencil = make_stencil(kind, n)
    a = stencil_to_csr(stencil)
    rng = np.random.default_rng(1)
    b = rng.standard_normal(n * n)
    b2 = rng.standard_normal(n * n)
    _warm_up(solver)
    base = _rss_gb()
    out: dict = {"solver": solver, "problem": kind, "n": n}
    t0 = time.perf_counter()
    c0 = time.process_time()
    if solver == "ssi":
        from mlxkit.engines.solve.ssi import SSIFactor

        f = SSIFactor(torch.from_numpy(stencil))
        out["factor_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        x = f.solve(torch.from_numpy(b.reshape(n, n))).numpy().ravel()
        out["solve_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        x2 = f.solve(torch.from_numpy(b2.reshape(n, n))).numpy().ravel()
        out["resolve_s"] = time.perf_counter() - t2
        out["resolve_residual"] = float(np.linalg.norm(a @ x2 - b2) / np.linalg.norm(b2))
        out["factor_gb"] = f.nbytes() / 1e9
        out["profile"] = f.profile
    elif solver == "ssi32":
        from mlxkit.engines.solve.matrix import factorized

        f = factorized(a, dtype="float32")
        out["factor_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        x = f(b)
        out["solve_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        x2 = f(b2)
        out["resolve_s"] = time.perf_counter() - t2
        out["resolve_residual"] = float(np.linalg.norm(a @ x2 - b2) / np.linalg.norm(b2))
        out["factor_gb"] = f.nbytes() / 1e9
    elif solver == "spsolve":
        x = spla.spsolve(a.tocsc(), b)
    elif solver == "splu":
        lu = spla.splu(a.tocsc(), permc_spec="MMD_AT_PLUS_A")
        out["factor_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        x = lu.solve(b)
        out["solve_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        lu.solve(b2)
        out["resolve_s"] = time.perf_counter() - t2
    elif solver == "pardiso":
        import pypardiso

        x = pypardiso.spsolve(a, b)
        t2 = time.perf_counter()
        pypardiso.spsolve(a, b2)  # same matrix object: pypardiso re-uses its factorisation
        out["resolve_s"] = time.perf_counter() - t2
        out["total_s_first"] = t2 - t0
    elif solver == "pyamg":
        import pyamg

        ml = pyamg.smoothed_aggregation_solver(a)
        out["factor_s"] = time.perf_counter() - t0  # setup
        t1 = time.perf_counter()
        x = ml.solve(b, tol=1e-10, accel="cg", maxiter=2000)
        out["solve_s"] = time.perf_counter() - t1
    else:
        raise SystemExit(f"unknown solver {solver}")
    if "factor_s" in out:
        out["total_s"] = out["factor_s"] + out["solve_s"]
    else:
        out["total_s"] = out.pop("total_s_first", None) or time.perf_counter() - t0
    out["cpu_s"] = time.process_time() - c0
    out["residual"] = float(np.linalg.norm(a @ x - b) / np.linalg.norm(b))
    out["peak_rss_gb"] = _rss_gb()
    out["base_rss_gb"] = base
    return out


def batch_worker(count: int, n: int) -> dict:
    """Throughput: `count` different varcoef9 systems, one batched SSI call (float64, and float32 refined
    in float64 as `mlx solve --precision float32` does) vs a SciPy splu loop."""
    import scipy.sparse.linalg as spla
    import torch

    from mlxkit.engines.solve.grid import stencil_to_csr
    from mlxkit.engines.solve.matrix import DEFAULT_REFINE, RefinedSolve, ssi_batch_solver
    from mlxkit.engines.solve.ssi import SSIFactor

    _allocator()
    torch.set_num_threads(2)
    stencils = np.stack([make_stencil("varcoef9", n, seed=k) for k in range(count)])
    b = np.random.default_rng(2).standard_normal((count, n, n))
    mats = [stencil_to_csr(s) for s in stencils]

    def worst(xs) -> float:
        return float(max(np.linalg.norm(a @ np.ravel(xk) - bk.ravel()) / np.linalg.norm(bk)
                         for a, xk, bk in zip(mats, xs, b)))

    t0 = time.perf_counter()
    x = SSIFactor(torch.from_numpy(stencils)).solve(torch.from_numpy(b)).numpy()
    ssi_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    solve, _ = ssi_batch_solver(stencils, "float32", 4)
    x32 = RefinedSolve(solve, mats, DEFAULT_REFINE["float32"])(b.reshape(count, -1, 1), False)
    ssi32_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    xs = [spla.splu(a.tocsc(), permc_spec="MMD_AT_PLUS_A").solve(bk.ravel()) for a, bk in zip(mats, b)]
    scipy_s = time.perf_counter() - t0
    return {"count": count, "n": n, "ssi_s": ssi_s, "ssi32_s": ssi32_s, "scipy_loop_s": scipy_s,
            "speedup": scipy_s / ssi_s, "speedup_ssi32": scipy_s / ssi32_s, "ssi_residual": worst(x),
            "ssi32_residual": worst(x32), "scipy_residual": worst(xs), "peak_rss_gb": _rss_gb()}


def _spawn(args: list[str], timeout: float, system_malloc: bool, memory_limit_gb: float | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", *args]
    env = dict(os.environ, **({"BENCH_SYSTEM_MALLOC": "1"} if system_malloc else {}))

    def limit_memory() -> None:  # an allocation past the limit fails in the worker, not in the kernel's OOM killer
        if memory_limit_gb:
            size = int(memory_limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, preexec_fn=limit_memory)
    except subprocess.TimeoutExpired:
        return {"skipped": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"skipped": f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="257,513,1025")
    parser.add_argument("--problems", default=",".join(PROBLEMS))
    parser.add_argument("--solvers", default=",".join(SOLVERS))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is skipped")
    parser.add_argument("--batch", action="store_true", help="also run the 64 x 257^2 throughput test")
    parser.add_argument("--json", help="write all results to this file")
    parser.add_argument("--system-malloc", action="store_true", help="leave glibc's allocator at its defaults")
    parser.add_argument("--memory-limit", type=float, metavar="GiB",
                        help="address-space limit per run (RLIMIT_AS): a run that needs more fails with its error")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = batch_worker(int(args.worker[1]), int(args.worker[2])) if args.worker[0] == "batch" else \
            worker(args.worker[0], args.worker[1], int(args.worker[2]))
        print(json.dumps(result))
        return
    results = []
    print(f"load average before the run: {os.getloadavg()[0]:.1f} (2 cores); allocator: "
          f"{'glibc defaults' if args.system_malloc else 'keep_freed_memory'}")
    print("| problem | n | solver | total s | factor/setup s | solve s | re-solve s | peak RSS GB | rel. residual |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in map(int, args.sizes.split(",")):
        for kind in args.problems.split(","):
            for solver in args.solvers.split(","):
                r = {"skipped": SKIP[(solver, n)]} if (solver, n) in SKIP else _spawn([solver, kind, str(n)],
                                                                                       args.timeout, args.system_malloc,
                                                                                       args.memory_limit)
                r.update(solver=solver, problem=kind, n=n)
                results.append(r)
                if "skipped" in r:
                    print(f"| {kind} | {n}² | {solver} | skipped: {r['skipped']} | | | | | |", flush=True)
                    continue
                fmt = lambda k: f"{r[k]:.3f}" if r.get(k) is not None else "–"
                print(f"| {kind} | {n}² | {solver} | {fmt('total_s')} | {fmt('factor_s')} | {fmt('solve_s')} | "
                      f"{fmt('resolve_s')} | {r['peak_rss_gb']:.2f} | {r['residual']:.1e} |", flush=True)
    if args.batch:
        r = _spawn(["batch", "64", "257"], args.timeout, args.system_malloc, args.memory_limit)
        results.append({"batch": r})
        print(f"\nbatch 64 x 257² varcoef9: {json.dumps(r)}")
    print(f"load average after the run: {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
