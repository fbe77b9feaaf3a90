"""Benchmark: each parent family on a tiny random parent: identity error, search time, which exports hold it.

For every family, a random parent of transformers' own class (4 layers, hidden 64, FFN 256, the
test suite's `tiny_parent`) is
  * converted to the child class with every block at the parent's shape and run on random tokens
    beside transformers' parent: the largest |Δlogit| in float32 (the identity check);
  * searched end to end in-process: `mlx search --model P --target cpu --recipe <tiny> --throughput 1.3x
    --data T --gkd-tokens 256` (BLD library, scores, MIP, assembly, GKD), wall time, the median of
    --repeats runs, each with an empty cache;
  * saved as its converted self and exported to hf and nemotron-nas (each loaded by transformers in a
    process where `import mlxkit` fails) and to a f32 GGUF (run through the numpy reading of llama.cpp's
    deci graph in tests/test_export_support.py, not llama.cpp itself): the largest |Δlogit| against
    transformers' parent, or the export's refusal.

    .venv/bin/python bench/bench_families.py [--families qwen3,phi3] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

FAMILIES = ("llama", "llama3-rope", "mistral", "mistral-window", "qwen2", "qwen3", "phi3", "phi3-longrope",
            "phi3-window", "qwen2-some-windowed", "gemma", "gemma2")
GKD = ["--gkd-set", "data.seq_len=32", "--gkd-set", "data.held_out_sequences=2", "--gkd-set",
       "optim.batch_sequences=4"]


def _export_error(directory: Path, fmt: str, ids: list[int], expected: torch.Tensor, work: Path) -> str:
    """The largest |Δlogit| of `fmt`'s export against `expected` [T, V], or the refusal's first line.

    The numpy reading of the deci graph has plain RoPE only (no `rope_freqs`), so a GGUF with another
    RoPE is written but not read here; tests/test_export_gguf.py checks those in llama.cpp.
    """
    from test_export_support import deci_reference_logits, logits_without_mlxkit

    from mlxkit.engines.errors import MlxkitError
    from mlxkit.engines.export import export_model

    out = work / (f"{fmt}.gguf" if fmt == "gguf" else fmt)
    try:
        export_model(directory, fmt, out)
    except MlxkitError as exc:
        return f"refused: {str(exc).splitlines()[0][:90]}"
    if fmt == "gguf":
        rope = json.loads((directory / "config.json").read_text()).get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            return f"written, not read here ({rope['rope_type']} RoPE)"
        logits = torch.from_numpy(deci_reference_logits(out, ids)).float()
    else:
        logits = torch.from_numpy(logits_without_mlxkit(out, ids, work)[0]).float()
    return f"{(logits - expected).abs().max().item():.1e}"


def measure(family: str, work: Path, repeats: int) -> dict:
    import os
    from conftest import TINY_PUZZLE_RECIPE
    from test_export_support import save_dir
    from test_families import random_ids, tiny_parent
    from typer.testing import CliRunner

    from mlxkit.cli.main import app
    from mlxkit.engines.models.decilm.convert import from_parent

    # A cache of its own: the library cache would find the same random parent of an earlier family run.
    os.environ["HF_HUB_OFFLINE"] = "1"
    parent = tiny_parent(family, intermediate_size=256)
    ids = random_ids()
    with torch.no_grad():
        expected = parent(ids).logits
        identity = (from_parent(parent)(ids).logits - expected).abs().max().item()
    parent_dir = save_dir(tiny_parent(family, intermediate_size=256), work / "parent")
    (work / "tiny.yaml").write_text(TINY_PUZZLE_RECIPE)
    text = work / "text.txt"
    text.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}.\n"
                            for i in range(400)))
    times = []
    for run in range(repeats):  # each run from nothing: its own cache and output
        os.environ["MLXKIT_CACHE"] = str(work / f"cache{run}")
        start = time.perf_counter()
        result = CliRunner().invoke(app, ["search", "--model", str(parent_dir), "--target", "cpu", "--recipe",
                                          str(work / "tiny.yaml"), "--throughput", "1.3x", "--data", str(text),
                                          "--out", str(work / f"child{run}"), "--gkd-tokens", "256", *GKD, "--json",
                                          "--quiet"])
        times.append(time.perf_counter() - start)
        if result.exit_code != 0:
            raise SystemExit(f"{family}: mlx search failed:\n{result.output}")
    converted = save_dir(from_parent(tiny_parent(family, intermediate_size=256)), work / "converted")
    one = ids[0].tolist()
    exports = {fmt: _export_error(converted, fmt, one, expected[0], work) for fmt in ("hf", "nemotron-nas", "gguf")}
    return {"family": family, "identity_max_abs": identity, "search_s": sorted(times)[len(times) // 2],
            "search_s_all": [round(t, 2) for t in times], **exports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--repeats", type=int, default=3, help="searches per family; the median is reported")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import mlxkit  # noqa: F401  (registers the Auto classes)

    rows = []
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as work:
            rows.append(measure(family, Path(work), args.repeats))
        row = rows[-1]
        print(f"| {row['family']} | {row['identity_max_abs']:.1e} | {row['search_s']:.1f} | {row['hf']} | "
              f"{row['nemotron-nas']} | {row['gguf']} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
