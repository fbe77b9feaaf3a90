"""Tokenizer policies (base, union, a tokenizer directory) for inputs whose vocabularies differ.

The embedding and LM-head rows are aligned by token string; every expected row is computed here
from the inputs' own tensors and vocabularies (read with transformers, not with mlxkit), so the
tests pin the row rule: own row, else the only holder's row, else the base's, else the input's
mean row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import make_char_tokenizer, make_tiny_llama, recording_reporter
from mlxkit.cli.main import app
from mlxkit.engines.merge.config import validate_config
from mlxkit.engines.merge.run import run_merge
from test_merge_common import state

runner = CliRunner()
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
ROWS = 128  # the tiny Llama's embedding rows: more than any tokenizer here lists (padded vocabularies)


def _model(path: Path, seed: int, ids: int = ROWS, added: tuple[str, ...] = ()) -> Path:
    """A tiny Llama with the byte-level tokenizer cut to `ids` ids (97: without '|', '}' and '~'), then `added`."""
    make_tiny_llama(seed=seed).save_pretrained(path)
    tokenizer = make_char_tokenizer(ids)
    if added:
        tokenizer.add_tokens(list(added))
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vocab")
    return {"a": _model(root / "a", 0, 97, ("<a>",)),           # 98 tokens: no '|', '}', '~'; '<a>' at 97
            "b": _model(root / "b", 1, ROWS, ("<b>", "<a>")),  # 102 tokens: '<b>' at 100, '<a>' at 101
            "c": _model(root / "c", 2),                        # 100 tokens
            "d": _model(root / "d", 3, 97),                    # 97 tokens
            "base": _model(root / "base", 4)}                  # 100 tokens


def _vocab(path: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(path).get_vocab())


def _merge(tmp_path: Path, models: list[Path], weights: list[float], **extra):
    reporter = recording_reporter()
    cfg = validate_config({"models": [{"model": str(m), "parameters": {"weight": w}} for m, w in zip(models, weights)],
                           **extra})
    out = tmp_path / "out"
    run_merge(cfg, out, device="cpu", reporter=reporter)
    return out, reporter.lines


def _mean_row(path: Path, name: str) -> torch.Tensor:
    """The mean of the rows an input's own tokens index (its padding rows left out)."""
    return state(path)[name][sorted(_vocab(path).values())].mean(0)


def _union_of(first: Path, *others: Path) -> dict[str, int]:
    union = dict(_vocab(first))
    for other in others:
        for token, _ in sorted(_vocab(other).items(), key=lambda item: item[1]):
            union.setdefault(token, len(union))
    return union


def test_union_keeps_each_row_by_token(tmp_path, models, monkeypatch):
    from mlxkit.engines.io.lazy_loader import LazyTensorLoader

    reads: list[tuple[str, str]] = []
    original = LazyTensorLoader.get_tensor
    monkeypatch.setattr(LazyTensorLoader, "get_tensor",
                        lambda self, name: reads.append((str(self.index.directory), name)) or original(self, name))
    a, b = models["a"], models["b"]
    out, notices = _merge(tmp_path, [a, b], [0.3, 0.7], merge_method="linear", tokenizer_source="union")
    # streamed: each stored tensor is read once, the rows of another model's embedding included
    assert len(reads) == len(set(reads))
    union = _union_of(a, b)
    assert [t for t, i in sorted(union.items(), key=lambda x: x[1])][98:] == ["|", "}", "~", "<b>"]
    va, vb = _vocab(a), _vocab(b)
    merged, sa, sb = state(out), state(a), state(b)
    for name in (EMBED, HEAD):
        assert merged[name].shape == (len(union), 32)
        for token, row in union.items():
            if token in va:  # '<a>' is at 97 in a and at 101 in b
                expected = 0.3 * sa[name][va[token]] + 0.7 * sb[name][vb[token]]
            else:  # only b has it: b's row, exactly
                expected = sb[name][vb[token]]
            torch.testing.assert_close(merged[name][row], expected, atol=1e-6, rtol=1e-5, msg=f"{name} {token!r}")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == len(union)
    record = json.loads((out / "mlxkit.json").read_text())["results"]["tokenizer"]
    assert record["policy"] == "union" and record["tokens"] == record["rows"] == len(union)
    assert record["missing_rows"] == {str(a): {"only_holder": 4, "base": 0, "mean": 0}}
    assert any(f"'{a}' lacks 4" in line and "4 take the row of the only model" in line for line in notices)


def test_union_tokenizer_round_trips(tmp_path, models):
    from transformers import AutoTokenizer

    a, b = models["a"], models["b"]
    out, _ = _merge(tmp_path, [a, b], [1.0, 1.0], merge_method="linear", tokenizer_source="union")
    union = _union_of(a, b)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in union} == union
    for text in ("a|b<b>c", "x~y}z<a>", "<b><a>|"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    ids = tokenizer.encode("a|b<b>", add_special_tokens=False)
    assert union["|"] in ids and union["<b>"] in ids


def test_mean_row_when_neither_the_only_holder_nor_a_base_has_it(tmp_path, models):
    a, b, c = models["a"], models["b"], models["c"]
    w = [1.0, 2.0, 3.0]
    out, notices = _merge(tmp_path, [a, b, c], w, merge_method="linear", tokenizer_source="union")
    union, merged = _union_of(a, b, c), state(out)
    vocabs = [_vocab(m) for m in (a, b, c)]
    for name in (EMBED, HEAD):
        rows = [state(m)[name] for m in (a, b, c)]
        means = [_mean_row(m, name) for m in (a, b, c)]
        for token in ("|", "}", "~", "<a>"):  # '|': b and c have it, a not; '<a>': a and b, c not
            expected = sum(wi * (r[v[token]] if token in v else mean) for wi, r, v, mean in zip(w, rows, vocabs, means))
            torch.testing.assert_close(merged[name][union[token]], expected / sum(w), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(merged[name][union["<b>"]], rows[1][vocabs[1]["<b>"]], atol=1e-6, rtol=1e-5)
    assert any(f"'{a}' lacks 4" in line and "1 take the row" in line and "3 its mean row" in line for line in notices)


def test_base_policy_takes_the_base_row(tmp_path, models):
    """`base` with differing vocabularies: the base's 100 tokens; a token one input lacks takes the base's row."""
    a, b, base = models["a"], models["b"], models["base"]
    out, _ = _merge(tmp_path, [a, b], [0.5, 0.8], merge_method="task_arithmetic", base_model=str(base),
                    tokenizer_source="base")
    vb, va, vbase = _vocab(b), _vocab(a), _vocab(base)
    merged, sa, sb, s0 = state(out), state(a), state(b), state(base)
    for name in (EMBED, HEAD):
        assert merged[name].shape == (len(vbase), 32)  # the base's padding rows are not carried over (mergekit)
        for token, row in vbase.items():
            delta_a = sa[name][va[token]] - s0[name][row] if token in va else 0.0  # a lacks '|': base row, delta 0
            delta_b = sb[name][vb[token]] - s0[name][row]
            torch.testing.assert_close(merged[name][row], s0[name][row] + 0.5 * delta_a + 0.8 * delta_b,
                                       atol=1e-6, rtol=1e-5, msg=f"{name} {token!r}")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == len(vbase)
    assert (out / "tokenizer.json").read_text() == (base / "tokenizer.json").read_text()


def test_token_missing_from_every_model_but_the_base(tmp_path, models):
    a, d, base = models["a"], models["d"], models["base"]
    out, notices = _merge(tmp_path, [a, d], [1.0, 1.0], merge_method="task_arithmetic", base_model=str(base),
                          tokenizer={"source": "base"})
    vbase, merged, s0 = _vocab(base), state(out), state(base)
    for name in (EMBED, HEAD):
        for token in ("|", "}", "~"):
            torch.testing.assert_close(merged[name][vbase[token]], s0[name][vbase[token]], atol=1e-6, rtol=1e-5)
    record = json.loads((out / "mlxkit.json").read_text())["results"]["tokenizer"]
    assert record["missing_rows"][str(a)]["base"] == record["missing_rows"][str(d)]["base"] == 3


def test_tokenizer_directory_with_padding(tmp_path, models):
    """A tokenizer directory's vocabulary, rounded up to 64 rows: a token no model has and the padding
    rows take each model's mean row."""
    a, b = models["a"], models["b"]
    directory = tmp_path / "tok"
    tokenizer = make_char_tokenizer(ROWS)
    tokenizer.add_tokens(["<new>"])
    tokenizer.save_pretrained(directory)
    w = [1.0, 3.0]
    out, notices = _merge(tmp_path, [a, b], w, merge_method="linear",
                          tokenizer={"source": str(directory), "pad_to_multiple_of": 64})
    vocab, merged = _vocab(directory), state(out)
    assert len(vocab) == 101 and json.loads((out / "config.json").read_text())["vocab_size"] == 128
    for name in (EMBED, HEAD):
        assert merged[name].shape == (128, 32)
        mean = (w[0] * _mean_row(a, name) + w[1] * _mean_row(b, name)) / sum(w)
        for row in [vocab["<new>"], *range(101, 128)]:
            torch.testing.assert_close(merged[name][row], mean, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(merged[name][vocab["|"]], state(b)[name][_vocab(b)["|"]], atol=1e-6, rtol=1e-5)
    assert (out / "tokenizer.json").read_text() == (directory / "tokenizer.json").read_text()
    assert any("27 padding rows" in line for line in notices)


def test_differing_vocabularies_without_a_policy_are_one_error_line(tmp_path, models):
    out = tmp_path / "out"
    res = runner.invoke(app, ["merge", "--method", "linear", str(models["a"]), str(models["b"]), "-o", str(out),
                              "--device", "cpu", "-q"])
    assert res.exit_code == 2
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert f"4 tokens only in '{models['b']}' ('|', '}}', '~', ...)" in lines[0]
    assert "at other ids (e.g. '<a>' is id 97" in lines[0] and "union" in lines[0]
    assert not out.exists()
    res = runner.invoke(app, ["merge", "--method", "linear", str(models["a"]), str(models["b"]), "-o", str(out),
                              "--device", "cpu", "-q", "--tokenizer", "union"])
    assert res.exit_code == 0, res.output
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 102
