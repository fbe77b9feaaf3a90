"""Iso-C / Iso-CTS: official-style full-SVD implementation vs mlxkit's fast kernels, side by side.

Shapes are Llama-3-8B's: 4096×4096 (q/o), 1024×4096 (k/v), 4096×14336 (down_proj). Task vectors
are synthetic: a shared Gaussian component plus a task-specific one (T tasks), float32.
Prints one line per (shape, method) and a total; `--json PATH` writes the numbers.

  python bench/bench_iso_speed.py                      # everything, official Iso-CTS on all shapes
  python bench/bench_iso_speed.py --compose-largest    # official Iso-CTS on 4096×14336 is composed
                                                       # from measured SVD times (saves ~20 min on 2 cores)
  python bench/bench_iso_speed.py --compose-above 16777216   # ... also on 4096×4096
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from mlxkit.engines.merge import linalg

SHAPES = [(4096, 4096), (1024, 4096), (4096, 14336)]


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def task_vectors(shape, tasks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(shape, generator=gen)
    return [(0.7 * shared + torch.randn(shape, generator=gen)) * 1e-3 for _ in range(tasks)]


def report(row: dict, totals: dict) -> None:
    totals[row["method"]][0] += row["official_s"]
    totals[row["method"]][1] += row["ours_s"]
    m, n = row["shape"]
    e = "n/a" if row["rel_err"] is None else f"{row['rel_err']:.1e}"
    note = f"  ({row['note']})" if row.get("note", "measured") != "measured" else ""
    print(f"{row['method']:8s} {m}x{n:<6d} official {row['official_s']:8.1f} s  ours {row['ours_s']:7.1f} s  "
          f"speedup {row['official_s'] / row['ours_s']:5.2f}x  rel.err {e}{note}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in SHAPES))
    ap.add_argument("--compose-largest", action="store_true",
                    help="for the largest shape, compose official Iso-CTS time from measured SVD timings")
    ap.add_argument("--compose-above", type=int, default=0,
                    help="compose official Iso-CTS time for every shape with at least this many entries")
    ap.add_argument("--methods", default="iso-c,iso-cts", help="comma-separated subset of iso-c,iso-cts")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    largest = max(shapes, key=lambda s: s[0] * s[1])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    methods = args.methods.split(",")
    if (args.compose_largest or args.compose_above) and "iso-c" not in methods:
        raise SystemExit("composing official Iso-CTS times needs the Iso-C SVD timings: include iso-c in --methods")
    rows, totals = [], {m: [0.0, 0.0] for m in methods}
    for shape in shapes:
        deltas = task_vectors(shape, args.tasks, seed=0)
        total = sum(deltas)
        if "iso-c" in methods:
            t_ref, ref = timed(linalg.iso_c_reference, total)
            t_fast, fast = timed(linalg.iso_c_fast, total)
            rows.append({"shape": shape, "method": "iso-c", "official_s": t_ref, "ours_s": t_fast,
                         "rel_err": rel(fast, ref)})
            report(rows[-1], totals)
            del ref, fast
        if "iso-cts" not in methods:
            continue
        t_fast, fast = timed(linalg.iso_cts_fast, deltas)
        if (args.compose_largest and shape == largest) or (args.compose_above and
                                                             shape[0] * shape[1] >= args.compose_above):
            # official Iso-CTS = SVD(sum) + T SVDs of residuals (same shape) + SVD(U m×r) + SVD(Vᵀ r×n)
            r = min(shape)
            t_u, _ = timed(torch.linalg.svd, torch.randn(shape[0], r), full_matrices=False)
            t_ref = (2 + args.tasks) * rows[-1]["official_s"] + t_u
            err, note = None, "composed: (T+2)×SVD(m×n) + SVD(m×r), each measured"
        else:
            t_ref, ref = timed(linalg.iso_cts_reference, deltas)
            err, note = rel(fast, ref), "measured"
            del ref
        rows.append({"shape": shape, "method": "iso-cts", "official_s": t_ref, "ours_s": t_fast, "rel_err": err,
                     "note": note})
        report(rows[-1], totals)
        del fast
    for method, (off, ours) in totals.items():
        print(f"TOTAL {method:8s} official {off:8.1f} s  ours {ours:7.1f} s  speedup {off / ours:5.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"tasks": args.tasks, "rows": rows, "totals": totals}, fh, indent=2)


if __name__ == "__main__":
    main()
