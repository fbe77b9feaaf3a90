"""The GPU check's own arithmetic: the parameter counts behind its MFU figures, and its shapes' configs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
SHAPES = sorted(p.stem for p in (ROOT / "bench" / "device" / "shapes").glob("*.json"))


def _check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "device" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("scale", ["full", "small"])
@pytest.mark.parametrize("shape", SHAPES)
def test_parameter_count_matches_the_model_transformers_builds(shape: str, scale: str) -> None:
    check = _check_module()
    config = check.shape_config(shape, scale)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    total = sum(p.numel() for p in model.parameters())
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    counted = check.parameter_count(config)
    assert counted == {"matmul": matmul, "total": total}


def test_shapes_are_the_published_models_sizes() -> None:
    check = _check_module()
    # Published sizes: SmolLM2-135M 134.5M, Llama-3.2-1B 1.24B parameters (both with tied embeddings).
    assert check.parameter_count(check.shape_config("smollm2-135m", "full"))["total"] == pytest.approx(134.5e6, rel=0.01)
    assert check.parameter_count(check.shape_config("llama-3.2-1b", "full"))["total"] == pytest.approx(1.236e9, rel=0.01)
    whole = json.loads((ROOT / "bench" / "device" / "shapes" / "llama-3.1-8b.json").read_text())
    assert check.parameter_count(whole)["total"] == pytest.approx(8.03e9, rel=0.01)
