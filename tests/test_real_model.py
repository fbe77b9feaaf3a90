"""Slow tests on the real embedded default, SmolLM2-135M-Instruct (kept in the CI run)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from conftest import SHARED_DATA
from mlxkit.cli.main import app
from mlxkit.engines.models.loading import load_model

pytestmark = pytest.mark.slow
runner = CliRunner()


@pytest.fixture(scope="module")
def smollm2():
    import os

    from conftest import REAL_CACHE

    previous = os.environ.get("MLXKIT_CACHE")
    if REAL_CACHE is None:
        os.environ.pop("MLXKIT_CACHE", None)
    else:
        os.environ["MLXKIT_CACHE"] = REAL_CACHE
    try:
        yield load_model("smollm2-135m")
    finally:
        if previous is not None:
            os.environ["MLXKIT_CACHE"] = previous


def test_greedy_completion_names_paris(smollm2):
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = smollm2.model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=smollm2.tokenizer.eos_token_id)
    assert smollm2.tokenizer.decode(out[0, ids.shape[1]:]).startswith(" Paris")


def test_parent_conversion_is_exact_on_the_real_model(smollm2):
    from mlxkit.engines.models.decilm.convert import from_parent

    ids = smollm2.tokenizer("Puzzle keeps the parent's logits exactly.", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = smollm2.model(ids).logits
        converted = from_parent(smollm2.model)
        torch.testing.assert_close(converted(ids).logits, expected, rtol=0, atol=1e-5)


@pytest.mark.skipif(not (SHARED_DATA / "wikitext2-test.txt").exists(), reason="needs ../shared/data")
def test_cli_eval_perplexity_matches_plain_transformers(smollm2, real_cache):
    data = SHARED_DATA / "wikitext2-test.txt"
    result = runner.invoke(app, ["eval", "smollm2-135m", "--data", str(data), "--max-tokens", "1024",
                                 "--seq-len", "256", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    # Independent computation: plain transformers loss on the same 4 windows of the same tokens.
    ids = smollm2.tokenizer(data.read_text(encoding="utf-8")[:20000], add_special_tokens=False,
                            return_tensors="pt").input_ids[0, :1024].view(4, 256)
    with torch.no_grad():
        losses = [smollm2.model(input_ids=row[None], labels=row[None]).loss.item() for row in ids]
    assert payload["tokens"] == 4 * 255
    assert payload["perplexity"] == pytest.approx(math.exp(sum(losses) / 4), rel=0.01)
