"""Tokenizer pre-flight: inputs whose tokenizers differ are refused before any tensor is read,
unless the config says which tokenizer the output carries."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from mlxkit.cli.main import app
from test_merge_common import add_char_tokenizer, make_base, make_finetune

runner = CliRunner()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    base = add_char_tokenizer(make_base(root / "base"))
    fts = [add_char_tokenizer(make_finetune(base, root / f"ft{i}", seed=90 + i)) for i in range(2)]
    return base, fts


def _variant(src, dst, edit):
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def _swap_two_tokens(path):
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (path / "tokenizer.json").write_text(json.dumps(data))


def _set_eos(path):
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "\n"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def _set_template(path):
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def _merge(tmp_path, base, fts, *extra):
    recipe = tmp_path / "m.yml"
    recipe.write_text("models:\n" + "".join(f"  - model: {f}\n" for f in fts) +
                      f"base_model: {base}\nmerge_method: ties\n" + "".join(extra))
    return runner.invoke(app, ["merge", "--config", str(recipe), "-o", str(tmp_path / "out"), "--device", "cpu", "-q"])


def test_same_tokenizers_merge(tmp_path, models):
    base, fts = models
    assert _merge(tmp_path, base, fts).exit_code == 0


@pytest.mark.parametrize("edit,message,policy", [
    (_swap_two_tokens, "vocabularies differ in 2 tokens", "tokenizer_source: base\n"),
    (_set_eos, "eos_token is", "tokenizer:\n  source: base\n"),
    (_set_template, "chat templates", "chat_template: auto\n"),
])
def test_differing_tokenizers_are_refused_unless_a_policy_is_given(tmp_path, models, monkeypatch, edit, message,
                                                                   policy):
    base, fts = models
    other = _variant(fts[1], tmp_path / "other", edit)
    from mlxkit.engines.io.lazy_loader import LazyTensorLoader

    reads = []
    original = LazyTensorLoader.get_tensor
    monkeypatch.setattr(LazyTensorLoader, "get_tensor", lambda self, name: reads.append(name) or original(self, name))
    res = _merge(tmp_path, base, [fts[0], other])
    assert res.exit_code != 0 and reads == []
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], res.output
    assert str(other) in lines[0]
    res = _merge(tmp_path, base, [fts[0], other], policy)
    assert res.exit_code == 0, res.output
