"""`mlx calibrate`: measure block variants on the local device and refit a hardware profile.

Method (ModelOpt-style differencing)
------------------------------------
For every distinct variant V of the search space a small random-weight model is built:
one parent layer followed by `copies` layers that hold only V (an attention variant with a
no-op FFN, or an FFN variant with no-op attention). A *base* model holds the parent layer
alone. Timing those models, rather than the layer modules in isolation, keeps the real
cache, masks, rotary embeddings and per-op dispatch in the measurement; the cost of V is
`(T(base + copies·V) − T(base)) / copies`, and the base model itself measures the
non-block costs (embedding, LM head, per-step overhead).

The fit does not use those differences: it fits the profile so that the cost model
predicts the *whole* small-model times (all positive, all well above timer noise), by
least squares on log-ratios. The real parent model (weights loaded) is timed too; its
timings join the fit with a higher weight (per-layer effects such as the cost of skinny
decode matmuls at batch > 1 are below the noise of a few-layer model), unless
`fit_whole_model=False` holds them out. `bench/bench_calibrate.py` checks the fitted
profile out of sample, at batch/prompt points the calibration never timed.

Engines: `torch` times the models in PyTorch eager (what `mlx eval` and training run);
`llamacpp` exports each small model, and the parent, to GGUF and times them in llama.cpp
(batch 1, wall clock over its thread pool), so a profile can predict the serving engine
that users deploy a child to. Linear FFN has no GGUF form and is not timed there. `vllm`
exports each model to the Nemotron-NAS layout and times it in vLLM (engines/serving/vllm.py),
batches included; vLLM builds neither linear attention nor linear FFN, and only FFN widths
that `ffn_mult` gives back exactly, so only those variants are timed there.

With `child`, a searched child is timed whole beside the parent (never fitted), and the
report sets its measured speedup at each timed point beside the fitted profile's prediction.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import json
import os
import platform
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from mlxkit.engines.calibrate.fit import FIT_PARAMS, fit_profile
from mlxkit.engines.calibrate.timing import Timing, time_model
from mlxkit.engines.core.atomic import atomic_write_text
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError
from mlxkit.engines.hardware.costs import MIB, CostModel
from mlxkit.engines.hardware.profile import HardwareProfile, load_profile
from mlxkit.engines.hardware.scenario import DTYPE_BYTES, Scenario
from mlxkit.engines.models.attention import prefer_sdpa
from mlxkit.engines.models.decilm.blocks import (AttentionVariant, BlockChoice, FFNVariant, ParentShape,
                                                 parent_attention, parent_ffn)

_TORCH_TO_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_TORCH_TO_GGUF = {"float32": "f32", "float16": "f16"}
ENGINES = ("torch", "llamacpp", "vllm")
# The profile a calibration writes names the serving engine it was timed in.
_PROFILE_ENGINE = {"torch": "transformers", "llamacpp": "llamacpp", "vllm": "vllm"}


@dataclass
class CalibrationSettings:
    model: str = "smollm2-135m"
    device: str = "cpu"
    batches: Sequence[int] = (1, 4)
    seqs: Sequence[int] = (32, 128)
    copies: int = 4
    decode_steps: int = 16
    warmup: int = 1
    repeats: int = 3
    dtype: str = "float32"
    # CPU threads for torch. One thread by default: with it the CPU-time clock measures one
    # dedicated core even on a busy machine. None keeps torch's default (then the wall clock).
    threads: int | None = 1
    clock: str = "auto"  # "wall", "cpu" (thread CPU time; single-threaded CPU only) or "auto"
    base_profile: str | None = None  # default: "cpu" on CPU; the matching GPU profile on CUDA
    attention: Sequence[AttentionVariant] | None = None
    ffn: Sequence[FFNVariant] | None = None
    fit: Sequence[str] = tuple(FIT_PARAMS)
    # Whole-model timings join the fit (weighted up: they are what search decisions rest on);
    # False holds them out, so the report's whole-model rows become a validation.
    fit_whole_model: bool = True
    whole_model_weight: float = 4.0
    seed: int = 0
    engine: str = "torch"  # or "llamacpp": GGUF exports timed in llama.cpp; "vllm": Nemotron-NAS exports in vLLM
    child: str | None = None  # a searched child, timed whole beside the parent


@dataclass
class _Run:
    label: str
    kind: str  # "base", "attention", "ffn", "model"
    variant: Any
    layers: list[BlockChoice]
    batch: int
    seq: int
    timing: Timing | None = None


@dataclass
class CalibrationResult:
    profile: HardwareProfile
    profile_path: Path
    report_path: Path
    report: dict[str, Any] = field(default_factory=dict)


def calibration_variants(parent: ParentShape) -> tuple[list[AttentionVariant], list[FFNVariant]]:
    """The default variants timed: the parent and smaller KV-head counts, linear; FFN at 100/75/50/25 %, linear.

    No-op subblocks cost nothing by construction and are not timed.
    """
    kv = [n for n in range(parent.num_key_value_heads, 0, -1)
          if parent.num_attention_heads % n == 0 and parent.num_key_value_heads % n == 0]
    kv = sorted(set([kv[0], *kv[1:][-3:]]), reverse=True)  # the parent plus at most three smaller
    attention = [AttentionVariant("gqa", n) for n in kv] + [AttentionVariant("linear")]
    widths = []
    for fraction in (1.0, 0.75, 0.5, 0.25):
        width = parent.intermediate_size if fraction == 1.0 else max(64, int(round(parent.intermediate_size * fraction / 64)) * 64)
        if width not in widths:
            widths.append(width)
    ffn = [FFNVariant("mlp", w) for w in widths] + [FFNVariant("linear")]
    return attention, ffn


def describe_device(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    name = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} threads"


def _default_base(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(torch.device(device)).lower()
    for key, profile in (("h200", "h200"), ("h100 pcie", "h100-pcie"), ("h100", "h100"), ("a100", "a100-80gb"),
                         ("l40s", "l40s")):
        if key in name:
            return profile
    raise InputError(f"no packaged profile matches '{name}'; pass --base with the closest one")


def _build(parent_config, choices: list[BlockChoice], dtype, device, seed: int):
    """A random-weight child with these layers (timing does not depend on weight values)."""
    import torch

    from mlxkit.engines.models.decilm.convert import child_config
    from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM

    config = copy.deepcopy(parent_config)
    config.num_hidden_layers = len(choices)
    if hasattr(config, "layer_types") and getattr(config, "layer_types", None) is not None \
            and config.model_type != "mlx_decilm":
        config.layer_types = list(config.layer_types)[:1] * len(choices)
    child = child_config(config, choices)
    prefer_sdpa(child)
    torch.manual_seed(seed)
    model = MlxDeciLMForCausalLM(child)
    return model.to(dtype=dtype, device=device).eval()


def predict_model_ms(profile: HardwareProfile, parent: ParentShape, layers: Iterable[BlockChoice], batch: int,
                     seq: int, decode_ctx: float, weight_dtype: str) -> tuple[float, float]:
    """The cost model's prefill and decode-step times (ms) of a model made of `layers`."""
    cm = CostModel(parent, profile, Scenario(batch, seq, 2, weight_dtype, weight_dtype))
    prefill = cm.non_block_step_ms(batch, seq)
    decode = cm.non_block_step_ms(batch, 1)
    for choice, count in Counter(layers).items():
        prefill += count * (float(cm.attention_step_ms(choice.attention, batch, seq, seq)) +
                            cm.ffn_step_ms(choice.ffn, batch, seq))
        decode += count * (float(cm.attention_step_ms(choice.attention, batch, 1, decode_ctx)) +
                           cm.ffn_step_ms(choice.ffn, batch, 1))
    return prefill, decode


def _predict_variant_ms(profile: HardwareProfile, parent: ParentShape, run: _Run, decode_ctx: float,
                        weight_dtype: str) -> tuple[float, float]:
    cm = CostModel(parent, profile, Scenario(run.batch, run.seq, 2, weight_dtype, weight_dtype))
    if run.kind == "attention":
        return (float(cm.attention_step_ms(run.variant, run.batch, run.seq, run.seq)),
                float(cm.attention_step_ms(run.variant, run.batch, 1, decode_ctx)))
    return cm.ffn_step_ms(run.variant, run.batch, run.seq), cm.ffn_step_ms(run.variant, run.batch, 1)


def _rel(pred: float, meas: float) -> float | None:
    return (pred - meas) / meas if meas > 0 else None


def _check_positions(settings: CalibrationSettings) -> None:
    """Refuse, before loading weights, prompt lengths the model cannot hold (they would be timed for hours)."""
    from mlxkit.engines.models.loading import load_config

    limit = getattr(load_config(settings.model), "max_position_embeddings", None)
    need = max(settings.seqs) + settings.decode_steps
    if isinstance(limit, int) and need > limit:
        raise InputError(f"--seq {max(settings.seqs)} plus {settings.decode_steps} decode steps needs {need} "
                         f"positions, but '{settings.model}' has {limit} (max_position_embeddings)")


def run_calibrate(settings: CalibrationSettings, out: str | Path, *, overwrite: bool = False,
                  reporter: Reporter | None = None) -> CalibrationResult:
    """Time the variants, fit the profile, and write `out` (YAML) plus `<stem>.report.json` beside it."""
    import torch

    from mlxkit.engines.models.decilm.convert import from_parent
    from mlxkit.engines.models.loading import load_model
    from mlxkit.engines.training.device import dtype_name, resolve_device, resolve_dtype

    reporter = reporter or Reporter()
    out = Path(out)
    if out.suffix not in (".yaml", ".yml"):
        raise InputError(f"--out must be a .yaml file (got '{out}')")
    if out.exists() and not overwrite:
        raise InputError(f"'{out}' already exists (pass --overwrite to replace it)")
    if settings.copies < 1 or settings.repeats < 1 or settings.decode_steps < 1:
        raise InputError("copies, repeats and decode steps must all be ≥ 1")
    if not settings.batches or not settings.seqs or min(settings.batches) < 1 or min(settings.seqs) < 1:
        raise InputError("batch sizes and sequence lengths must be positive")
    # One resolution for every verb (engines/training/device.py); what follows reads the resolved names.
    resolved = resolve_device(settings.device)
    try:
        timed_dtype = dtype_name(resolve_dtype(settings.dtype, resolved))
    except InputError:
        raise InputError(f"--dtype must be auto or one of {', '.join(_TORCH_TO_DTYPE)} "
                         f"(got '{settings.dtype}')") from None
    settings = replace(settings, device=str(resolved), dtype=timed_dtype)
    if settings.clock not in ("auto", "wall", "cpu"):
        raise InputError(f"--clock must be auto, wall or cpu (got '{settings.clock}')")
    if settings.engine not in ENGINES:
        raise InputError(f"--engine must be one of {', '.join(ENGINES)} (got '{settings.engine}')")
    if settings.threads is not None and settings.threads < 1:
        raise InputError("--threads must be ≥ 1")
    llamacpp = settings.engine == "llamacpp"
    exported = settings.engine in ("llamacpp", "vllm")  # timed from an export, not in this process
    if llamacpp:
        _check_llamacpp_settings(settings)
    if settings.engine == "vllm":
        _check_vllm_settings(settings)
    _check_positions(settings)
    device = torch.device(settings.device)
    if settings.threads is not None and not exported:
        torch.set_num_threads(settings.threads)
    dtype = getattr(torch, settings.dtype)
    weight_dtype = _TORCH_TO_DTYPE[settings.dtype]
    single_cpu = device.type == "cpu" and torch.get_num_threads() == 1 and not exported
    clock = ("cpu" if single_cpu else "wall") if settings.clock == "auto" else settings.clock
    if clock not in ("cpu", "wall") or (clock == "cpu" and not single_cpu):
        raise InputError("--clock cpu needs --device cpu, --threads 1 and --engine torch (CPU time of one "
                         "thread); use wall")
    base = load_profile(settings.base_profile or _default_base(settings.device))

    reporter.notice(f"loading {settings.model}")
    loaded = load_model(settings.model, with_tokenizer=exported, reporter=reporter)
    parent_model = from_parent(loaded.model).to(dtype=torch.float32 if exported else dtype, device=device).eval()
    parent_config = loaded.model.config
    parent = ParentShape.from_config(parent_config)
    tokenizer = loaded.tokenizer
    del loaded
    default_attention, default_ffn = calibration_variants(parent)
    attention = list(settings.attention or default_attention)
    ffn = list(settings.ffn or default_ffn)
    if exported:
        from mlxkit.engines.serving.capabilities import get_engine

        engine = get_engine(settings.engine)
        attention = [v for v in attention if engine.holds_attention(v)]
        ffn = [v for v in ffn if engine.holds_ffn(v, parent.hidden_size)]
    for v in attention:
        v.validate(parent)
    for v in ffn:
        v.validate(parent)
    parent_block = BlockChoice(parent_attention(parent), parent_ffn(parent))

    models: list[tuple[str, str, Any, list[BlockChoice]]] = [("base", "base", None, [parent_block])]
    for v in attention:
        if v.kind != "no_op":
            models.append((v.name, "attention", v, [parent_block] + [BlockChoice(v, FFNVariant("no_op"))] * settings.copies))
    for v in ffn:
        if v.kind != "no_op":
            models.append((v.name, "ffn", v, [parent_block] + [BlockChoice(AttentionVariant("no_op"), v)] * settings.copies))

    whole_models = [("model", "model", None, [parent_block] * parent.num_layers)]
    child_model = None
    if settings.child is not None:
        child_model, child_layers = _load_child(settings.child, parent, dtype=torch.float32 if exported else dtype,
                                                device=device, reporter=reporter)
        whole_models.append(("child", "child", None, child_layers))

    runs: list[_Run] = []
    settings.clock = clock  # recorded in the profile
    total = (len(models) + len(whole_models)) * len(settings.batches) * len(settings.seqs)
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mlx-calibrate-"))) if exported else None

        def timer(model) -> contextlib.AbstractContextManager[Callable[[int, int], Timing]]:
            if work is not None and llamacpp:
                return _llamacpp_timer(model, tokenizer, settings, work)
            if work is not None:
                return _vllm_timer(model, tokenizer, settings, work)
            return _torch_timer(model, settings, clock)

        task = stack.enter_context(reporter.task("timing variants", total=total))
        for label, kind, variant, layers in models + whole_models:
            model = {"model": parent_model, "child": child_model}.get(kind) or \
                _build(parent_config, layers, dtype, device, settings.seed)
            with timer(model) as measure:
                for batch in settings.batches:
                    for seq in settings.seqs:
                        run = _Run(label, kind, variant, layers, batch, seq)
                        run.timing = measure(batch, seq)
                        runs.append(run)
                        task.update(model={"model": "whole model", "child": "child"}.get(kind, label), batch=batch,
                                    seq=seq)
                        task.advance()
            del model

    return _fit_and_write(runs, parent, base, settings, weight_dtype, out, reporter, overwrite=overwrite)


def _load_child(spec: str, parent: ParentShape, *, dtype, device, reporter: Reporter) -> tuple[Any, list[BlockChoice]]:
    """A searched child of the calibrated parent, and its layers."""
    from mlxkit.engines.models.decilm.convert import from_parent
    from mlxkit.engines.models.loading import load_model

    model = load_model(spec, with_tokenizer=False, reporter=reporter).model
    if model.config.model_type != "mlx_decilm":
        model = from_parent(model)  # a plain checkpoint times as the child that keeps every block
    model = model.to(dtype=dtype, device=device)
    shape = ParentShape.from_config(model.config)
    if shape != parent:
        raise InputError(f"--child '{spec}' is not a child of the calibrated parent (its parent shape differs)")
    layers = [BlockChoice(AttentionVariant.from_block_config(b["attention"], parent.num_attention_heads),
                          FFNVariant.from_block_config(b["ffn"], parent.hidden_size)) for b in model.config.block_configs]
    return model.eval(), layers


def _check_vllm_settings(settings: CalibrationSettings) -> None:
    from mlxkit.engines.serving.vllm import require_vllm_python

    if settings.dtype not in _TORCH_TO_GGUF:
        raise InputError(f"--engine vllm times exported weights in {' or '.join(_TORCH_TO_GGUF)} "
                         f"(got '{settings.dtype}')")
    if settings.clock == "cpu":
        raise InputError("--clock cpu needs --engine torch: vLLM works in its own processes; use wall")
    require_vllm_python()


@contextlib.contextmanager
def _vllm_timer(model, tokenizer, settings: CalibrationSettings,
                work: Path) -> Iterator[Callable[[int, int], Timing]]:
    """`model` exported to the Nemotron-NAS layout in `work`, every (batch, prompt length) timed in one vLLM run."""
    from mlxkit.engines.export import export_model
    from mlxkit.engines.serving.vllm import run_worker

    directory, nas = work / "model", work / "nas"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    export_model(directory, "nemotron-nas", nas, _TORCH_TO_GGUF[settings.dtype], overwrite=True)
    try:
        result = run_worker({"model": str(nas), "mode": "time", "dtype": settings.dtype, "seed": settings.seed,
                             "max_model_len": max(settings.seqs) + settings.decode_steps + 8,
                             "max_num_seqs": max(settings.batches),
                             "points": [[b, s] for b in settings.batches for s in settings.seqs],
                             "decode_steps": settings.decode_steps, "warmup": settings.warmup,
                             "repeats": settings.repeats, "vocab_size": int(model.config.vocab_size)})
        rows = {(r["batch"], r["seq"]): r for r in result["timings"]}
        weights = sum(f.stat().st_size for f in nas.glob("*.safetensors"))
        yield lambda batch, seq: Timing(prefill_ms=rows[(batch, seq)]["prefill_ms"],
                                        decode_ms=rows[(batch, seq)]["decode_ms"],
                                        decode_ctx=rows[(batch, seq)]["decode_ctx"], weights_bytes=weights,
                                        kv_cache_bytes=None, peak_bytes=None)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(nas, ignore_errors=True)


def _check_llamacpp_settings(settings: CalibrationSettings) -> None:
    from mlxkit.engines.calibrate.llamacpp_timing import require_llama_cpp

    if not settings.device.startswith("cpu"):
        raise InputError("--engine llamacpp times llama.cpp's CPU build; use --device cpu")
    if tuple(settings.batches) != (1,):
        raise InputError("--engine llamacpp times one sequence per context (llama-cpp-python); use --batch 1")
    if settings.dtype not in _TORCH_TO_GGUF:
        raise InputError(f"--engine llamacpp times GGUF weights in {' or '.join(_TORCH_TO_GGUF)} "
                         f"(got '{settings.dtype}')")
    if settings.clock == "cpu":
        raise InputError("--clock cpu needs --engine torch: llama.cpp works on its own threads; use wall")
    require_llama_cpp()


@contextlib.contextmanager
def _torch_timer(model, settings: CalibrationSettings, clock: str) -> Iterator[Callable[[int, int], Timing]]:
    yield lambda batch, seq: time_model(model, batch, seq, decode_steps=settings.decode_steps,
                                        warmup=settings.warmup, repeats=settings.repeats, seed=settings.seed,
                                        clock=clock)


@contextlib.contextmanager
def _llamacpp_timer(model, tokenizer, settings: CalibrationSettings,
                    work: Path) -> Iterator[Callable[[int, int], Timing]]:
    """`model` saved and exported to GGUF in `work` (as `mlx export` would), timed in llama.cpp, then removed."""
    from mlxkit.engines.calibrate.llamacpp_timing import time_gguf
    from mlxkit.engines.export import export_model

    directory, gguf = work / "model", work / "model.gguf"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    export_model(directory, "gguf", gguf, _TORCH_TO_GGUF[settings.dtype], overwrite=True)
    threads = settings.threads or os.cpu_count() or 1
    try:
        yield lambda batch, seq: time_gguf(gguf, seq, decode_steps=settings.decode_steps, warmup=settings.warmup,
                                           repeats=settings.repeats, threads=threads, seed=settings.seed)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        for path in work.glob("model.gguf*"):
            path.unlink()


def _fit_and_write(runs: list[_Run], parent: ParentShape, base: HardwareProfile, settings: CalibrationSettings,
                   weight_dtype: str, out: Path, reporter: Reporter, *, overwrite: bool = True) -> CalibrationResult:
    """Fit the profile to the small-model timings, then write the profile and the report."""
    import torch

    fit_runs = [r for r in runs if r.kind != "child" and (r.kind != "model" or settings.fit_whole_model)]
    measured = [v for r in fit_runs for v in (r.timing.prefill_ms, r.timing.decode_ms)]  # type: ignore[union-attr]
    weights = [settings.whole_model_weight if r.kind == "model" else 1.0 for r in fit_runs for _ in range(2)]

    def predict(profile: HardwareProfile) -> np.ndarray:
        values = []
        for r in fit_runs:
            values.extend(predict_model_ms(profile, parent, r.layers, r.batch, r.seq, r.timing.decode_ctx,  # type: ignore[union-attr]
                                           weight_dtype))
        return np.array(values)

    reporter.notice(f"fitting {', '.join(settings.fit)} to {len(measured)} timings")
    # Efficiencies stay ≤ 1: above it a factor would stand in for a wrong peak, and the profile
    # would stop being readable as "fraction of the datasheet (or measured) peak".
    bounds = {k: (1e-3, 1.0) for k in ("matmul", "memory", "attention")}
    if settings.engine in ("llamacpp", "vllm"):
        # The base cpu profile's bandwidth is what a torch reduction reached, not a datasheet peak, and
        # llama.cpp's decode streams weights faster than that (the parent measured 28.6 GB/s against 24.5).
        bounds["memory"] = FIT_PARAMS["memory"]
    fit = fit_profile(base, predict, measured, fit=settings.fit, bounds=bounds, weights=weights)

    device_name = describe_device(settings.device)
    if settings.engine == "llamacpp":
        from mlxkit.engines.calibrate.llamacpp_timing import require_llama_cpp

        device_name = f"{device_name.rsplit(',', 1)[0]}, llama.cpp (llama-cpp-python {require_llama_cpp()}), " \
                      f"{settings.threads or os.cpu_count()} threads"
    elif settings.engine == "vllm":
        from mlxkit.engines.serving.vllm import vllm_version

        device_name = f"{device_name.rsplit(',', 1)[0]}, vLLM {vllm_version()}"
    today = _dt.date.today().isoformat()
    note = (f"measured by mlx calibrate on {device_name} ({today}; model {settings.model}, {settings.dtype}, "
            f"batches {list(settings.batches)}, prompt lengths {list(settings.seqs)}): least-squares fit over "
            f"{len(measured)} prefill/decode timings")
    sources = dict(base.sources)
    for name in settings.fit:
        sources["efficiency" if name in ("matmul", "memory", "attention") else name] = note
    profile = fit.profile.model_copy(update={
        "name": out.stem,
        "description": (f"GGUF {_TORCH_TO_GGUF[settings.dtype]} weights timed on {device_name}, fitted "
                        f"by mlx calibrate --engine llamacpp (peaks and bandwidth from the {base.name} profile)"
                        if settings.engine == "llamacpp" else
                        f"Nemotron-NAS exports ({settings.dtype}) timed on {device_name}, fitted by mlx calibrate "
                        f"--engine vllm (peaks and bandwidth from the {base.name} profile)"
                        if settings.engine == "vllm" else
                        f"{base.description}; refitted by mlx calibrate on {device_name}"),
        "engine": _PROFILE_ENGINE[settings.engine],
        "sources": sources,
        "calibration": {"date": today, "model": settings.model, "device": device_name, "dtype": settings.dtype,
                        "batches": list(settings.batches), "prompt_lengths": list(settings.seqs),
                        "copies": settings.copies, "decode_steps": settings.decode_steps,
                        "repeats": settings.repeats, "torch": str(torch.__version__),
                        "threads": None if settings.device.startswith("cuda") else
                        (settings.threads or os.cpu_count()) if settings.engine == "llamacpp" else
                        None if settings.engine == "vllm" else
                        torch.get_num_threads(),
                        "clock": settings.clock, "base_profile": base.name, "engine": settings.engine,
                        "fit_rms_log_error": round(fit.rms_log_error, 4),
                        "fit_max_rel_error": round(fit.max_abs_rel_error, 4)},
    })
    report = _report(profile, parent, runs, settings, weight_dtype, fit.params)
    report["summary"]["fit_rms_log_error"] = fit.rms_log_error
    if settings.child is not None:
        report["child"] = _child_speedups(profile, parent, runs, settings, weight_dtype)
        report["summary"]["child_speedup_max_abs_rel_error"] = max(
            abs(row["rel_error"]) for row in report["child"]["points"])
    report.update(profile=str(out), device=device_name, date=today, model=settings.model)
    report_path = out.with_name(out.stem + ".report.json")
    atomic_write_text(out, "# Written by `mlx calibrate` (see engines/hardware/profile.py for the fields).\n" +
                      profile.to_yaml(), overwrite=overwrite)
    atomic_write_text(report_path, json.dumps(report, indent=2) + "\n")
    return CalibrationResult(profile, out, report_path, report)


def _child_speedups(profile: HardwareProfile, parent: ParentShape, runs: list[_Run], settings: CalibrationSettings,
                    weight_dtype: str) -> dict[str, Any]:
    """The child's measured speedup over the parent at each timed point, beside the profile's prediction.

    A point's time is its prefill plus `decode_steps` decode steps: one request of that prompt
    length and that many generated tokens, at that batch.
    """
    def total(prefill: float, decode: float) -> float:
        return prefill + settings.decode_steps * decode

    parent_runs = {(r.batch, r.seq): r for r in runs if r.kind == "model"}
    points = []
    for r in runs:
        if r.kind != "child":
            continue
        p = parent_runs[(r.batch, r.seq)]
        assert r.timing is not None and p.timing is not None
        measured = total(p.timing.prefill_ms, p.timing.decode_ms) / total(r.timing.prefill_ms, r.timing.decode_ms)
        parent_ms = total(*predict_model_ms(profile, parent, p.layers, r.batch, r.seq, p.timing.decode_ctx,
                                            weight_dtype))
        child_ms = total(*predict_model_ms(profile, parent, r.layers, r.batch, r.seq, r.timing.decode_ctx,
                                           weight_dtype))
        predicted = parent_ms / child_ms
        points.append({"batch": r.batch, "seq": r.seq, "new_tokens": settings.decode_steps,
                       "measured_speedup": measured, "predicted_speedup": predicted,
                       "rel_error": (predicted - measured) / measured})
    return {"model": settings.child, "engine": settings.engine, "points": points}


def _report(profile: HardwareProfile, parent: ParentShape, runs: list[_Run], settings: CalibrationSettings,
            weight_dtype: str, params: dict[str, float]) -> dict[str, Any]:
    base = {(r.batch, r.seq): r.timing for r in runs if r.kind == "base"}
    variants = []
    for r in runs:
        if r.kind not in ("attention", "ffn"):
            continue
        t, b = r.timing, base[(r.batch, r.seq)]
        assert t is not None and b is not None
        pred_prefill, pred_decode = _predict_variant_ms(profile, parent, r, t.decode_ctx, weight_dtype)
        meas_prefill = (t.prefill_ms - b.prefill_ms) / settings.copies
        meas_decode = (t.decode_ms - b.decode_ms) / settings.copies
        variants.append({"variant": r.label, "kind": r.kind, "batch": r.batch, "seq": r.seq,
                         "prefill_ms": {"predicted": pred_prefill, "measured": meas_prefill,
                                        "rel_error": _rel(pred_prefill, meas_prefill)},
                         "decode_step_ms": {"predicted": pred_decode, "measured": meas_decode,
                                            "rel_error": _rel(pred_decode, meas_decode)}})
    whole = []
    for r in runs:
        if r.kind != "model":
            continue
        t = r.timing
        assert t is not None
        pred_prefill, pred_decode = predict_model_ms(profile, parent, r.layers, r.batch, r.seq, t.decode_ctx,
                                                     weight_dtype)
        tokens = r.seq + settings.decode_steps
        kv_pred = r.batch * tokens * 2 * parent.num_key_value_heads * parent.head_dim * parent.num_layers * \
            _bytes(weight_dtype)
        cm = CostModel(parent, profile, Scenario(r.batch, r.seq, settings.decode_steps + 1, weight_dtype, weight_dtype))
        weights_pred = cm.parent_model().num_params * _bytes(weight_dtype)
        memory = {"weights_mib": {"predicted": weights_pred / MIB, "measured": t.weights_bytes / MIB}}
        if t.kv_cache_bytes is not None:
            memory["kv_cache_mib"] = {"predicted": kv_pred / MIB, "measured": t.kv_cache_bytes / MIB}
        if t.peak_bytes is not None:
            memory["peak_mib"] = {"predicted": cm.parent_model().memory_mib, "measured": t.peak_bytes / MIB}
        whole.append({"batch": r.batch, "seq": r.seq,
                      "prefill_ms": {"predicted": pred_prefill, "measured": t.prefill_ms,
                                     "rel_error": _rel(pred_prefill, t.prefill_ms)},
                      "decode_step_ms": {"predicted": pred_decode, "measured": t.decode_ms,
                                         "rel_error": _rel(pred_decode, t.decode_ms)},
                      "memory": memory})
    decode_errors = [abs(w["decode_step_ms"]["rel_error"]) for w in whole]
    prefill_errors = [abs(w["prefill_ms"]["rel_error"]) for w in whole]
    timings = [{"model": r.label, "kind": r.kind, "batch": r.batch, "seq": r.seq,
                "prefill_ms": r.timing.prefill_ms, "decode_step_ms": r.timing.decode_ms,  # type: ignore[union-attr]
                "decode_ctx": r.timing.decode_ctx, "layers": len(r.layers)} for r in runs]  # type: ignore[union-attr]
    return {"fitted": {k: round(v, 6) for k, v in params.items()},
            "variants": variants, "whole_model": whole, "timings": timings,
            "summary": {"whole_model_decode_max_abs_rel_error": max(decode_errors) if decode_errors else None,
                        "whole_model_prefill_max_abs_rel_error": max(prefill_errors) if prefill_errors else None,
                        "whole_model_in_fit": settings.fit_whole_model}}


def _bytes(dtype: str) -> float:
    return DTYPE_BYTES[dtype]
