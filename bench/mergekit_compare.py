"""mlx merge vs mergekit (`mergekit-yaml`, separate venv) on the same inputs: task arithmetic and TIES.

Reports the maximum absolute difference between the two outputs (per method, over all tensors),
the wall-time ratio and the peak-RSS ratio (ours / mergekit; below 1 means we use less).

Inputs: SmolLM2-135M (`smollm2-135m`) as the base and fine-tunes given with --models; without
them, `--synthetic N` writes N perturbed copies of the base (Gaussian deltas, streamed) first.

  python bench/mergekit_compare.py --synthetic 4 --work runs/mergekit_compare
  python bench/mergekit_compare.py --models runs/merge_quality/ft-* --work runs/mergekit_compare

  python bench/mergekit_compare.py --fixtures --work runs/mergekit_fixtures

`--fixtures` runs every mergekit config under tests/fixtures/mergekit/ (dtype set to float32, so
neither tool rounds) through both tools on tiny random Llamas, and reports the largest relative
difference per tensor (max |ours − mergekit| / max |mergekit|). Randomized methods (DARE, DELLA)
draw different masks in each tool, so their difference is reported but says nothing.

mergekit must live in its own venv (default /work/main/.venv-mergekit), never in mlxkit's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from mlxkit.engines.io import LazyTensorLoader, TensorWriter
from mlxkit.engines.models.loading import resolve_spec

ROOT = Path(__file__).resolve().parents[1]
# Runs a command and prints its wall time and the peak RSS of it and its children (KiB -> bytes).
_MEASURE = ("import json,resource,subprocess,sys,time;t=time.perf_counter();rc=subprocess.run(sys.argv[1:]).returncode;"
            "w=time.perf_counter()-t;print(json.dumps({'rc':rc,'wall_s':w,"
            "'peak_rss_bytes':resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss*1024}))")


def measure(cmd: list[str], env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, env=env)
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    if stats["rc"] != 0:
        raise SystemExit(f"command failed ({stats['rc']}): {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return stats


def synthetic_finetunes(base: Path, work: Path, n: int, scale: float = 0.02) -> list[Path]:
    """Base + scale·std(tensor)·N(0,1) per float tensor; config and tokenizer copied."""
    paths = []
    with LazyTensorLoader.from_path(base) as loader:
        for i in range(n):
            dst = work / f"synthetic-{i}"
            paths.append(dst)
            if (dst / "model.safetensors.index.json").exists():
                continue
            gen = torch.Generator().manual_seed(1000 + i)
            writer = TensorWriter(dst, "5GB")
            for name in loader.keys():
                t = loader.get_tensor(name)
                if t.is_floating_point():
                    t = t.float()
                    t = t + scale * t.std().clamp_min(1e-3) * torch.randn(t.shape, generator=gen)
                writer.save(name, t)
            writer.finalize()
            for f in base.iterdir():
                if f.suffix in (".json", ".jinja", ".txt") and not f.name.startswith("model.safetensors"):
                    shutil.copy2(f, dst / f.name)
            (dst / "mlxkit.json").unlink(missing_ok=True)
    return paths


def mergekit_yaml(method: str, base: Path, models: list[Path], density: float) -> str:
    lines = ["models:"]
    for m in models:
        params = "{weight: 1.0, density: %g}" % density if method == "ties" else "{weight: 1.0}"
        lines += [f"  - model: {m}", f"    parameters: {params}"]
    lines += [f"merge_method: {method}", f"base_model: {base}", "dtype: float32"]
    if method == "ties":
        lines.append("parameters: {normalize: true}")
    return "\n".join(lines) + "\n"


def max_abs_diff(a: Path, b: Path) -> float:
    worst = 0.0
    with LazyTensorLoader.from_path(a) as la, LazyTensorLoader.from_path(b) as lb:
        if set(la.keys()) != set(lb.keys()):
            raise SystemExit(f"tensor names differ: {sorted(set(la.keys()) ^ set(lb.keys()))[:5]}")
        for name in la.keys():
            worst = max(worst, float((la.get_tensor(name).float() - lb.get_tensor(name).float()).abs().max()))
    return worst


FIXTURES = ROOT / "tests" / "fixtures" / "mergekit"
RANDOMIZED = ("dare", "della")


def max_rel_diff(ours: Path, theirs: Path) -> tuple[float, str]:
    """Largest per-tensor max |a − b| / max |b|, and the tensor where it occurs."""
    worst, where = 0.0, ""
    with LazyTensorLoader.from_path(ours) as la, LazyTensorLoader.from_path(theirs) as lb:
        if set(la.keys()) != set(lb.keys()):
            raise SystemExit(f"tensor names differ: {sorted(set(la.keys()) ^ set(lb.keys()))[:5]}")
        for name in la.keys():
            a, b = la.get_tensor(name).double(), lb.get_tensor(name).double()
            rel = float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)
            if rel > worst:
                worst, where = rel, name
    return worst, where


def run_fixtures(work: Path, mergekit: str, mlx: str, env: dict, only: set[str] | None = None) -> dict:
    import re

    sys.path.insert(0, str(ROOT / "tests"))
    from test_merge_common import make_base, make_finetune

    models = work / "models"
    if not (models / "model-c").exists():
        base = make_base(models / "base")
        for i, name in enumerate(["model-a", "model-b", "model-c"]):
            make_finetune(base, models / name, seed=70 + i)
    results = {}
    for fixture in sorted(FIXTURES.glob("*.yml")):
        name = fixture.stem
        if only and name not in only:
            continue
        cfg = work / f"{name}.yml"
        cfg.write_text(re.sub(r"^dtype: .*$", "dtype: float32", fixture.read_text(), flags=re.M))
        theirs, ours = work / f"mergekit-{name}", work / f"mlx-{name}"
        for d in (theirs, ours):
            shutil.rmtree(d, ignore_errors=True)
        try:
            mk = measure_in(models, [mergekit, str(cfg), str(theirs), "--copy-tokenizer"], env)
        except SystemExit as exc:
            results[name] = {"skipped": f"mergekit failed: {str(exc).splitlines()[-1][:200]}"}
            print(f"{name:18s} skipped ({results[name]['skipped']})", flush=True)
            continue
        us = measure_in(models, [mlx, "merge", "--config", str(cfg), "-o", str(ours), "--device", "cpu", "-q"], env)
        diff, where = max_rel_diff(ours, theirs)
        results[name] = {"max_rel_diff": diff, "at": where, "randomized": name.startswith(RANDOMIZED),
                         "mergekit_wall_s": mk["wall_s"], "ours_wall_s": us["wall_s"],
                         "mergekit_peak_rss_bytes": mk["peak_rss_bytes"], "ours_peak_rss_bytes": us["peak_rss_bytes"]}
        note = "  (randomized: different masks, not comparable)" if results[name]["randomized"] else ""
        print(f"{name:18s} max rel diff {diff:.2e} at {where}  wall mergekit {mk['wall_s']:.1f} s "
              f"ours {us['wall_s']:.1f} s  peak RSS mergekit {mk['peak_rss_bytes'] / 2**20:.0f} MiB "
              f"ours {us['peak_rss_bytes'] / 2**20:.0f} MiB{note}", flush=True)
    return results


def measure_in(cwd: Path, cmd: list[str], env: dict) -> dict:
    """`measure` with the fixtures' relative model paths resolved from `cwd`."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        return measure(cmd, env)
    finally:
        os.chdir(here)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="smollm2-135m")
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--synthetic", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--work", default=str(ROOT / "runs" / "mergekit_compare"))
    ap.add_argument("--mergekit-venv", default=str(ROOT / ".venv-mergekit"))
    ap.add_argument("--methods", default="task_arithmetic,ties")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fixtures", action="store_true", help="compare on the mergekit fixtures, tiny random models")
    ap.add_argument("--only", default="", help="with --fixtures: these fixtures only (comma-separated names)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.fixtures:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        results = run_fixtures(work, str(Path(args.mergekit_venv) / "bin" / "mergekit-yaml"),
                               str(Path(sys.executable).parent / "mlx"), env,
                               set(filter(None, args.only.split(","))) or None)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return
    base = resolve_spec(args.base).path
    models = [Path(m) for m in args.models] if args.models else synthetic_finetunes(base, work, args.synthetic)
    mlx = str(Path(sys.executable).parent / "mlx")
    mergekit = str(Path(args.mergekit_venv) / "bin" / "mergekit-yaml")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    results = {}
    for method in args.methods.split(","):
        cfg = work / f"{method}.yml"
        cfg.write_text(mergekit_yaml(method, base, models, args.density))
        theirs, ours = work / f"mergekit-{method}", work / f"mlx-{method}"
        for d in (theirs, ours):
            shutil.rmtree(d, ignore_errors=True)
        mk = measure([mergekit, str(cfg), str(theirs), "--copy-tokenizer"], env)
        us = measure([mlx, "merge", "--recipe", str(cfg), "-o", str(ours), "--device", "cpu", "-q"], env)
        diff = max_abs_diff(ours, theirs)
        results[method] = {"max_abs_diff": diff, "mergekit_wall_s": mk["wall_s"], "ours_wall_s": us["wall_s"],
                           "wall_ratio": us["wall_s"] / mk["wall_s"], "mergekit_peak_rss_gib": mk["peak_rss_bytes"] / 2**30,
                           "ours_peak_rss_gib": us["peak_rss_bytes"] / 2**30,
                           "rss_ratio": us["peak_rss_bytes"] / mk["peak_rss_bytes"]}
        r = results[method]
        print(f"{method:16s} max|diff| {diff:.3e}  wall mergekit {r['mergekit_wall_s']:.1f} s ours {r['ours_wall_s']:.1f} s "
              f"(ratio {r['wall_ratio']:.2f})  peak RSS mergekit {r['mergekit_peak_rss_gib']:.2f} GiB ours "
              f"{r['ours_peak_rss_gib']:.2f} GiB (ratio {r['rss_ratio']:.2f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"models": [str(m) for m in models], "base": str(base),
                                               "density": args.density, "results": results}, indent=2))


if __name__ == "__main__":
    main()
