"""Peak memory of the verbs against model size, fitted as peak = a·N_params + b, with 8B / 70B estimates.

Models: random-initialised Llama configs of about 135M (SmolLM2-135M's shape), 321M and 822M
parameters with the SmolLM2 tokenizer, written once to --work. Each command runs in a fresh
process; its peak RSS is read from `getrusage(RUSAGE_CHILDREN)` of a wrapper process that
runs only it, so for `torchrun` it is the largest rank's peak (the launcher agent is smaller).

    python bench/bench_memory_scaling.py --work runs/bench_memory            # everything (resumable)
    python bench/bench_memory_scaling.py --work runs/bench_memory --sizes 135m --commands kd1,kd2

Commands:
  bld   `mlx library build` with a small recipe (one FFN variant per layer, few tokens)
  bldr  the same library built with the whole parent resident (`LibraryBuildOptions(stream=False)`, the old path)
  kd1   `mlx distill --kd`, teacher and student of the same config, 1 process
  kd2   the same under `torchrun --nproc_per_node 2` (FSDP2 sharding, the default with 2 processes)
  kd2r  the same with `--sharding none` (every rank a full replica: the old behaviour)
  kd1m, kd2m  kd1 and kd2 with glibc's mmap threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_=131072):
        large freed buffers go back to the system at once instead of fragmenting the heap
  eval  `mlx eval` on 2,048 tokens
  merge `mlx merge --method linear` of three models

Every finished measurement is appended to results.jsonl in --work and skipped on a rerun.
The fit is per command over the sizes measured; the 8B / 70B rows extrapolate it (for kd2 also
to 8 ranks, with per-rank memory modelled as c + d/W from the 1- and 2-process fits). On a GPU
the model memory would sit in device memory rather than host RSS; the byte counts are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
CORPUS = SHARED / "wikitext2-valid.txt"

SIZES = {  # hidden, layers, intermediate, heads, kv heads (vocab 49152, tied embeddings as SmolLM2)
    "smoke": (64, 2, 128, 4, 2),  # checks the script itself in seconds; not part of the fit
    "135m": (576, 30, 1536, 9, 3),
    "321m": (1024, 24, 2816, 16, 4),
    "822m": (2048, 16, 5632, 32, 8),
}
# The names the two larger configs had in earlier recorded commands (BENCHMARKS.md), which still run.
OLD_NAMES = {"400m": "321m", "1b": "822m"}
BIG = {"llama-3.1-8b": 8.03e9, "llama-3.3-70b": 70.6e9}
BLD_RECIPE = """
name: memory-bench
search_space: {attention: [parent], ffn_fractions: [1.0, 0.5], ffn_linear: false, ffn_no_op: false}
data: {seq_len: 64, train_sequences: 4, score_sequences: 2}
bld: {tokens_per_block: 256, batch_sequences: 2}
"""
KD_SETTINGS = {"data.seq_len": 64, "data.held_out_sequences": 1, "optim.batch_sequences": 2,
               "optim.micro_batch_sequences": 1, "schedule.eval_every": 1000, "schedule.checkpoint_every": 1000}


def tokenizer_dir() -> Path:
    from mlxkit.engines.models.default_model import ensure_default_model

    return ensure_default_model()


def make_model(size: str, root: Path, seed: int) -> Path:
    out = root / f"llama-{size}-s{seed}"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hidden, layers, inter, heads, kv = SIZES[size]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=49152,
                         max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.no_grad():
        model = LlamaForCausalLM(config)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                shape = handle.get_slice(name).get_shape()
                count = 1
                for dim in shape:
                    count *= dim
                total += count
    return total


def peak_rss_of(command: list[str], env: dict[str, str]) -> tuple[float, float, int, str]:
    """(peak RSS in MiB of the command's largest process, wall seconds, return code, stderr tail)."""
    wrapper = ("import resource, subprocess, sys, json; "
               "done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024; "
               "print(json.dumps({'peak': peak, 'rc': done.returncode, 'err': done.stderr[-1500:]}))")
    started = time.time()
    done = subprocess.run([sys.executable, "-c", wrapper, *command], cwd=REPO, env=env, capture_output=True,
                          text=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return report["peak"], time.time() - started, report["rc"], report["err"]


def command_for(name: str, size: str, work: Path) -> list[str]:
    mlx = [sys.executable, "-m", "mlxkit"]
    teacher, student = make_model(size, work / "models", 0), make_model(size, work / "models", 1)
    out = work / "outputs" / f"{name}-{size}"
    if name == "bld":
        recipe = work / "bld-recipe.yaml"
        recipe.write_text(BLD_RECIPE)
        return [*mlx, "library", "build", "--model", str(teacher), "--recipe", str(recipe), "--data", str(CORPUS),
                "--out", str(out), "--device", "cpu", "--quiet"]
    if name == "bldr":
        recipe = work / "bld-recipe.yaml"
        recipe.write_text(BLD_RECIPE)
        code = ("import sys; from pathlib import Path; "
                "from mlxkit.engines.puzzle.library.build import LibraryBuildOptions, run_library_build; "
                "from mlxkit.engines.puzzle.recipe import load_recipe; "
                "run_library_build(LibraryBuildOptions(model=sys.argv[1], out=Path(sys.argv[2]), "
                "recipe=load_recipe(sys.argv[3]), data=Path(sys.argv[4]), device='cpu', stream=False))")
        return [sys.executable, "-c", code, str(teacher), str(out), str(recipe), str(CORPUS)]
    if name.startswith("kd"):
        fixed_threshold = ["env", "MALLOC_MMAP_THRESHOLD_=131072"] if name.endswith("m") else []
        kd = ["distill", "--kd", "--teacher", str(teacher), "--student", str(student), "--data", str(CORPUS),
              "--tokens", str(2 * 2 * 64), "--out", str(out), "--device", "cpu", "--quiet",
              *[f"--set={k}={v}" for k, v in KD_SETTINGS.items()]]
        if name in ("kd1", "kd1m"):
            return [*fixed_threshold, *mlx, *kd]
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29591",
                  "-m", "mlxkit"]
        return [*fixed_threshold, *launch, *kd, *(["--sharding", "none"] if name == "kd2r" else [])]
    if name == "eval":
        return [*mlx, "eval", str(teacher), "--data", str(CORPUS), "--max-tokens", "2048", "--seq-len", "512",
                "--device", "cpu", "--json"]
    if name == "merge":
        third = make_model(size, work / "models", 2)
        return [*mlx, "merge", "--method", "linear", str(teacher), str(student), str(third), "--out", str(out),
                "--device", "cpu", "--json"]
    raise SystemExit(f"unknown command {name}")


def fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares a, b of peak_mib = a·N + b over (N, peak) points."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    a = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    return a, mean_y - a * mean_x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "bench_memory")
    parser.add_argument("--sizes", default="135m,321m,822m")
    parser.add_argument("--commands", default="bld,bldr,kd1,kd2,kd2r,eval,merge")
    args = parser.parse_args()
    work = args.work.resolve()
    (work / "outputs").mkdir(parents=True, exist_ok=True)
    results_file = work / "results.jsonl"
    done = {(r["command"], r["size"]) for r in map(json.loads, results_file.read_text().splitlines())} \
        if results_file.exists() else set()
    env = {**os.environ, "MLXKIT_BACKEND": "gloo", "OMP_NUM_THREADS": "1", "MLXKIT_THREADS": "1",
           "MLXKIT_CACHE": str(work / "cache")}
    for size in (OLD_NAMES.get(name, name) for name in args.sizes.split(",")):
        for name in args.commands.split(","):
            if (name, size) in done:
                continue
            command = command_for(name, size, work)
            import shutil

            shutil.rmtree(work / "outputs" / f"{name}-{size}", ignore_errors=True)
            for leftover in (work / "outputs").glob(f".{name}-{size}*"):
                shutil.rmtree(leftover, ignore_errors=True)
            peak, seconds, rc, err = peak_rss_of(command, env)
            n = parameters(make_model(size, work / "models", 0))
            row = {"command": name, "size": size, "params": n, "fp32_mib": n * 4 / 2 ** 20, "peak_rss_mib": peak,
                   "wall_s": round(seconds, 1), "rc": rc}
            if rc != 0:
                row["error"] = err[-600:]
            print(json.dumps(row), flush=True)
            with open(results_file, "a") as handle:
                handle.write(json.dumps(row) + "\n")
    report(results_file)


def report(results_file: Path) -> None:
    rows = [json.loads(line) for line in results_file.read_text().splitlines()]
    ok = [r for r in rows if r["rc"] == 0]
    print("\n| command | size | params | fp32 weights (MiB) | peak RSS (MiB) | peak / fp32 |")
    print("|---|---|---:|---:|---:|---:|")
    for r in sorted(ok, key=lambda r: (r["command"], r["params"])):
        print(f"| {r['command']} | {r['size']} | {r['params'] / 1e6:.0f}M | {r['fp32_mib']:.0f} | "
              f"{r['peak_rss_mib']:.0f} | {r['peak_rss_mib'] / r['fp32_mib']:.2f} |")
    fits = {}
    for name in sorted({r["command"] for r in ok}):
        line = fit([(r["params"], r["peak_rss_mib"]) for r in ok if r["command"] == name and r["size"] != "smoke"])
        if line is not None:
            fits[name] = line
    print("\n| command | a (bytes / param) | b (MiB) | Llama-3.1-8B (GiB) | Llama-3.3-70B (GiB) |")
    print("|---|---:|---:|---:|---:|")
    for name, (a, b) in fits.items():
        est = {k: (a * n + b) / 1024 for k, n in BIG.items()}
        print(f"| {name} | {a * 2 ** 20:.1f} | {b:.0f} | {est['llama-3.1-8b']:.0f} | {est['llama-3.3-70b']:.0f} |")
    if "kd1" in fits and "kd2" in fits:
        a1, b1 = fits["kd1"]
        a2, b2 = fits["kd2"]
        d = 2 * (a1 - a2)  # per-rank bytes/param = c + d/W
        c = max(0.0, a1 - d)  # a negative replicated part is noise of a two-point fit
        print("\nKD per rank on 8 ranks (c + d/W from the 1- and 2-process fits): " + ", ".join(
            f"{k} {((c + d / 8) * n + b2) / 1024:.0f} GiB" for k, n in BIG.items()))
    for r in rows:
        if r["rc"] != 0:
            print(f"\nfailed: {r['command']} {r['size']}: {r.get('error', '')[-300:]}")


if __name__ == "__main__":
    main()
