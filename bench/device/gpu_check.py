"""The GPU check's steps, each in its own process under its own time limit (run by bench/gpu_check.sh).

Models are built on the device from the configs in bench/device/shapes/ with random weights, because
real weights cannot travel to the lent machine. Random weights are right for speed and memory and for
comparing precisions on the same inputs; they say nothing about a child's quality.

The driver (no --step) runs every step in order, each as `python gpu_check.py --step NAME`, so a step
that runs out of memory, hangs or crashes costs only itself. A step runs mlx verbs in-process through
the CLI (the same code path users take, `--json` output parsed) with a reporter that records each
progress task's wall time and peak GPU memory, and writes one JSON line. The driver gathers the lines
into gpu-check.jsonl and writes summary.json; the fitted profile is calibrated.yaml.

  python bench/device/gpu_check.py --device cuda --out OUT            # every step
  python bench/device/gpu_check.py --device cpu --scale small --out OUT --step precision
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
STEPS = ("models", "precision", "solve", "merge", "gkd-1b", "gkd-8b", "search-1b", "calibrate")
# Each step's share of the budget at full scale, in seconds (the driver also stops at the deadline).
BUDGET_S = {"models": 60, "precision": 90, "solve": 40, "merge": 25, "gkd-1b": 50, "gkd-8b": 70,
            "search-1b": 100, "calibrate": 45}
# Llama-3.1-8B's full depth does not fit one GPU for full-parameter GKD (float32 master weights, grads
# and AdamW state are 16 bytes a parameter): its width is kept, its depth cut to this many layers.
DEPTH_8B = 8
# Dense bf16 peak of the SXM parts, by NVIDIA's datasheets (the H200 has the H100's arithmetic).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
RANDOM_WEIGHTS = "random weights: figures of speed, memory and precision agreement, not of model quality"


# ----------------------------------------------------------------------------------------------- shapes
def shape_config(name: str, scale: str) -> dict[str, Any]:
    """The config of a named shape; at scale small, the same architecture cut to a CPU's size."""
    config = json.loads((HERE / "shapes" / f"{name}.json").read_text())
    if name == "llama-3.1-8b":
        config["num_hidden_layers"] = DEPTH_8B
    if scale == "small":
        small = {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 16, "num_hidden_layers": 2 if name == "llama-3.1-8b" else 4,
                 "vocab_size": 49152, "max_position_embeddings": 2048}
        config.update(small)
    return config


def parameter_count(config: dict[str, Any]) -> dict[str, int]:
    """Matmul parameters (the 6N of model FLOPs; the embedding lookup is no matmul) and all of them."""
    d, f, L = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or d // heads
    vocab = config["vocab_size"]
    per_layer = d * hd * (heads + 2 * kv) + heads * hd * d + 3 * d * f
    matmul = L * per_layer + d * vocab  # the head (tied or not, it is one matmul)
    total = L * (per_layer + 2 * d) + d + vocab * d * (1 if config.get("tie_word_embeddings") else 2)
    return {"matmul": matmul, "total": total}


def train_flops_per_token(config: dict[str, Any], seq_len: int, *, backward: bool) -> float:
    """Model FLOPs per token: 2N forward (4N more backward) plus attention scores, PaLM's accounting."""
    heads = config["num_attention_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads
    attention = 2 * config["num_hidden_layers"] * heads * hd * seq_len  # QK^T and AV, causal half of 2 * 2
    forward = 2 * parameter_count(config)["matmul"] + attention
    return forward * (3 if backward else 1)


# ------------------------------------------------------------------------------------- in-step helpers
class StageRecorder:
    """A reporter that records each progress task's wall time, size and peak GPU memory.

    It refines mlxkit's silent Reporter (imported late: the driver never imports mlxkit or torch).
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        from mlxkit.engines.core.progress import Reporter, TaskHandle

        class _Recorder(Reporter):
            def __init__(self, log: Callable[[str], None], syncs: list | None = None):
                self.stages: list[dict[str, Any]] = []
                self.log = log
                self.syncs = syncs

            @contextlib.contextmanager
            def task(self, description: str, total: int | None = None) -> Iterator[TaskHandle]:
                import torch

                cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                handle = _Counting()
                syncs_before = len(self.syncs) if self.syncs is not None else 0
                started = time.perf_counter()
                self.log(f"stage: {description}")
                try:
                    yield handle
                finally:
                    if torch.cuda.is_available() and torch.cuda.is_initialized():
                        torch.cuda.synchronize()
                    record = {"stage": description, "seconds": round(time.perf_counter() - started, 3),
                              "total": total, "done": handle.done}
                    if torch.cuda.is_available() and torch.cuda.is_initialized():
                        record["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
                    if self.syncs is not None:
                        record["host_syncs"] = len(self.syncs) - syncs_before
                    self.stages.append(record)
                    self.log(f"stage done: {json.dumps(record)}")

            def notice(self, message: str) -> None:
                self.log(f"notice: {message}")

        class _Counting(TaskHandle):
            def __init__(self) -> None:
                self.done = 0.0

            def advance(self, amount: float = 1.0) -> None:
                self.done += amount

        return _Recorder(*args, **kwargs)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_verb(args: list[str], recorder: Any) -> dict[str, Any]:
    """`mlx ARGS --json` in this process with `recorder` as its reporter; its JSON, or {"error": ...}."""
    import mlxkit.cli.main as cli_main

    for name, module in list(sys.modules.items()):
        if name.startswith("mlxkit.cli") and hasattr(module, "make_reporter"):
            module.make_reporter = lambda *a, **k: recorder
    log("mlx " + " ".join(args))
    buffer = io.StringIO()
    started = time.perf_counter()
    code: Any = 0
    with contextlib.redirect_stdout(buffer):
        try:
            cli_main.app(args=[*args, "--json"], standalone_mode=False)
        except SystemExit as exc:
            code = exc.code
        except Exception as exc:  # a verb's traceback is the check's finding, not its end
            code = f"{type(exc).__name__}: {exc}"
            import traceback

            traceback.print_exc(file=sys.stderr)
    text = buffer.getvalue().strip()
    try:
        result = json.loads(text[text.index("{"):]) if "{" in text else {}
    except ValueError:
        result = {"unparsed_output": text[-500:]}
    if code not in (0, None) and "error" not in result:
        result["error"] = str(code)
    result["_seconds"] = round(time.perf_counter() - started, 2)
    return result


def peak_gpu_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 3)


def reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def write_parent(config: dict[str, Any], dest: Path, device: str, tokenizer: Path, *, seed: int,
                 noise: float = 0.0, base: Path | None = None) -> dict[str, Any]:
    """A random-weight Llama parent built on `device` and saved in bfloat16 with the carried tokenizer;
    with `base`, that model's weights plus relative Gaussian `noise` (a student that differs from it)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    started = time.perf_counter()
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**config)) if base is None else LlamaForCausalLM.from_pretrained(
            base, dtype=torch.float32, device_map=device)
    if noise:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(dest)
    for item in tokenizer.iterdir():
        shutil.copy(item, dest / item.name)
    del model
    return {"path": str(dest), "params": parameter_count(config)["total"], "seconds": round(time.perf_counter() - started, 2)}


# --------------------------------------------------------------------------------------------- steps
class Step:
    def __init__(self, options: argparse.Namespace):
        self.o = options
        self.out = Path(options.out)
        self.work = Path(options.work)
        self.models = self.work / "models"
        self.carried = Path(options.carried)
        self.small = options.scale == "small"
        self.valid = self.carried / "data" / "wikitext2-valid.txt"
        self.test = self.carried / "data" / "wikitext2-test.txt"

    def dtype_flags(self, dtype: str) -> list[str]:
        return ["--device", self.o.device, "--dtype", dtype]

    def bf16(self) -> str:
        return "bfloat16"

    # ---- models ---------------------------------------------------------------------------------------
    def models_step(self) -> dict[str, Any]:
        self.models.mkdir(parents=True, exist_ok=True)
        tokenizer = self.carried / "tokenizer"
        built = {}
        for name in ("smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"):
            built[name] = write_parent(shape_config(name, self.o.scale), self.models / name, self.o.device,
                                       tokenizer, seed=0)
        # A few layers of the 135M shape for the precision step's BLD, and a student that is not its teacher.
        few = {**shape_config("smollm2-135m", self.o.scale), "num_hidden_layers": 4}
        built["smollm2-135m-4l"] = write_parent(few, self.models / "smollm2-135m-4l", self.o.device, tokenizer, seed=0)
        built["smollm2-135m-student"] = write_parent(shape_config("smollm2-135m", self.o.scale),
                                                     self.models / "smollm2-135m-student", self.o.device, tokenizer,
                                                     seed=1, noise=0.05, base=self.models / "smollm2-135m")
        return {"models": built, "note": RANDOM_WEIGHTS, "depth_8b": f"{DEPTH_8B} of 32 layers"}

    # ---- precision: bfloat16 against float32 on the same inputs ----------------------------------------
    def precision_step(self) -> dict[str, Any]:
        import torch
        from transformers import AutoModelForCausalLM

        result: dict[str, Any] = {"note": RANDOM_WEIGHTS}
        parent = self.models / "smollm2-135m"
        model = AutoModelForCausalLM.from_pretrained(parent, dtype=torch.float32).to(self.o.device).eval()
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (4, 256 if not self.small else 64), generator=generator)
        ids = ids.to(self.o.device)
        with torch.no_grad():
            reference = torch.log_softmax(model(ids).logits.float(), -1)
            with torch.autocast(device_type=torch.device(self.o.device).type, dtype=torch.bfloat16):
                low = torch.log_softmax(model(ids).logits.float(), -1)
        kl = torch.nn.functional.kl_div(low, reference, log_target=True, reduction="none").sum(-1).mean()
        agree = (low.argmax(-1) == reference.argmax(-1)).float().mean()
        result["logits"] = {"kl_fp32_to_bf16": kl.item(), "top1_agreement": agree.item(), "tokens": ids.numel()}
        del model
        reset_peak()
        tokens = "4096" if self.small else "32768"
        steps = "4" if self.small else "8"
        pairs: dict[str, dict[str, Any]] = {}
        for dtype in ("float32", "bfloat16"):
            recorder = StageRecorder(log)
            gkd = run_verb(["distill", "--gkd", "--teacher", str(parent), "--student",
                            str(self.models / "smollm2-135m-student"), "--tokens", tokens, "--data", str(self.valid),
                            "--out", str(self.work / f"gkd-{dtype}"), "--overwrite", *self.dtype_flags(dtype)],
                           recorder)
            lora = run_verb(["finetune", "--recipe", "lora", "--model", str(parent), "--data", str(self.valid),
                             "--steps", steps, "--batch", "4", "--set", "data.seq_len=128",
                             "--set", "data.held_out_sequences=4", "--out", str(self.work / f"lora-{dtype}"),
                             "--overwrite", *self.dtype_flags(dtype)], recorder)
            bld = run_verb(["library", "build", "--model", str(self.models / "smollm2-135m-4l"), "--recipe", "quick",
                            "--data", str(self.valid), "--out", str(self.work / f"bld-{dtype}"),
                            *self.dtype_flags(dtype)], recorder)
            pairs[dtype] = {"gkd": gkd, "lora": lora, "bld": bld, "stages": recorder.stages}

        def after(run: dict[str, Any], *path: str) -> float | None:
            value: Any = run
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            return value if isinstance(value, (int, float)) else None

        checks = {"gkd_held_out_kl": ("gkd", "after", "kl_div"), "lora_held_out_loss": ("lora", "after", "loss"),
                  "bld_median_kl": ("bld", "median_kl_nontrivial")}
        for label, path in checks.items():
            fp32, bf16 = after(pairs["float32"], *path), after(pairs["bfloat16"], *path)
            row: dict[str, Any] = {"float32": fp32, "bfloat16": bf16}
            if fp32 is not None and bf16 is not None:
                row["rel_diff"] = abs(bf16 - fp32) / max(abs(fp32), 1e-12)
            else:
                row["errors"] = {d: pairs[d][path[0]].get("error") for d in pairs if pairs[d][path[0]].get("error")}
            result[label] = row
        result["stages"] = {d: pairs[d]["stages"] for d in pairs}
        return result

    # ---- solve -------------------------------------------------------------------------------------------
    def solve_step(self) -> dict[str, Any]:
        import numpy as np
        import scipy.sparse as sp

        result = {}
        sides = {"float64": 129, "float32": 257} if self.small else {"float64": 1025, "float32": 2049}
        for dtype, side in sides.items():
            path = self.work / f"poisson-{side}.npz"
            t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(side, side))
            a = sp.kronsum(t, t).tocsr()
            np.savez(path, data=a.data, indices=a.indices, indptr=a.indptr, shape=np.array(a.shape),
                     format=np.array("csr"), b=np.ones(side * side))
            reset_peak()
            run = run_verb(["solve", str(path), "--device", self.o.device, "--precision", dtype], StageRecorder(log))
            run["peak_gpu_gib"] = peak_gpu_gib()
            result[f"{dtype}_{side}"] = {k: run.get(k) for k in ("method", "device", "dtype", "unknowns", "residual",
                                                                  "factor_s", "solve_s", "factor_bytes", "refine",
                                                                  "peak_gpu_gib", "error", "_seconds")}
        return result

    # ---- merge: on the device in bfloat16, against the CPU in float32 ------------------------------------
    def merge_step(self) -> dict[str, Any]:
        import torch
        from safetensors.torch import load_file
        from transformers import LlamaConfig, LlamaForCausalLM

        root = self.work / "merge"
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
        base = LlamaForCausalLM(config)
        base.save_pretrained(root / "base")
        for i in range(3):
            generator = torch.Generator().manual_seed(10 + i)
            with torch.no_grad():
                state = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in base.state_dict().items()}
            tuned = LlamaForCausalLM(config)
            tuned.load_state_dict(state)
            tuned.save_pretrained(root / f"ft{i}")
        inputs = [str(root / f"ft{i}") for i in range(3)]
        runs = {}
        for label, flags in (("device_bf16", ["--device", self.o.device, "--save-dtype", "bfloat16"]),
                             ("cpu_fp32", ["--device", "cpu", "--save-dtype", "float32"])):
            runs[label] = run_verb(["merge", "--isotropic", *inputs, "--base", str(root / "base"), *flags,
                                    "-o", str(root / label)], StageRecorder(log))
        result: dict[str, Any] = {k: {f: v.get(f) for f in ("method", "device", "tensors", "wall_time_s", "error")}
                                  for k, v in runs.items()}
        try:
            low = {}
            for f in sorted((root / "device_bf16").glob("*.safetensors")):
                low.update(load_file(f))
            ref = {}
            for f in sorted((root / "cpu_fp32").glob("*.safetensors")):
                ref.update(load_file(f))
            worst = max((low[k].float() - ref[k].float()).norm().item() / max(ref[k].float().norm().item(), 1e-12)
                        for k in ref)
            result["max_rel_diff_bf16_vs_fp32"] = worst
        except Exception as exc:  # a merge that failed above has no files to compare
            result["compare_error"] = f"{type(exc).__name__}: {exc}"
        return result

    # ---- GKD throughput, MFU, memory and host syncs ------------------------------------------------------
    def gkd_step(self, shape: str) -> dict[str, Any]:
        import torch

        config = shape_config(shape, self.o.scale)
        parent = self.models / shape
        seq_len = 256 if self.small else 1024
        batch = 4 if self.small else 8
        # At the 8B width a micro-batch of 8 x 1024 positions would hold ~4 GiB per vocabulary-wide tensor.
        micro = batch if self.small or shape != "llama-3.1-8b" else 2
        tokens = seq_len * batch * (3 if self.small else 20)  # two logged windows of 10 steps on a GPU
        from mlxkit.engines.training import loop

        syncs: list = []
        recorder = StageRecorder(log, syncs)
        read_backs: list[int] = []  # the step loop's reads of loss terms: the logged steps, where syncs belong
        original_read_back = loop.read_back

        def counted_read_back(rows):
            read_backs.append(len(rows))
            return original_read_back(rows)

        loop.read_back = counted_read_back
        log_interval = loop.log_interval
        cuda = torch.cuda.is_available()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            # The list the recorder counts is the warnings list itself, read at each task's start and end.
            recorder.syncs = caught
            run = run_verb(["distill", "--gkd", "--teacher", str(parent), "--student", str(parent), "--tokens",
                            str(tokens), "--data", str(self.valid), "--set", f"data.seq_len={seq_len}",
                            "--set", f"optim.batch_sequences={batch}", "--set", f"optim.micro_batch_sequences={micro}",
                            "--out", str(self.work / f"gkd-{shape}"), "--overwrite", *self.dtype_flags(self.bf16())],
                           recorder)
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        sync_warnings = [w for w in caught if "synchroniz" in str(w.message).lower()]
        sync_messages = [str(w.message) for w in sync_warnings]
        sites: dict[str, int] = {}
        for w in sync_warnings:  # where each sync was asked for: the lines to look at
            site = f"{w.filename}:{w.lineno}"
            sites[site] = sites.get(site, 0) + 1
        tps = run.get("median_tokens_per_s")
        flops = train_flops_per_token(config, seq_len, backward=True) + train_flops_per_token(config, seq_len,
                                                                                               backward=False)
        result: dict[str, Any] = {"shape": shape, "params": parameter_count(config), "seq_len": seq_len,
                                  "batch": batch, "micro_batch": micro, "tokens": tokens, "median_tokens_per_s": tps,
                                  "error": run.get("error"), "stages": recorder.stages,
                                  "host_syncs_total": len(sync_messages), "steps": run.get("steps"),
                                  "sync_sites": dict(sorted(sites.items(), key=lambda kv: -kv[1])[:8]),
                                  "read_backs": len(read_backs), "log_every": log_interval(torch.device(self.o.device))}
        train = [s for s in recorder.stages if s["stage"].startswith("GKD")]
        if train:
            result["host_syncs_in_step_loop"] = train[-1].get("host_syncs")
            result["peak_gpu_gib_training"] = train[-1].get("peak_gpu_gib")
            if result["peak_gpu_gib_training"]:
                # Against the 16 bytes a parameter of float32 weights, gradients and AdamW state, plus the
                # teacher's 2 in bfloat16: what the 8B and 70B plans in BENCHMARKS.md assume.
                result["peak_bytes_per_param"] = round(result["peak_gpu_gib_training"] * 2**30
                                                       / parameter_count(config)["total"], 2)
        if tps:
            result["model_tflops_per_s"] = round(flops * tps / 1e12, 2)
            if cuda:
                name = torch.cuda.get_device_name(0)
                peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
                if os.environ.get("PEAK_FLOPS"):
                    peak = float(os.environ["PEAK_FLOPS"])
                if peak:
                    result["mfu"] = round(flops * tps / peak, 4)
                    result["mfu_note"] = "teacher forward + student forward/backward model FLOPs over dense bf16 peak"
        return result

    # ---- search at 1B: BLD, scoring and the MIP ----------------------------------------------------------
    def search_step(self) -> dict[str, Any]:
        recorder = StageRecorder(log)
        child = self.work / "child-1b"
        run = run_verb(["search", "--model", str(self.models / "llama-3.2-1b"), "--target", "h100", "--recipe", "quick",
                        "--data", str(self.valid), "--out", str(child), "--overwrite",
                        *self.dtype_flags(self.bf16())], recorder)
        result: dict[str, Any] = {"wall_time_s": run.get("wall_time_s", run.get("_seconds")), "error": run.get("error"),
                                  "child": str(child) if child.is_dir() else None, "stages": recorder.stages,
                                  "note": RANDOM_WEIGHTS}
        for stage in recorder.stages:
            name = stage["stage"].lower()
            if stage["seconds"] > 0 and stage.get("done"):
                if "bld" in name or "train" in name:
                    result.setdefault("bld_blocks_per_s", round(stage["done"] / stage["seconds"], 3))
                if "scor" in name:
                    result.setdefault("scoring_variants_per_s", round(stage["done"] / stage["seconds"], 3))
        for key in ("predicted_speedup", "throughput", "engine", "num_params"):
            if key in run:
                result[key] = run[key]
        return result

    # ---- the cost model against the device ---------------------------------------------------------------
    def calibrate_step(self) -> dict[str, Any]:
        child = self.work / "child-1b"
        args = ["calibrate", "--model", str(self.models / "llama-3.2-1b"), "--device", self.o.device, "--dtype",
                "float32" if self.o.device == "cpu" else "bfloat16", "--batch", "1,8", "--seq", "128" if not self.small
                else "32", "--copies", "2", "--repeats", "2", "--decode-steps", "8" if not self.small else "2",
                "--out", str(self.out / "calibrated.yaml"), "--overwrite"]
        if child.is_dir():
            args += ["--child", str(child)]
        recorder = StageRecorder(log)
        reset_peak()
        run = run_verb(args, recorder)
        result: dict[str, Any] = {"error": run.get("error"), "fitted": run.get("fitted"), "device": run.get("device"),
                                  "summary": run.get("summary"), "peak_gpu_gib": peak_gpu_gib()}
        points = (run.get("child") or {}).get("points") or []
        result["child_points"] = points
        if points:
            result["child_speedup_max_abs_rel_error"] = max(abs(p.get("rel_error", 0.0)) for p in points)
        elif not child.is_dir():
            result["child_note"] = "no searched child (the search step did not finish): the parent alone was timed"
        return result

    def run(self, name: str) -> dict[str, Any]:
        table: dict[str, Callable[[], dict[str, Any]]] = {
            "models": self.models_step, "precision": self.precision_step, "solve": self.solve_step,
            "merge": self.merge_step, "gkd-1b": lambda: self.gkd_step("llama-3.2-1b"),
            "gkd-8b": lambda: self.gkd_step("llama-3.1-8b"), "search-1b": self.search_step,
            "calibrate": self.calibrate_step}
        return table[name]()


# -------------------------------------------------------------------------------------------- driver
def run_one(options: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        result = Step(options).run(options.step)
        ok = not _errors(result)
    except Exception as exc:  # one step's failure is recorded; the driver goes on to the next
        import traceback

        traceback.print_exc()
        result, ok = {"error": f"{type(exc).__name__}: {exc}"}, False
    line = {"step": options.step, "ok": ok, "seconds": round(time.perf_counter() - started, 2), **result}
    Path(options.result).write_text(json.dumps(line, default=str))
    return 0 if ok else 1


def _errors(result: Any) -> list[str]:
    """Every non-empty `error` value anywhere in a step's result."""
    found: list[str] = []
    if isinstance(result, dict):
        for key, value in result.items():
            if key == "error" and value:
                found.append(str(value))
            else:
                found += _errors(value)
    elif isinstance(result, list):
        for item in result:
            found += _errors(item)
    return found


def drive(options: argparse.Namespace) -> int:
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(options.work)
    # A fresh scratch folder and cache each time: a library or output left by an earlier run would be
    # reused, and the stages it skips would go unmeasured.
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    os.environ["MLXKIT_CACHE"] = str(work / "cache")
    jsonl = out / "gpu-check.jsonl"
    jsonl.write_text("")
    deadline = time.monotonic() + options.budget_s
    scale = 1.0 if options.scale == "full" else 2.0  # a CPU rehearsal is slower per unit of work
    lines = []
    for name in options.steps.split(","):
        left = deadline - time.monotonic()
        limit = min(BUDGET_S[name] * scale, left)
        if limit < 10:
            line = {"step": name, "ok": False, "seconds": 0, "error": "not started: the check's budget is spent"}
        else:
            result_file = work / f"{name}.result.json"
            result_file.unlink(missing_ok=True)
            command = [sys.executable, __file__, "--step", name, "--result", str(result_file),
                       *_forward(options)]
            log(f"step {name} (limit {limit:.0f} s)")
            began = time.perf_counter()
            try:
                subprocess.run(command, timeout=limit, stdout=sys.stderr)
            except subprocess.TimeoutExpired:
                pass
            if result_file.exists():
                line = json.loads(result_file.read_text())
            else:
                line = {"step": name, "ok": False, "seconds": round(time.perf_counter() - began, 2),
                        "error": f"no result within {limit:.0f} s (timed out or killed)"}
        lines.append(line)
        with jsonl.open("a") as handle:
            handle.write(json.dumps(line, default=str) + "\n")
        print(json.dumps({k: line.get(k) for k in ("step", "ok", "seconds", "error")}), flush=True)
    summary = summarise(lines, options)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, default=str), flush=True)
    return 0 if summary["failed"] == [] else 1


def summarise(lines: list[dict[str, Any]], options: argparse.Namespace) -> dict[str, Any]:
    by = {line["step"]: line for line in lines}

    def get(step: str, *path: str) -> Any:
        value: Any = by.get(step)
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    figures = {
        "logits_kl_fp32_to_bf16": get("precision", "logits", "kl_fp32_to_bf16"),
        "gkd_kl_rel_diff_bf16": get("precision", "gkd_held_out_kl", "rel_diff"),
        "lora_loss_rel_diff_bf16": get("precision", "lora_held_out_loss", "rel_diff"),
        "bld_kl_rel_diff_bf16": get("precision", "bld_median_kl", "rel_diff"),
        "merge_max_rel_diff_bf16": get("merge", "max_rel_diff_bf16_vs_fp32"),
        "solve_residuals": {k: (v or {}).get("residual") for k, v in (by.get("solve") or {}).items()
                            if isinstance(v, dict)},
        "gkd_1b_tokens_per_s": get("gkd-1b", "median_tokens_per_s"), "gkd_1b_mfu": get("gkd-1b", "mfu"),
        "gkd_8b_tokens_per_s": get("gkd-8b", "median_tokens_per_s"), "gkd_8b_mfu": get("gkd-8b", "mfu"),
        "gkd_8b_peak_gpu_gib": get("gkd-8b", "peak_gpu_gib_training"),
        "gkd_8b_peak_bytes_per_param": get("gkd-8b", "peak_bytes_per_param"),
        "host_syncs_in_step_loop": {s: get(s, "host_syncs_in_step_loop") for s in ("gkd-1b", "gkd-8b")},
        "search_1b_wall_s": get("search-1b", "wall_time_s"),
        "bld_blocks_per_s": get("search-1b", "bld_blocks_per_s"),
        "scoring_variants_per_s": get("search-1b", "scoring_variants_per_s"),
        "child_speedup_max_abs_rel_error": get("calibrate", "child_speedup_max_abs_rel_error"),
    }
    return {"step": "summary", "device": options.device, "scale": options.scale, "note": RANDOM_WEIGHTS,
            "machine": _machine(), "figures": figures, "depth_8b": f"{DEPTH_8B} of 32 layers",
            "goals": {"mfu_8b_bf16": 0.40, "child_speedup_rel_error": 0.15, "host_syncs_per_step": 0},
            "failed": [line["step"] for line in lines if not line.get("ok")],
            "seconds": {line["step"]: line.get("seconds") for line in lines}}


def _machine() -> dict[str, Any]:
    try:
        text = subprocess.run([sys.executable, "-c", "import json, torch; print(json.dumps({'torch': torch.__version__, "
                               "'cuda': torch.version.cuda, 'gpu': torch.cuda.get_device_name(0) if "
                               "torch.cuda.is_available() else None}))"], capture_output=True, text=True, timeout=60)
        return json.loads(text.stdout)
    except (subprocess.SubprocessError, ValueError, OSError):
        return {}


def _forward(options: argparse.Namespace) -> list[str]:
    return ["--device", options.device, "--scale", options.scale, "--out", options.out, "--work", options.work,
            "--carried", options.carried]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", choices=("full", "small"), default="full")
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default=None, help="scratch folder for models and runs (default: OUT/../.gpu-check-work)")
    parser.add_argument("--carried", default=".device")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--step", choices=STEPS, help="run one step in this process (the driver's child)")
    parser.add_argument("--result", help="where --step writes its JSON line")
    options = parser.parse_args()
    options.carried = str(Path(options.carried).resolve())
    if options.work is None:
        options.work = str(Path(os.environ.get("TMPDIR", "/tmp")) / "mlxkit-gpu-check")
    if options.step:
        return run_one(options)
    return drive(options)


if __name__ == "__main__":
    sys.exit(main())
