"""Benchmark: how well a calibrated profile predicts SmolLM2-135M on this CPU.

Two parts:

1. `mlx calibrate` itself (default settings) into a temporary profile: wall time, fit
   error, and the whole-model prefill / decode-step error at the calibration points (these
   timings are part of the fit, so this is an in-sample error).
2. An out-of-sample check of a profile (default: the freshly fitted one; `--profile cpu`
   for the packaged one): the real SmolLM2-135M is timed at batch/prompt points the
   calibration did not use, and compared with the cost model's predictions.

    .venv/bin/python bench/bench_calibrate.py [--threads 1] [--profile cpu] [--skip-calibrate] [--json out.json]

With one thread (the default, as in `mlx calibrate`) times are the thread's CPU time, so
other processes on a shared machine inflate them less.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

CHECK_POINTS = ((1, 48), (2, 96), (1, 200), (8, 64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", default=None, help="profile for part 2 (default: the one calibrated in part 1)")
    parser.add_argument("--skip-calibrate", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    from mlxkit.engines.calibrate.run import CalibrationSettings, describe_device, predict_model_ms, run_calibrate
    from mlxkit.engines.calibrate.timing import time_model
    from mlxkit.engines.models.decilm.convert import from_parent
    from mlxkit.engines.models.loading import load_model
    from mlxkit.engines.hardware.profile import load_profile
    from mlxkit.engines.models.decilm.blocks import BlockChoice, ParentShape, parent_attention, parent_ffn

    torch.set_num_threads(args.threads)
    # The same clock calibrate uses: thread CPU time when single-threaded, else the wall clock.
    clock = "cpu" if args.threads == 1 else "wall"
    results: dict = {"device": describe_device("cpu"), "model": args.model, "clock": clock}
    profile_path = args.profile
    if not args.skip_calibrate:
        out = Path(tempfile.mkdtemp()) / "bench_cpu.yaml"
        start = time.perf_counter()
        calibration = run_calibrate(CalibrationSettings(model=args.model, threads=args.threads), out)
        results["calibrate_wall_s"] = round(time.perf_counter() - start, 1)
        report = calibration.report
        results["fitted"] = report["fitted"]
        results["fit_rms_log_error"] = calibration.profile.calibration["fit_rms_log_error"]
        results["whole_model_at_calibration_points"] = [
            {"batch": r["batch"], "seq": r["seq"],
             "prefill_rel_error": round(r["prefill_ms"]["rel_error"], 4),
             "decode_rel_error": round(r["decode_step_ms"]["rel_error"], 4),
             "decode_ms_measured": round(r["decode_step_ms"]["measured"], 3)} for r in report["whole_model"]]
        print(json.dumps({k: results[k] for k in ("calibrate_wall_s", "fitted", "fit_rms_log_error")}))
        for row in results["whole_model_at_calibration_points"]:
            print(json.dumps(row))
        profile_path = profile_path or str(out)
    if profile_path is None:
        raise SystemExit("--skip-calibrate needs --profile")
    profile = load_profile(profile_path)
    loaded = load_model(args.model, with_tokenizer=False)
    model = from_parent(loaded.model).eval()
    parent = ParentShape.from_config(loaded.model.config)
    layers = [BlockChoice(parent_attention(parent), parent_ffn(parent))] * parent.num_layers
    checks = []
    for batch, seq in CHECK_POINTS:
        timing = time_model(model, batch, seq, decode_steps=16, warmup=1, repeats=args.repeats, clock=clock)
        prefill, decode = predict_model_ms(profile, parent, layers, batch, seq, timing.decode_ctx, "fp32")
        row = {"batch": batch, "seq": seq, "profile": profile.name,
               "prefill_ms": [round(prefill, 2), round(timing.prefill_ms, 2)],
               "prefill_rel_error": round((prefill - timing.prefill_ms) / timing.prefill_ms, 4),
               "decode_ms": [round(decode, 3), round(timing.decode_ms, 3)],
               "decode_rel_error": round((decode - timing.decode_ms) / timing.decode_ms, 4)}
        checks.append(row)
        print(json.dumps(row))
    results["out_of_sample"] = checks
    results["out_of_sample_decode_max_abs_error"] = max(abs(r["decode_rel_error"]) for r in checks)
    print(json.dumps({"out_of_sample_decode_max_abs_error": results["out_of_sample_decode_max_abs_error"]}))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
