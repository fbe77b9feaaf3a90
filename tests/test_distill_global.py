"""Global distillation (GKD) and plain KD: the losses, resume, accumulation, data parallelism, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import REPO, make_char_tokenizer, make_tiny_llama, save_with_tokenizer
from mlxkit.cli.main import app
from mlxkit.engines.distill.losses import cosine_distance_sum, logit_term_sums
from mlxkit.engines.distill.recipe import load_distill_recipe
from mlxkit.engines.distill.trainer import DistillationOptions, DistillationRun, run_distillation
from mlxkit.engines.training.schedule import batch_indices
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError, RecipeError

runner = CliRunner()
TINY = {"data.seq_len": 32, "data.held_out_sequences": 2, "optim.batch_sequences": 4,
        "optim.micro_batch_sequences": 2, "optim.lr": 1e-2, "optim.warmup_fraction": 0.0,
        "schedule.eval_every": 3, "schedule.checkpoint_every": 2}
STEPS = 6




def _options(pair, text_file, out, mode="gkd", **overrides):
    recipe = load_distill_recipe(mode).with_overrides({**TINY, **overrides.pop("recipe", {})})
    return DistillationOptions(mode=mode, teacher=str(pair[0]), student=str(pair[1]), out=out, recipe=recipe,
                               data=text_file, tokens=STEPS * 4 * 32, **overrides)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


# ----------------------------------------------------------------------------- losses against direct formulas

def _two_heads_and_states(seed: int, batch: int, seq: int, hidden: int, vocab: int):
    """Random student and teacher heads, final hidden states (the student's requiring grad) and token ids."""
    torch.manual_seed(seed)
    head_s, head_t = torch.nn.Linear(hidden, vocab, bias=False), torch.nn.Linear(hidden, vocab, bias=False)
    h_s = torch.randn(batch, seq, hidden, requires_grad=True)
    h_t = torch.randn(batch, seq, hidden)
    return head_s, head_t, h_s, h_t, torch.randint(0, vocab, (batch, seq))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_chunked_logit_terms_match_a_direct_computation_in_value_and_gradient(temperature):
    batch, seq, hidden, vocab = 2, 7, 8, 11
    head_s, head_t, h_s, h_t, ids = _two_heads_and_states(0, batch, seq, hidden, vocab)

    sums = logit_term_sums(h_s, h_t, ids, head_s, head_t, temperature=temperature, with_kl=True, with_nll=True,
                           chunk=3)
    (sums.kl + sums.nll).backward()
    grad_chunked, head_grad_chunked = h_s.grad.clone(), head_s.weight.grad.clone()
    h_s.grad, head_s.weight.grad = None, None

    # direct: every position but the last, full logits at once
    s_logits, t_logits = head_s(h_s)[:, :-1], head_t(h_t)[:, :-1]
    p = F.softmax(t_logits / temperature, -1)
    kl = (p * (p.log() - F.log_softmax(s_logits / temperature, -1))).sum() * temperature ** 2
    nll = F.cross_entropy(s_logits.reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="sum")
    (kl + nll).backward()
    assert sums.kl.item() == pytest.approx(kl.item(), rel=1e-5)
    assert sums.nll.item() == pytest.approx(nll.item(), rel=1e-5)
    torch.testing.assert_close(grad_chunked, h_s.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head_grad_chunked, head_s.weight.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kl_term_equals_the_metric_bit_for_bit_and_its_gradient_autograds(temperature):
    from mlxkit.engines.eval.metrics import kl_from_log_probs

    batch, seq, hidden, vocab = 2, 9, 8, 13
    head_s, head_t, h_s, h_t, ids = _two_heads_and_states(1, batch, seq, hidden, vocab)
    sums = logit_term_sums(h_s, h_t, ids, head_s, head_t, temperature=temperature, chunk=batch * (seq - 1))
    sums.kl.backward()

    # autograd through the metric itself, on the same one chunk of positions
    s = h_s.detach()[:, :-1].reshape(-1, hidden).requires_grad_(True)
    with torch.no_grad():
        t_logp = F.log_softmax(head_t(h_t[:, :-1].reshape(-1, hidden)) / temperature, -1)
    reference = kl_from_log_probs(t_logp, F.log_softmax(head_s(s) / temperature, -1)).sum() * temperature ** 2
    reference.backward()
    assert sums.kl.item() == reference.item()  # the same operations in the same order
    torch.testing.assert_close(h_s.grad[:, :-1].reshape(-1, hidden), s.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(h_s.grad[:, -1]) == 0  # the last position predicts nothing


def test_logit_chunks_hold_the_same_bytes_whatever_the_vocabulary():
    from mlxkit.engines.distill.losses import CHUNK_BYTES, MIN_CHUNK, logit_chunk

    assert logit_chunk(49152) == 256
    for vocab in (32000, 128256, 151936):
        assert logit_chunk(vocab) * vocab * 4 <= CHUNK_BYTES < (logit_chunk(vocab) + 1) * vocab * 4
    assert logit_chunk(10**9) == MIN_CHUNK


def test_cosine_distance_sum_matches_numpy():
    rng = np.random.default_rng(3)
    a = [rng.normal(size=(2, 5, 4)) for _ in range(3)]
    b = [rng.normal(size=(2, 5, 4)) for _ in range(3)]
    expected = sum((1 - (x * y).sum(-1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(y, axis=-1)).sum()
                   for x, y in zip(a, b))
    got = cosine_distance_sum([torch.tensor(x) for x in a], [torch.tensor(y) for y in b])
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_batch_indices_cover_each_pass_once_and_depend_on_the_seed():
    first_pass = [i for step in range(5) for i in batch_indices(step, 4, 20, seed=7)]
    assert sorted(first_pass) == list(range(20))
    assert first_pass != [i for step in range(5) for i in batch_indices(step, 4, 20, seed=8)]


# ----------------------------------------------------------------------------- the training job

def test_gkd_lowers_held_out_kl_and_writes_a_loadable_child_with_its_log(pair, text_file, tmp_path):
    out = tmp_path / "out"
    summary = run_distillation(_options(pair, text_file, out))
    assert summary["after"]["kl_div"] < 0.8 * summary["before"]["kl_div"]
    log = [json.loads(line) for line in (out / "distill_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(STEPS + 1))
    assert all("eval" in r for r in log if r["step"] in (0, 3, 6))
    manifest = json.loads((out / "mlxkit.json").read_text())
    assert manifest["results"]["steps"] == STEPS and manifest["inputs"]["teacher"]["hash"].startswith("sha256:")
    assert not DistillationRun.work_dir_for(out).exists()

    # independent check: the saved child, loaded by transformers, against the teacher on the held-out text
    from transformers import AutoModelForCausalLM

    from mlxkit.engines.data.text import pack, read_texts, split, tokenize
    from mlxkit.engines.eval.language_model import evaluate

    child = AutoModelForCausalLM.from_pretrained(out).eval()
    teacher = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    ids = tokenize(make_char_tokenizer(), read_texts(text_file), 1 << 24)  # data.corpus_tokens: the whole text
    _, val = split(pack(ids, 32), 2 / (ids.numel() // 32), 0)
    assert evaluate(child, val, reference=teacher).kl_div == pytest.approx(summary["after"]["kl_div"], rel=1e-4)


def test_resumed_run_equals_an_uninterrupted_one(pair, text_file, tmp_path):
    straight = tmp_path / "straight"
    run_distillation(_options(pair, text_file, straight))
    resumed = tmp_path / "resumed"
    assert run_distillation(_options(pair, text_file, resumed, stop_after_steps=3)) == {}
    assert (DistillationRun.work_dir_for(resumed) / "checkpoint").exists() and not resumed.exists()
    run_distillation(_options(pair, text_file, resumed))
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def losses(path):
        return [(r["step"], r.get("loss"), r.get("eval")) for r in map(json.loads, (path / "distill_log.jsonl")
                                                                       .read_text().splitlines())]
    assert losses(straight) == losses(resumed)


def test_gradient_accumulation_is_normalised_over_the_global_batch(pair, text_file, tmp_path):
    one = run_distillation(_options(pair, text_file, tmp_path / "one", recipe={"optim.micro_batch_sequences": 4}))
    four = run_distillation(_options(pair, text_file, tmp_path / "four", recipe={"optim.micro_batch_sequences": 1}))
    assert four["final_loss"] == pytest.approx(one["final_loss"], rel=1e-4)
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "four")
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_gradient_checkpointing_trains_the_same_student_as_keeping_the_activations(pair, text_file, tmp_path):
    kept = run_distillation(_options(pair, text_file, tmp_path / "kept",
                                     recipe={"gradient_checkpointing": False}))
    recomputed = run_distillation(_options(pair, text_file, tmp_path / "recomputed",
                                           recipe={"gradient_checkpointing": True}))
    assert recomputed["final_loss"] == kept["final_loss"]
    a, b = _weights(tmp_path / "kept"), _weights(tmp_path / "recomputed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_with_other_settings_discards_the_unfinished_one_with_a_notice(pair, text_file, tmp_path):
    straight = tmp_path / "straight"
    run_distillation(_options(pair, text_file, straight, recipe={"optim.lr": 1e-3}))
    out = tmp_path / "out"
    run_distillation(_options(pair, text_file, out, stop_after_steps=2))
    notices = []
    reporter = Reporter()
    reporter.notice = notices.append
    run_distillation(_options(pair, text_file, out, recipe={"optim.lr": 1e-3}), reporter)
    assert any(n.startswith("discarded an unfinished distillation run") and "recipe" in n for n in notices), notices
    # Nothing of the discarded run survives: the result is a fresh run's, bit for bit.
    a, b = _weights(straight), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
def test_two_processes_match_one_with_the_same_global_batch(pair, text_file, tmp_path):
    single = tmp_path / "single"
    run_distillation(_options(pair, text_file, single))
    double = tmp_path / "double"
    env = {**os.environ, "MLXKIT_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
               "-m", "mlxkit", "distill", "--gkd", "--teacher", str(pair[0]), "--student", str(pair[1]),
               "--data", str(text_file), "--tokens", str(STEPS * 4 * 32), "--out", str(double), "--quiet",
               *[f"--set={k}={v}" for k, v in TINY.items()]]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = _weights(single), _weights(double)
    assert all(torch.allclose(a[k], b[k], atol=2e-5) for k in a)
    assert json.loads((double / "mlxkit.json").read_text())["results"]["world_size"] == 2


# ----------------------------------------------------------------------------- errors before any work

def test_kd_refuses_a_student_with_another_vocabulary(pair, text_file, tmp_path):
    other = save_with_tokenizer(make_tiny_llama(seed=2, vocab_size=100), tmp_path / "other")
    with pytest.raises(InputError, match="different vocabularies"):
        run_distillation(_options((pair[0], other), text_file, tmp_path / "out", mode="kd"))
    assert not DistillationRun.work_dir_for(tmp_path / "out").exists()


def test_gkd_names_a_width_mismatch_as_such(pair, text_file, tmp_path):
    wide = save_with_tokenizer(make_tiny_llama(seed=2, hidden_size=48), tmp_path / "wide")
    with pytest.raises(InputError, match="hidden size"):
        run_distillation(_options((pair[0], wide), text_file, tmp_path / "out"))


def test_kd_trains_a_narrower_student(pair, text_file, tmp_path):
    narrow = save_with_tokenizer(make_tiny_llama(seed=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                   num_hidden_layers=1), tmp_path / "narrow")
    summary = run_distillation(_options((pair[0], narrow), text_file, tmp_path / "out", mode="kd"))
    assert summary["after"]["kl_div"] < summary["before"]["kl_div"]


def test_unknown_recipe_keys_are_refused():
    with pytest.raises(RecipeError, match="optim.learning_rate"):
        load_distill_recipe("gkd").with_overrides({"optim.learning_rate": 1.0})
    with pytest.raises(RecipeError, match="optim.lr"):
        load_distill_recipe("gkd").with_overrides({"optim.lr": -1})


def test_cli_gkd_end_to_end_and_clean_errors(pair, text_file, tmp_path):
    out = tmp_path / "cli-out"
    args = ["distill", "--gkd", "--teacher", str(pair[0]), "--student", str(pair[1]), "--data", str(text_file),
            "--tokens", str(2 * 4 * 32), "--out", str(out), "--json", *[f"--set={k}={v}" for k, v in TINY.items()]]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["steps"] == 2 and Path(payload["out"]) == out.resolve()
    again = runner.invoke(app, args)
    assert again.exit_code != 0 and "already exists" in again.output and "Traceback" not in again.output
    bad = runner.invoke(app, args[:-len(TINY)] + ["--set", "optim.nope=1"])
    assert bad.exit_code != 0 and "optim.nope" in bad.output
    assert not DistillationRun.work_dir_for(tmp_path / "cli-out").exists()


def test_data_is_read_from_token_shards_and_a_repeat_is_announced(pair, text_file, tmp_path):
    from conftest import recording_reporter
    from mlxkit.engines.data.text import pack, read_texts, split, tokenize
    from mlxkit.engines.distill.trainer import DistillationRun

    notes = recording_reporter()
    from dataclasses import replace

    run = DistillationRun(replace(_options(pair, text_file, tmp_path / "out"), tokens=400 * 4 * 32), notes)
    try:
        run.setup()
        # The blocks equal the in-memory tokeniser's, split the same way.
        ids = tokenize(run.tokenizer, read_texts(text_file), (run.steps * 4 + 2) * 32)
        train, val = split(pack(ids, 32), 2 / pack(ids, 32).shape[0], 0)
        assert torch.equal(run.val_ids, val)
        assert torch.equal(run.train_ids[list(range(train.shape[0]))], train)
        assert (DistillationRun.work_dir_for(tmp_path / "out") / "tokens.json").exists()
        # 400 steps of 4 sequences need 1,600 of the corpus's few hundred sequences: the repeat is said once.
        repeats = [line for line in notes.lines if "repeat" in line]
        assert len(repeats) == 1 and f"{train.shape[0] * 32:,} training tokens repeat" in repeats[0]
    finally:
        run.cleanup()


# ----------------------------------------------------------------------------- training only the replaced blocks

def _child_with_layer_two_replaced(tmp_path) -> tuple[Path, Path]:
    """A 4-layer tiny teacher, and a child of it whose layer 2 alone has another attention (1 KV head)."""
    from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant
    from mlxkit.engines.models.decilm.convert import child_config, from_parent
    from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM

    teacher = make_tiny_llama(seed=0, num_hidden_layers=4)
    kept = BlockChoice(AttentionVariant("gqa", 2), FFNVariant("mlp", 64))
    choices = [kept, kept, BlockChoice(AttentionVariant("gqa", 1), FFNVariant("mlp", 64)), kept]
    torch.manual_seed(1)
    child = MlxDeciLMForCausalLM(child_config(from_parent(teacher).config, choices))
    return (save_with_tokenizer(teacher, tmp_path / "teacher"), save_with_tokenizer(child, tmp_path / "child"))


@pytest.mark.parametrize("neighbours, trained", [(0, {2}), (1, {1, 2, 3})])
def test_replaced_blocks_and_their_neighbours_train_and_nothing_else_moves(text_file, tmp_path, neighbours, trained):
    pair = _child_with_layer_two_replaced(tmp_path)
    out = tmp_path / "out"
    run_distillation(_options(pair, text_file, out, recipe={"trainable": "replaced_blocks",
                                                            "neighbours": neighbours}))
    before, after = _weights(pair[1]), _weights(out)
    assert before.keys() == after.keys()
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    layers_moved = {int(name.split(".")[2]) for name in moved if name.startswith("model.layers.")}
    assert layers_moved == trained
    assert all(name.startswith("model.layers.") for name in moved)  # embeddings, final norm, head frozen


def test_replaced_blocks_needs_a_puzzle_child(pair, text_file, tmp_path):
    with pytest.raises(InputError, match="needs a Puzzle child"):
        run_distillation(_options(pair, text_file, tmp_path / "out", recipe={"trainable": "replaced_blocks"}))


# ----------------------------------------------------------------------------- top-k KL with one bucket for the tail

def test_top_k_kl_equals_the_kl_of_the_merged_distributions_and_bounds_the_full_kl():
    from mlxkit.engines.distill.losses import top_k_kl

    rng = np.random.default_rng(0)
    n, vocab, k = 6, 50, 7
    t_logits, s_logits = rng.normal(size=(n, vocab)) * 2, rng.normal(size=(n, vocab)) * 2
    p = np.exp(t_logits) / np.exp(t_logits).sum(-1, keepdims=True)
    q = np.exp(s_logits) / np.exp(s_logits).sum(-1, keepdims=True)
    index = np.argsort(-p, -1)[:, :k]
    expected = []
    for row in range(n):
        rest = np.setdiff1d(np.arange(vocab), index[row])
        merged_p = np.append(p[row, index[row]], p[row, rest].sum())
        merged_q = np.append(q[row, index[row]], q[row, rest].sum())
        expected.append((merged_p * np.log(merged_p / merged_q)).sum())
    full = (p * np.log(p / q)).sum(-1)
    got = top_k_kl(torch.tensor(np.log(p[np.arange(n)[:, None], index])), torch.tensor(index),
                   F.log_softmax(torch.tensor(s_logits), -1)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert (got <= full + 1e-9).all() and (got < full).any()
    # with every token kept there is no bucket, and it is the full KL
    all_index = np.argsort(-p, -1)
    whole = top_k_kl(torch.tensor(np.log(p[np.arange(n)[:, None], all_index])), torch.tensor(all_index),
                     F.log_softmax(torch.tensor(s_logits), -1)).numpy()
    np.testing.assert_allclose(whole, full, rtol=1e-5)


# ----------------------------------------------------------------------------- the teacher's cached top-k outputs

KL_ONLY = {"loss.cosine_weight": 0.0}


def test_teacher_cache_with_every_token_kept_trains_as_the_full_kl_does(pair, text_file, tmp_path, isolated_cache):
    full = run_distillation(_options(pair, text_file, tmp_path / "full", recipe=KL_ONLY))
    cached = run_distillation(_options(pair, text_file, tmp_path / "cached",
                                       recipe={**KL_ONLY, "loss.teacher_top_k": 128}))  # the tiny vocabulary
    assert cached["teacher_cache"]["misses"] > 0
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "cached")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)
    assert cached["after"]["kl_div"] == pytest.approx(full["after"]["kl_div"], rel=1e-4)


def test_teacher_cache_is_reused_by_another_student_without_running_the_teacher(pair, text_file, tmp_path,
                                                                                 isolated_cache, monkeypatch):
    from mlxkit.engines.distill.teacher_cache import TeacherLogitCache

    recipe = {**KL_ONLY, "loss.teacher_top_k": 8}
    first = run_distillation(_options(pair, text_file, tmp_path / "first", recipe=recipe))
    assert first["teacher_cache"]["misses"] > 0
    entries = sorted(Path(first["teacher_cache"]["path"]).glob("*.safetensors"))
    assert len(entries) == first["teacher_cache"]["misses"]
    monkeypatch.setattr(TeacherLogitCache, "_compute", lambda *a: pytest.fail("the teacher ran on a cached sequence"))
    second = run_distillation(_options(pair, text_file, tmp_path / "second", recipe=recipe))
    assert second["teacher_cache"]["misses"] == 0 and second["teacher_cache"]["hits"] > 0


def test_teacher_cache_entries_are_the_teachers_top_k_at_the_temperature(pair, tmp_path):
    from transformers import AutoModelForCausalLM

    from mlxkit.engines.distill.teacher_cache import TeacherLogitCache

    teacher = AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    ids = torch.randint(3, 128, (3, 20), generator=torch.Generator().manual_seed(2))
    cache = TeacherLogitCache({"spec": "tiny"}, top_k=5, temperature=2.0, compute_dtype="float32", root=tmp_path)
    logp, index = cache.top_k_for(teacher, ids)
    with torch.no_grad():
        expected = F.log_softmax(teacher(ids).logits[:, :-1].float() / 2.0, -1).topk(5, -1)
    torch.testing.assert_close(logp, expected.values, rtol=1e-5, atol=1e-6)
    assert torch.equal(index, expected.indices)
    again = TeacherLogitCache({"spec": "tiny"}, top_k=5, temperature=2.0, compute_dtype="float32", root=tmp_path)
    logp2, index2 = again.top_k_for(teacher, ids[[2, 0]])
    assert again.hits == 2 and again.misses == 0
    assert torch.equal(logp2, logp[[2, 0]]) and torch.equal(index2, index[[2, 0]])
    other = TeacherLogitCache({"spec": "tiny"}, top_k=5, temperature=1.0, compute_dtype="float32", root=tmp_path)
    assert other.path != cache.path


def test_teacher_cache_refuses_the_cosine_term():
    with pytest.raises(RecipeError, match="teacher_top_k"):
        load_distill_recipe("gkd").with_overrides({"loss.teacher_top_k": 16, "loss.cosine_weight": 1.0})


@pytest.mark.parametrize("corpus_tokens", [None, 0])
def test_a_small_budget_draws_its_blocks_from_the_whole_corpus(pair, text_file, tmp_path, corpus_tokens):
    from mlxkit.engines.data.text import pack, read_texts, tokenize
    from mlxkit.engines.distill.trainer import DistillationRun

    recipe = {} if corpus_tokens is None else {"data.corpus_tokens": corpus_tokens}
    run = DistillationRun(_options(pair, text_file, tmp_path / "out", recipe=recipe))  # 6 steps of 4 x 32 tokens
    try:
        run.setup()
        whole = pack(tokenize(run.tokenizer, read_texts(text_file), 1 << 24), 32).shape[0]
        assert whole > 2 * (STEPS * 4 + 2)
        expected = whole if corpus_tokens is None else STEPS * 4 + 2
        assert run.train_ids.shape[0] + run.val_ids.shape[0] == expected
    finally:
        run.cleanup()
