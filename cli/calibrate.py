"""Time block variants on this device and fit a hardware profile for the Puzzle cost model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from mlxkit.cli._errors import fail, guarded
from mlxkit.cli._options import (DeviceOpt, JsonOpt, Output, QuietOpt, SeedOpt, VerboseOpt, check_placement,
                                 claimed_output, console)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise fail(f"{flag} takes comma-separated integers (got '{text}')") from None
    if not values or min(values) < 1:
        raise fail(f"{flag} needs positive integers (got '{text}')")
    return values


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


@guarded
def calibrate_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Profile to write, e.g. hw_profiles/mybox.yaml "
                                                          "(a NAME.report.json is written beside it).")],
    model: Annotated[str, typer.Option("--model", "-m", help="Parent whose variants are timed: HF directory, hub "
                                                             "id, or 'smollm2-135m'.")] = "smollm2-135m",
    device: DeviceOpt = "cpu",
    batch: Annotated[Optional[str], typer.Option("--batch", help="Batch sizes to time, comma-separated "
                                                 "(default 1,4; llamacpp: 1).")] = None,
    seq: Annotated[str, typer.Option("--seq", help="Prompt lengths to time, comma-separated.")] = "32,128",
    base: Annotated[Optional[str], typer.Option("--base", help="Profile to start from (peaks, bandwidth, sources). "
                                                               "Default: cpu, or the GPU's own profile.")] = None,
    copies: Annotated[int, typer.Option("--copies", min=1, help="Copies of a variant per timed model.")] = 4,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed repeats (the median is kept).")] = 3,
    decode_steps: Annotated[int, typer.Option("--decode-steps", min=1, help="Decode steps per repeat.")] = 16,
    dtype: Annotated[str, typer.Option("--dtype", help="dtype of the timed weights: float32, bfloat16, float16, "
                                       "or auto (bfloat16 on a GPU that supports it, float32 on a CPU). A profile "
                                       "is fitted for one dtype, so the default stays float32.",
                                       metavar="auto|float32|bfloat16|float16")] = "float32",
    threads: Annotated[int, typer.Option("--threads", min=0, help="CPU threads for torch or llama.cpp; 0 keeps "
                                         "the engine's default (torch's, or every core). With 1 and torch the "
                                         "CPU-time clock is used.")] = 1,
    clock: Annotated[str, typer.Option("--clock", help="auto, wall or cpu (thread CPU time: one dedicated core "
                                                       "even on a busy machine).")] = "auto",
    engine: Annotated[str, typer.Option("--engine", help="torch (PyTorch eager), llamacpp (GGUF exports timed "
                                                         "in llama.cpp, batch 1; needs mlxkit[llamacpp]) or vllm "
                                                         "(Nemotron-NAS exports timed in vLLM; scripts/setup_vllm.sh "
                                                         "or MLXKIT_VLLM_PYTHON).")] = "torch",
    child: Annotated[Optional[str], typer.Option("--child", help="A searched child of --model, timed whole beside the "
                                                                 "parent: its measured speedup is reported beside the "
                                                                 "fitted profile's prediction.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing profile.")] = False,
    seed: SeedOpt = 0,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    from mlxkit.engines.calibrate.run import CalibrationSettings, run_calibrate

    check_placement(device, dtype)
    output = Output(json_out, quiet, verbose)
    settings = CalibrationSettings(model=model, device=device, batches=_ints(batch or ("1" if engine == "llamacpp" else "1,4"), "--batch"),
                                   seqs=_ints(seq, "--seq"), copies=copies, repeats=repeats,
                                   decode_steps=decode_steps, dtype=dtype, threads=threads or None, clock=clock,
                                   base_profile=base, seed=seed, engine=engine, child=child)
    with claimed_output(out, kind="file", inputs=[model, base, child]):
        result = run_calibrate(settings, out, overwrite=overwrite, reporter=output.reporter)
    report = result.report
    output.emit({"profile": str(result.profile_path), "report": str(result.report_path), "device": report["device"],
                 "fitted": report["fitted"], "summary": report["summary"], "whole_model": report["whole_model"],
                 **({"child": report["child"]} if "child" in report else {})},
                lambda _: _render(result, quiet))


def _render(result, quiet: bool) -> None:
    report = result.report
    if not quiet:
        table = Table(title=f"variants on {report['device']}: predicted vs measured (ms)")
        for column in ("variant", "batch", "prompt", "prefill pred", "prefill meas", "err",
                       "decode pred", "decode meas", "err"):
            table.add_column(column, justify="left" if column == "variant" else "right")
        for row in report["variants"]:
            p, d = row["prefill_ms"], row["decode_step_ms"]
            table.add_row(row["variant"], str(row["batch"]), str(row["seq"]), f"{p['predicted']:.3f}",
                          f"{p['measured']:.3f}", _pct(p["rel_error"]), f"{d['predicted']:.3f}",
                          f"{d['measured']:.3f}", _pct(d["rel_error"]))
        for row in report["whole_model"]:
            p, d = row["prefill_ms"], row["decode_step_ms"]
            table.add_row("[bold]whole model[/bold]", str(row["batch"]), str(row["seq"]), f"{p['predicted']:.2f}",
                          f"{p['measured']:.2f}", _pct(p["rel_error"]), f"{d['predicted']:.2f}",
                          f"{d['measured']:.2f}", _pct(d["rel_error"]))
        console.print(table)
        fitted = ", ".join(f"{k}={v:.4g}" for k, v in report["fitted"].items())
        console.print(f"fitted: {fitted}")
        worst = report["summary"]["whole_model_decode_max_abs_rel_error"]
        how = "in the fit" if report["summary"]["whole_model_in_fit"] else "held out of the fit"
        console.print(f"whole-model decode latency, worst error ({how}): {worst:.1%}")
        child = report.get("child")
        if child:
            speedups = Table(title=f"child {child['model']}: speedup over the parent ({child['engine']})")
            for column in ("batch", "prompt", "new tokens", "measured", "predicted", "err"):
                speedups.add_column(column, justify="right")
            for row in child["points"]:
                speedups.add_row(str(row["batch"]), str(row["seq"]), str(row["new_tokens"]),
                                 f"{row['measured_speedup']:.2f}x", f"{row['predicted_speedup']:.2f}x",
                                 _pct(row["rel_error"]))
            console.print(speedups)
    console.print(f"wrote {result.profile_path} and {result.report_path}")
