"""Benchmark: do exported children compute what the torch child computes? Real model, held-out text.

For each child directory (a `mlx search` child of SmolLM2-135M), the first --tokens tokens of
wikitext-2 test are run through
  * the torch child (`AutoModelForCausalLM` after `import mlxkit`): the reference;
  * llama.cpp (llama-cpp-python) on `mlx export --format gguf` in f32, f16 and q8_0, F32 KV cache;
  * llama.cpp on the GGUF that llama.cpp's own `convert_hf_to_gguf.py` makes of
    `mlx export --format nemotron-nas` (with --llama-cpp-dir; a refusal is reported as such);
  * transformers with `trust_remote_code=True` on `mlx export --format hf`, in a process where
    `import mlxkit` fails.
Reported per path: top-1 agreement with the reference, mean KL(reference || path) in nats over
the positions that predict a next token, and the largest |Δlogit| relative to the largest
reference logit.

    .venv/bin/python bench/bench_export_agreement.py CHILD [CHILD ...] [--tokens 256] \\
        [--llama-cpp-dir vendor/llama.cpp] [--json out.json]

Needs `pip install -e .[llamacpp]`. Not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "data" / "wikitext2-test.txt"

_WITHOUT_MLXKIT = r'''
import sys
sys.path.insert(0, {site!r})  # run with -I -S: no site hooks (an editable mlxkit install is one), no cwd

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "mlxkit" or name.startswith("mlxkit."):
            raise ImportError("mlxkit is blocked in this process")
        return None

sys.meta_path.insert(0, _Blocked())
import numpy as np
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({directory!r}, trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(torch.tensor([{ids!r}])).logits[0].double().numpy()
np.save({out!r}, logits)
'''


def _metrics(reference: np.ndarray, other: np.ndarray) -> dict:
    from mlxkit.engines.eval.metrics import kl_per_position

    ref, oth = torch.from_numpy(reference[:-1]), torch.from_numpy(other[:-1])  # positions with a next token
    return {"top1_agreement": float((ref.argmax(-1) == oth.argmax(-1)).double().mean()),
            "kl_div": float(kl_per_position(ref, oth).mean()),
            "max_rel_logit_error": float((ref - oth).abs().max() / ref.abs().max())}


def _llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    import llama_cpp

    from mlxkit.engines.calibrate.llamacpp_timing import native_stderr_silenced

    with native_stderr_silenced():
        llm = llama_cpp.Llama(str(path), n_ctx=len(ids) + 8, n_batch=len(ids), n_threads=2, logits_all=True,
                              verbose=False, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float64)
    finally:
        llm.close()


def _remote_code_logits(directory: Path, ids: list[int], work: Path) -> np.ndarray:
    out = work / "remote.npy"
    script = _WITHOUT_MLXKIT.format(site=sysconfig.get_paths()["purelib"], directory=str(directory), ids=ids,
                                    out=str(out))
    env = {**os.environ, "HF_MODULES_CACHE": str(work / "hf_modules"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run([sys.executable, "-I", "-S", "-c", script], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return np.load(out)


def bench_child(child: Path, ids: list[int], args: argparse.Namespace, work: Path) -> dict:
    import mlxkit  # noqa: F401  (registers the child's Auto classes)
    from transformers import AutoModelForCausalLM

    from mlxkit.engines.export import export_model

    model = AutoModelForCausalLM.from_pretrained(child).eval()
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].double().numpy()
    del model
    rows = {}
    for dtype in ("f32", "f16", "q8_0"):
        path = work / f"{child.name}-{dtype}.gguf"
        export_model(child, "gguf", path, dtype, overwrite=True)
        rows[f"gguf {dtype}"] = _metrics(reference, _llama_cpp_logits(path, ids))
        path.unlink()
    nas = work / f"{child.name}-nas"
    try:
        export_model(child, "nemotron-nas", nas, "f32", overwrite=True)
    except Exception as exc:  # a format refusal is a result here, not a crash of the benchmark
        rows["nemotron-nas -> convert_hf_to_gguf"] = {"refused": f"mlx export: {exc}"}
    else:
        if args.llama_cpp_dir:
            converted = work / f"{child.name}-converted.gguf"
            done = subprocess.run([sys.executable, str(Path(args.llama_cpp_dir) / "convert_hf_to_gguf.py"), str(nas),
                                   "--outfile", str(converted), "--outtype", "f32"], capture_output=True, text=True,
                                  timeout=1200, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if done.returncode == 0:
                rows["nemotron-nas -> convert_hf_to_gguf"] = _metrics(reference, _llama_cpp_logits(converted, ids))
                converted.unlink()
            else:
                rows["nemotron-nas -> convert_hf_to_gguf"] = {"refused": "convert_hf_to_gguf.py: "
                                                              + done.stderr.strip().splitlines()[-1][:300]}
    hf = work / f"{child.name}-hf"
    export_model(child, "hf", hf, "f32", overwrite=True)
    rows["hf remote code, no mlxkit"] = _metrics(reference, _remote_code_logits(hf, ids, work))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("children", nargs="+", type=Path)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--llama-cpp-dir", default=os.environ.get("MLXKIT_LLAMA_CPP_DIR"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.children[0])
    ids = tokenizer(args.text.read_text())["input_ids"][: args.tokens]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-export-agreement-") as tmp:
        for child in args.children:
            results[str(child)] = bench_child(child, ids, args, Path(tmp))
            print(f"\n{child} ({len(ids)} tokens of {args.text.name})")
            print(f"{'path':<40}{'top-1':>9}{'KL (nats)':>12}{'max rel err':>13}")
            for name, row in results[str(child)].items():
                if "refused" in row:
                    print(f"{name:<40}  {row['refused']}")
                else:
                    print(f"{name:<40}{row['top1_agreement']:>9.4f}{row['kl_div']:>12.2e}"
                          f"{row['max_rel_logit_error']:>13.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tokens": len(ids), "text": str(args.text), "results": results},
                                              indent=2) + "\n")


if __name__ == "__main__":
    main()
