"""Puzzle quality benchmark: the searched child against uniform pruning and layer dropping, before and after GKD.

Parent SmolLM2-135M-Instruct. Calibration and distillation text: wikitext-2 validation and
tinyshakespeare, interleaved in 4 kB pieces. Report: the first 8,192 tokens of wikitext-2
test in 512-token windows, through `mlx eval` (perplexity, KL to the parent, top-1 agreement).

At each target (predicted throughput on a hardware profile's default scenario) three children
are built with the same calibration data and the same GKD token budget:
  puzzle   `mlx search` on the BLD block library (MIP over replace-1-block KL);
  uniform  one KV-head count and FFN width in every layer, initialised as BLD initialises;
  layers   whole layers dropped by angular-distance importance.
On the cpu target each child's generation speed is also timed on this machine.

Every stage writes its own output under --work and is skipped when that output exists, so
the benchmark completes over several runs:

    python bench/bench_puzzle_quality.py --work runs/bench_quality --gkd-tokens 8192
    python bench/bench_puzzle_quality.py --work runs/bench_quality --report   # table + plot only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
PARENT = "smollm2-135m"
TARGETS = [("h100", "1.5x"), ("h100", "2x"), ("cpu", "1.5x")]
METHODS = ("puzzle", "uniform", "layers")
MLX = [sys.executable, "-m", "mlxkit"]
# The gkd recipe as shipped, with a global batch of 2 × 512 tokens (a step takes tens of seconds on
# 2 CPU cores) and 2 held-out sequences for the run's own log; the reported metrics come from `mlx eval`.
GKD_SETTINGS = ["--set", "optim.batch_sequences=2", "--set", "optim.micro_batch_sequences=1",
                "--set", "data.held_out_sequences=2"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_json(args: list[str], log_file: Path) -> dict:
    """Run an `mlx` command with --json; its stderr goes to `log_file`."""
    started = time.time()
    with open(log_file, "a") as err:
        done = subprocess.run(MLX + args + ["--json"], stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"command failed ({done.returncode}): mlx {' '.join(args)}; see {log_file}")
    result = json.loads(done.stdout)
    result["_stage_seconds"] = round(time.time() - started, 1)
    return result


def cached(path: Path, make) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    result = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return result


# ----------------------------------------------------------------------------- stages

def calibration_text(work: Path) -> Path:
    path = work / "calibration.txt"
    if path.exists():
        return path

    def pieces(text: str, size: int = 4000) -> list[str]:
        out, start = [], 0
        while start < len(text):
            end = text.find("\n", start + size)
            end = len(text) if end < 0 else end + 1
            out.append(text[start:end])
            start = end
        return out

    a = pieces((SHARED / "wikitext2-valid.txt").read_text(encoding="utf-8"))
    b = pieces((SHARED / "tinyshakespeare.txt").read_text(encoding="utf-8"))
    mixed = [p for k in range(max(len(a), len(b))) for p in (a[k:k + 1] + b[k:k + 1])]
    path.write_text("".join(mixed), encoding="utf-8")
    return path


def prepare(work: Path) -> Path:
    """The stages every Puzzle benchmark starts from: calibration text, block library, parent evaluation."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    calibration = calibration_text(work)
    build_library(work, calibration)
    evaluate(work, PARENT, "parent")
    return calibration


def build_library(work: Path, calibration: Path) -> dict:
    log("stage: block library (quick recipe, BLD on the calibration text)")
    library = cached(work / "library_summary.json", lambda: run_json(
        ["library", "build", "--recipe", "quick", "--data", str(calibration), "--out", str(work / "library"),
         "--keep-activations"],  # the baselines initialise their blocks from the cached activations
        work / "logs" / "library.log"))
    log(f"library: {library.get('subblocks_trained')} subblocks trained ({library.get('_stage_seconds')} s)")
    return library


def evaluate(work: Path, model: str, name: str) -> dict:
    return cached(work / "evals" / f"{name}.json", lambda: run_json(
        ["eval", model, "--data", str(SHARED / "wikitext2-test.txt"), "--reference", PARENT, "--max-tokens", "8192",
         "--seq-len", "512"], work / "logs" / f"eval-{name}.log"))


def layer_importance(work: Path) -> list[float]:
    def make() -> dict:
        import torch

        from mlxkit.engines.models.decilm.convert import from_parent
        from mlxkit.engines.models.loading import load_model
        from mlxkit.engines.puzzle.search.baselines import angular_distances

        parent = from_parent(load_model(PARENT).model)
        parent.config._attn_implementation = "sdpa"
        tokens = torch.load(work / "library" / ".work" / "tokens.pt", weights_only=True)["train"]
        return {"angular_distance": angular_distances(parent, tokens), "tokens": tokens.numel()}
    return cached(work / "layer_importance.json", make)["angular_distance"]


def build_baseline(work: Path, target: str, throughput: str, method: str, out: Path) -> dict:
    """Choose and save the uniform or layer-drop child at the target's predicted throughput."""
    from mlxkit.engines.core.manifest import Manifest
    from mlxkit.engines.errors import InfeasibleError
    from mlxkit.engines.hardware.costs import CostModel
    from mlxkit.engines.hardware.profile import load_profile
    from mlxkit.engines.models.decilm.blocks import ParentShape
    from mlxkit.engines.models.decilm.convert import from_parent
    from mlxkit.engines.models.loading import load_model
    from mlxkit.engines.models.saving import save_model
    from mlxkit.engines.puzzle.search.baselines import build_initialised_child, layer_drop_choices, uniform_choices
    from mlxkit.engines.puzzle.search.budgets import Throughput

    loaded = load_model(PARENT)
    parent = from_parent(loaded.model)
    parent.config._attn_implementation = "sdpa"
    shape = ParentShape.from_config(parent.config)
    profile = load_profile(target)
    scenario = profile.scenario(None)
    cost_model = CostModel(shape, profile, scenario)
    speedup = Throughput.parse(throughput).multiple
    if method == "uniform":
        try:
            picked = uniform_choices(shape, cost_model, speedup)
        except InfeasibleError as exc:
            return {"method": method, "infeasible": str(exc), "scenario": str(scenario)}
    else:
        picked = layer_drop_choices(shape, layer_importance(work), cost_model, speedup)
    child = build_initialised_child(parent, picked.choices, work / "library" / ".work" / "activations",
                                    work / "baseline_blocks")
    child.generation_config = loaded.model.generation_config
    manifest = Manifest(verb="bench")
    manifest.results = {"method": method, "description": picked.description, "predicted_speedup": picked.predicted_speedup}
    save_model(child, loaded.tokenizer, out, manifest)
    return {"method": method, "description": picked.description, "predicted_speedup": picked.predicted_speedup,
            "num_params": sum(p.numel() for p in child.parameters()), "scenario": str(scenario),
            "choices": [{"attention": c.attention.name, "ffn": c.ffn.name} for c in picked.choices]}


def build_child(work: Path, target: str, throughput: str, method: str) -> tuple[Path, dict]:
    name = f"{target}-{throughput}"
    out = work / "children" / name / method
    record = work / "children" / name / f"{method}.json"
    if method == "puzzle":
        def make() -> dict:
            result = run_json(["search", "--library", str(work / "library"), "--target", target, "--throughput",
                               throughput, "--out", str(out), "--overwrite"], work / "logs" / f"search-{name}.log")
            return {"method": "puzzle", "predicted_speedup": result["predicted"]["speedup"],
                    "mip_objective_sum_kl": result["objective"], "num_params": result.get("num_params"),
                    "scenario": result["scenario"], "choices": result["choices"],
                    "stage_seconds": result["_stage_seconds"]}
    else:
        def make() -> dict:
            started = time.time()
            info = build_baseline(work, target, throughput, method, out)
            info["stage_seconds"] = round(time.time() - started, 1)
            return info
    return out, cached(record, make)


def distil(work: Path, student: Path, tokens: int, calibration: Path, suffix: str = "-gkd") -> tuple[Path, dict]:
    out = student.with_name(student.name + suffix)
    record = student.with_name(student.name + suffix + ".json")
    return out, cached(record, lambda: run_json(
        ["distill", "--gkd", "--teacher", PARENT, "--student", str(student), "--data", str(calibration),
         "--tokens", str(tokens), "--out", str(out), *GKD_SETTINGS], work / "logs" / f"gkd-{student.parent.name}-{student.name}{suffix}.log"))


def generation_speed(model_spec: str, batch: int, prompt: int, generated: int, repeats: int = 3) -> dict:
    """Median wall time of prefill + `generated` greedy decode steps, batch × (prompt + generated) tokens."""
    import torch
    from transformers.cache_utils import DynamicCache

    from mlxkit.engines.models.loading import load_model

    model = load_model(model_spec, with_tokenizer=False).model
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        for index in range(repeats + 1):
            cache = DynamicCache(config=model.config)
            start = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            for _ in range(generated):
                token = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
            if index:  # the first run warms up
                times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"seconds": seconds, "tokens_per_s": batch * (prompt + generated) / seconds, "repeats": repeats,
            "batch": batch, "prompt": prompt, "generated": generated, "threads": torch.get_num_threads()}


def cpu_speeds(work: Path) -> dict:
    from mlxkit.engines.hardware.profile import load_profile

    scenario = load_profile("cpu").scenario(None)
    name = "cpu-1.5x"
    results = {}
    for label, spec in [("parent", PARENT)] + [(f"{m}{suffix}", str(work / "children" / name / f"{m}{suffix}"))
                                                for m in METHODS for suffix in ("", "-gkd")]:
        if label != "parent" and not Path(spec).exists():
            continue
        results[label] = cached(work / "speed" / f"{label}.json", lambda spec=spec: generation_speed(
            spec, scenario.batch, scenario.input_len, scenario.output_len))
    return results


# ----------------------------------------------------------------------------- report

def report(work: Path) -> str:
    parent = json.loads((work / "evals" / "parent.json").read_text())
    rows, lines, lines_infeasible = [], [], []
    for target, throughput in TARGETS:
        name = f"{target}-{throughput}"
        for method in METHODS:
            info_file = work / "children" / name / f"{method}.json"
            if not info_file.exists():
                continue
            info = json.loads(info_file.read_text())
            row = {"target": name, "method": method, **info}
            if info.get("infeasible"):
                lines_infeasible.append(f"- {name} {method}: {info['infeasible']}.")
                continue
            for stage, suffix in (("pre", ""), ("post", "-gkd")):
                path = work / "evals" / f"{name}-{method}{suffix}.json"
                if path.exists():
                    row[stage] = json.loads(path.read_text())
            gkd = work / "children" / name / f"{method}-gkd.json"
            if gkd.exists():
                row["gkd"] = json.loads(gkd.read_text())
            rows.append(row)
    speeds = {p.stem: json.loads(p.read_text()) for p in sorted((work / "speed").glob("*.json"))} \
        if (work / "speed").exists() else {}

    def fmt(row, stage, key, digits):
        value = row.get(stage, {}).get(key)
        return "–" if value is None else f"{value:.{digits}f}"

    lines.append(f"Parent: perplexity {parent['perplexity']:.2f} on {parent['tokens']} tokens.\n")
    lines.append("| target | method | choice | params (M) | predicted speedup | MIP Σ KL | ppl before | ppl after GKD | "
                 "KL before | KL after | top-1 before | top-1 after | ppl after / parent |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        choice = row.get("description") or _summarise_choices(row.get("choices", []))
        after = row.get("post", {}).get("perplexity")
        ratio = f"{after / parent['perplexity']:.3f}" if after else "–"
        mip = f"{row['mip_objective_sum_kl']:.3f}" if row.get("mip_objective_sum_kl") is not None else "–"
        params = f"{row['num_params'] / 1e6:.1f}" if row.get("num_params") else "–"
        lines.append(f"| {row['target']} | {row['method']} | {choice} | {params} | {row['predicted_speedup']:.3f} | {mip} | "
                     f"{fmt(row, 'pre', 'perplexity', 2)} | {fmt(row, 'post', 'perplexity', 2)} | "
                     f"{fmt(row, 'pre', 'kl_div', 4)} | {fmt(row, 'post', 'kl_div', 4)} | "
                     f"{fmt(row, 'pre', 'top1_agreement', 3)} | {fmt(row, 'post', 'top1_agreement', 3)} | {ratio} |")
    if lines_infeasible:
        lines.append("\nNot built (no child of that kind reaches the target under the cost model):\n")
        lines.extend(lines_infeasible)
    if speeds.get("parent"):
        base = speeds["parent"]["tokens_per_s"]
        lines.append("\nMeasured generation speed on this machine (cpu target, cpu profile's default scenario):\n")
        lines.append("| model | tokens/s | measured speedup | predicted speedup |")
        lines.append("|---|---|---|---|")
        predicted = {r["method"]: r["predicted_speedup"] for r in rows if r["target"] == "cpu-1.5x"}
        for label, speed in speeds.items():
            method = label.removesuffix("-gkd")
            pred = f"{predicted[method]:.3f}" if method in predicted else "1"
            lines.append(f"| {label} | {speed['tokens_per_s']:.1f} | {speed['tokens_per_s'] / base:.3f} | {pred} |")
    _plot(rows, parent, work / "frontier.png")
    text = "\n".join(lines)
    (work / "report.md").write_text(text + "\n")
    return text


def _summarise_choices(choices: list[dict]) -> str:
    from collections import Counter

    attention = Counter(c["attention"] for c in choices)
    ffn = Counter(c["ffn"] for c in choices)
    return "attn " + " ".join(f"{k}×{v}" for k, v in attention.most_common()) + "; ffn " + \
        " ".join(f"{k}×{v}" for k, v in ffn.most_common())


def _plot(rows: list[dict], parent: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, profile in zip(axes, ("h100", "cpu")):
        for method, marker in zip(METHODS, ("o", "s", "^")):
            for stage, style in (("pre", ":"), ("post", "-")):
                points = sorted((r["predicted_speedup"], r[stage]["perplexity"]) for r in rows
                                if r["method"] == method and r["target"].startswith(profile) and stage in r)
                if points:
                    ax.plot(*zip(*points), style, marker=marker,
                            label=f"{method} {'after GKD' if stage == 'post' else 'before GKD'}")
        ax.axhline(parent["perplexity"], color="grey", lw=0.8, label="parent")
        ax.set_yscale("log")
        ax.set_xlabel(f"predicted speedup ({profile} profile, default scenario)")
        ax.set_ylabel("wikitext-2 test perplexity")
        ax.set_title(f"SmolLM2-135M children, {profile}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "bench_quality")
    parser.add_argument("--gkd-tokens", type=int, default=8192)
    parser.add_argument("--report", action="store_true", help="only print the table from what is done")
    parser.add_argument("--skip-speed", action="store_true", help="do not time the cpu children")
    parser.add_argument("--targets", default=",".join(f"{t}:{x}" for t, x in TARGETS))
    args = parser.parse_args()
    work = args.work.resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if args.report:
        print(report(work))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    calibration = calibration_text(work)
    started = time.time()
    build_library(work, calibration)
    evaluate(work, PARENT, "parent")
    layer_importance(work)
    for item in args.targets.split(","):
        target, throughput = item.split(":")
        name = f"{target}-{throughput}"
        for method in METHODS:
            log(f"stage: {name} {method}: build")
            child, info = build_child(work, target, throughput, method)
            if info.get("infeasible"):
                log(f"  {method} cannot reach {throughput} on {target}: {info['infeasible']}")
                continue
            evaluate(work, str(child), f"{name}-{method}")
            log(f"stage: {name} {method}: GKD on {args.gkd_tokens} tokens")
            distilled, gkd = distil(work, child, args.gkd_tokens, calibration)
            log(f"  GKD {gkd.get('_stage_seconds')} s, median {gkd.get('median_tokens_per_s')} tokens/s")
            evaluate(work, str(distilled), f"{name}-{method}-gkd")
    if not args.skip_speed:
        log("stage: cpu generation speed (run alone on the machine)")
        cpu_speeds(work)
    log(f"done in {time.time() - started:.0f} s")
    print(report(work))


if __name__ == "__main__":
    main()
