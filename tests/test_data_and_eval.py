"""Text in, and `mlx eval` against an independent transformers computation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from conftest import recording_reporter, make_char_tokenizer
from mlxkit.cli.main import app
from mlxkit.engines.data.text import load_blocks, pack, read_texts, split, tokenize
from mlxkit.engines.errors import InputError
from mlxkit.engines.eval.language_model import evaluate
from mlxkit.engines.models.loading import load_model

runner = CliRunner()


def test_read_txt_jsonl_and_directory(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "1.txt").write_text("one")
    (tmp_path / "d" / "2.txt").write_text("two")
    (tmp_path / "r.jsonl").write_text('{"body": "x y"}\n\n{"body": "z"}\n')
    assert read_texts(tmp_path / "a.txt") == ["alpha"]
    assert read_texts(tmp_path / "d") == ["one", "two"]
    assert read_texts(tmp_path / "r.jsonl", text_field="body") == ["x y", "z"]
    with pytest.raises(InputError, match="no field 'text'"):
        read_texts(tmp_path / "r.jsonl")
    with pytest.raises(InputError, match="does not exist"):
        read_texts(tmp_path / "missing.txt")
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    with pytest.raises(InputError, match="bad.jsonl:1"):
        read_texts(tmp_path / "bad.jsonl")


def test_tokenize_pack_split_are_deterministic(text_file):
    tokenizer = make_char_tokenizer()
    ids = tokenize(tokenizer, read_texts(text_file), max_tokens=1000)
    assert ids.numel() == 1000
    assert tokenizer.decode(ids[:50]) == read_texts(text_file)[0][:50]
    blocks = pack(ids, 64)
    assert blocks.shape == (15, 64)
    train_a, val_a = split(blocks, 0.2, seed=3)
    train_b, val_b = split(blocks, 0.2, seed=3)
    assert torch.equal(val_a, val_b) and torch.equal(train_a, train_b)
    assert val_a.shape[0] == 3 and train_a.shape[0] == 12
    _, val_c = split(blocks, 0.2, seed=4)
    assert not torch.equal(val_a, val_c)
    data = load_blocks(text_file, tokenizer, seq_len=64, max_tokens=1000, val_fraction=0.2, seed=3)
    assert torch.equal(data.val, val_a)


def test_eval_matches_transformers_loss(tiny_llama_dir, text_file):
    loaded = load_model(str(tiny_llama_dir))
    blocks = pack(tokenize(loaded.tokenizer, read_texts(text_file), max_tokens=512), 64)
    result = evaluate(loaded.model, blocks)
    with torch.no_grad():  # independent computation: transformers' own shifted cross-entropy
        losses = [loaded.model(input_ids=row[None], labels=row[None]).loss.item() for row in blocks]
    assert result.tokens == blocks.shape[0] * 63
    assert result.perplexity == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-5)


def test_eval_against_itself_has_zero_kl_and_full_agreement(tiny_llama_dir, text_file):
    loaded = load_model(str(tiny_llama_dir))
    blocks = pack(tokenize(loaded.tokenizer, read_texts(text_file), max_tokens=256), 64)
    result = evaluate(loaded.model, blocks, reference=loaded.model)
    assert result.kl_div == pytest.approx(0.0, abs=1e-6)
    assert result.top1_agreement == 1.0


def test_cli_eval_json_with_reference(tiny_llama_dir, text_file, tmp_path):
    other = tmp_path / "other"
    from conftest import make_tiny_llama

    make_tiny_llama(seed=1).save_pretrained(other)
    result = runner.invoke(app, ["eval", str(tiny_llama_dir), "--data", str(text_file), "--reference", str(other),
                                 "--max-tokens", "256", "--seq-len", "64", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert {"perplexity", "tokens", "tokens_per_s", "kl_div", "top1_agreement"} <= payload.keys()
    assert payload["tokens"] == 4 * 63 and payload["kl_div"] > 0


def test_cli_eval_bad_inputs_fail_cleanly(tiny_llama_dir, tmp_path):
    missing = runner.invoke(app, ["eval", str(tiny_llama_dir), "--data", str(tmp_path / "nope.txt")])
    assert missing.exit_code != 0 and "does not exist" in missing.output and "Traceback" not in missing.output
    bad_model = runner.invoke(app, ["eval", str(tmp_path / "no-model"), "--data", str(tmp_path)])
    assert bad_model.exit_code != 0 and "Traceback" not in bad_model.output
    short = tmp_path / "short.txt"
    short.write_text("hi")
    too_short = runner.invoke(app, ["eval", str(tiny_llama_dir), "--data", str(short), "--seq-len", "64",
                                    "--max-tokens", "64"])
    assert too_short.exit_code != 0 and "fewer than one sequence" in too_short.output


def test_cli_help_lists_verbs_and_version():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "eval" in result.output
    version = runner.invoke(app, ["--version"])
    assert version.exit_code == 0 and "mlxkit" in version.output


def test_cli_eval_without_data_samples_announces_and_caches(tiny_llama_dir, isolated_cache):
    args = ["eval", str(tiny_llama_dir), "--max-tokens", "128", "--seq-len", "32"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "no --data given: sampling 4 x 32 calibration tokens from the model (seed 0, temperature 1.0;" \
        in first.stderr
    assert "--data, gives a better child" in first.stderr
    cached = sorted((isolated_cache / "calibration").glob("*.pt"))
    assert len(cached) == 1 and not list((isolated_cache / "calibration").glob(".*"))  # no temporaries left
    tokens, stamp = torch.load(cached[0], weights_only=True), cached[0].stat().st_mtime_ns
    assert tokens.dtype == torch.long and tokens.numel() >= 4 * 32

    again = runner.invoke(app, [*args, "--json"])  # reads the cache: same tokens, same result
    assert again.exit_code == 0, again.output
    payload = json.loads(again.stdout)
    assert payload["data"] == "text sampled from the model itself" and payload["tokens"] == 4 * 31
    assert cached[0].stat().st_mtime_ns == stamp
    assert "sampled from the model (seed 0, temperature 1.0; cached at" in runner.invoke(app, args).stderr

    # seeded: sampling again from scratch gives the same tokens; another seed gives others
    cached[0].unlink()
    assert runner.invoke(app, [*args, "--json"]).exit_code == 0
    assert torch.equal(torch.load(cached[0], weights_only=True), tokens)
    other = runner.invoke(app, [*args, "--seed", "1", "--json"])
    assert other.exit_code == 0 and json.loads(other.stdout)["perplexity"] != payload["perplexity"]
    (seed1,) = set((isolated_cache / "calibration").glob("*.pt")) - {cached[0]}
    assert not torch.equal(torch.load(seed1, weights_only=True), tokens)


def test_sampled_rows_do_not_depend_on_what_was_asked_before(isolated_cache):
    """One pool serves every request: a small request then a large one gives the rows a large request alone
    gives, shorter and longer sequences are pieces and joins of the same rows, and a model's Puzzle
    conversion shares the pool."""
    from conftest import make_char_tokenizer, make_tiny_llama
    from mlxkit.engines.data.sampled import ROWS_PER_BATCH, sample_tokens
    from mlxkit.engines.models.decilm.convert import from_parent

    model, tokenizer = make_tiny_llama().eval(), make_char_tokenizer()
    small = sample_tokens(model, tokenizer, n_sequences=3, seq_len=64, seed=4)
    large = sample_tokens(model, tokenizer, n_sequences=4 * ROWS_PER_BATCH + 5, seq_len=64, seed=4)
    (pool,) = (isolated_cache / "calibration").glob("*.pt")
    assert torch.equal(large[:3], small)
    pool.unlink()
    alone = sample_tokens(model, tokenizer, n_sequences=4 * ROWS_PER_BATCH + 5, seq_len=64, seed=4)
    assert torch.equal(alone, large)
    halves = sample_tokens(model, tokenizer, n_sequences=6, seq_len=32, seed=4)
    assert torch.equal(halves, large[:3].reshape(6, 32))
    joined = sample_tokens(model, tokenizer, n_sequences=2, seq_len=512, seed=4)  # two 256-token rows each
    assert torch.equal(joined, large[:16].reshape(2, 512))
    reporter = recording_reporter()
    converted = sample_tokens(from_parent(model).eval(), tokenizer, n_sequences=6, seq_len=32, seed=4,
                              reporter=reporter)
    assert torch.equal(converted, halves) and "cached at" in reporter.lines[0]
    assert large[::4, 0].eq(tokenizer.bos_token_id).all()  # each 256-token row starts at BOS


def test_token_metrics_in_chunks_equal_the_whole_batch_at_once(monkeypatch):
    """Sequence by sequence and in position chunks (4 rows, so chunks cut sequences), the sums equal
    KL, NLL and top-1 agreement computed over the whole [B, T-1, V] tensors at once."""
    from mlxkit.engines.eval import metrics

    monkeypatch.setattr(metrics, "POSITION_CHUNK", 4)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 10, 17, generator=generator, dtype=torch.float64).float() * 3
    reference = torch.randn(3, 10, 17, generator=generator, dtype=torch.float64).float() * 3
    ids = torch.randint(0, 17, (3, 10), generator=generator)
    tracked = metrics.TokenMetrics()
    tracked.update(logits[:2], ids[:2], reference[:2])
    tracked.update(logits[2:], ids[2:], reference[2:])

    logp = torch.log_softmax(logits[:, :-1].double(), -1)
    ref_logp = torch.log_softmax(reference[:, :-1].double(), -1)
    kl = torch.nn.functional.kl_div(logp, ref_logp, log_target=True, reduction="none").sum(-1).mean().item()
    nll = torch.nn.functional.nll_loss(logp.reshape(-1, 17), ids[:, 1:].reshape(-1)).item()
    agree = (logits[:, :-1].argmax(-1) == reference[:, :-1].argmax(-1)).double().mean().item()
    assert tracked.positions == 27
    assert tracked.kl_div == pytest.approx(kl, rel=1e-5)
    assert tracked.nll == pytest.approx(nll, rel=1e-5)
    assert tracked.top1_agreement == pytest.approx(agree, abs=1e-12)
