"""`mlx finetune`: the H-Tuning estimator against autograd, exact restore, the blend, outputs, resume, errors."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import REPO, make_char_tokenizer, make_tiny_llama
from mlxkit.cli.main import app
from mlxkit.engines.training.distributed import Distributed
from mlxkit.engines.finetune.data import Batch, Examples
from mlxkit.engines.finetune.model import build_model, fo_layer_parameters, load_classification_head
from mlxkit.engines.finetune.recipe import load_finetune_recipe
from mlxkit.engines.finetune.steps import MixOrderSplit, first_order_step, mix_order_step
from mlxkit.engines.finetune.trainer import FinetuneOptions, FinetuneRun, run_finetune
from mlxkit.engines.finetune.zeroth_order import direction, mix_gradient, perturb_, spsa_losses

runner = CliRunner()
TINY = {"data.seq_len": 32, "data.held_out_sequences": 2, "optim.batch_sequences": 4,
        "optim.micro_batch_sequences": 2, "optim.lr": 1e-2, "optim.warmup_fraction": 0.0,
        "schedule.steps": 6, "schedule.eval_every": 3, "schedule.checkpoint_every": 2}
HT = {"htuning.fo_sequences": 2, "htuning.fo_layers": 1}


def _recipe(name: str, **overrides):
    extra = HT if name == "htuning" else {}
    return load_finetune_recipe(name).with_overrides({**TINY, **extra, **overrides})


def _options(model_dir, data, out, name="lora", recipe=None, **options):
    return FinetuneOptions(model=str(model_dir), data=data, out=out, recipe=_recipe(name, **(recipe or {})), **options)


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "adapter_model.safetensors")


IDS = torch.tensor([[1, 7, 30, 99, 4, 12, 64, 3, 3, 90, 17, 5]])


# ----------------------------------------------------------------------------- the estimator and the blend

def _peft_tiny(dtype=torch.float64, method="htuning"):
    """A tiny LoRA-wrapped Llama whose B matrices are non-zero (so every adapter tensor affects the loss)."""
    torch.manual_seed(0)
    lm = make_tiny_llama().to(dtype)
    model, _ = build_model(lm, load_finetune_recipe(method).with_overrides({"lora.r": 2}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return model


def _batch(n=3, seq=12, seed=0) -> Batch:
    ids = torch.randint(3, 128, (n, seq), generator=torch.Generator().manual_seed(seed))
    return Batch(ids, torch.full((n,), seq), None)


def test_spsa_estimate_matches_the_autograd_directional_derivative():
    model = _peft_tiny()
    params = [p for _, p in model.trainable()]
    batch = _batch()
    units = batch.ids.shape[0] * (batch.ids.shape[1] - 1)
    (model.loss_sum(batch) / units).backward()
    z = list(direction(params, seed=123))
    directional = sum((p.grad * zi).sum() for p, zi in zip(params, z)).item()

    def loss_at(sign):
        with torch.no_grad():
            return model.loss_sum(batch).item() / units

    def estimate(eps, seed=123):
        plus, minus = spsa_losses(params, loss_at, eps, seed)
        return (plus - minus) / (2 * eps)

    # ‖z‖ is about √(adapter size), so ε = 1e-4 is a step of about 5e-3 in parameter space
    assert estimate(1e-4) == pytest.approx(directional, rel=1e-3)
    # a central difference: 10x smaller ε, about 100x smaller error (until float32 logits get in the way)
    assert abs(estimate(1e-4) - directional) < abs(estimate(1e-3) - directional) / 30
    # and the direction really was z: another seed gives another estimate
    assert estimate(1e-4, seed=124) != pytest.approx(directional, rel=1e-2)


def test_perturb_and_restore_is_bit_exact_where_plain_arithmetic_is_not():
    model = _peft_tiny(torch.float32)
    params = [p for _, p in model.trainable()]
    before = [p.detach().clone() for p in params]
    spsa_losses(params, lambda sign: model.loss_sum(_batch()).item(), 1e-3, seed=7)
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    with pytest.raises(RuntimeError, match="boom"):  # restored even when a forward fails
        spsa_losses(params, lambda sign: (_ for _ in ()).throw(RuntimeError("boom")), 1e-3, seed=7)
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    # the restore is needed: θ + εz − 2εz + εz rounds away from θ in float32
    perturb_(params, 7, 1e-3)
    perturb_(params, 7, -2e-3)
    perturb_(params, 7, 1e-3)
    assert not all(torch.equal(a, p) for a, p in zip(before, params))


def test_mix_gradient_matches_a_direct_numpy_computation():
    rng = np.random.default_rng(0)
    for coef in (0.0, 0.85, 1.0):
        g_fo, g_zo = rng.normal(size=(5, 7)), rng.normal(size=(5, 7)) * 40
        expected = coef * g_fo + (1 - coef) * np.linalg.norm(g_fo) * g_zo / np.linalg.norm(g_zo)
        got = mix_gradient(torch.tensor(g_fo), torch.tensor(g_zo), coef).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)
    assert torch.equal(mix_gradient(torch.ones(3), torch.zeros(3), 0.85), torch.full((3,), 0.85))


def test_mix_order_step_equals_a_reference_built_from_autograd():
    """Every gradient of one H-Tuning step, rebuilt on a copy of the model with plain autograd."""
    model = _peft_tiny()
    spec = load_finetune_recipe("htuning").with_overrides({"htuning.fo_layers": 1}).htuning
    batch, seed = _batch(n=4), 99
    units = 4 * 11
    fo_ids = fo_layer_parameters(model, 1)
    named = model.trainable()
    split = MixOrderSplit(zo=[p for _, p in named if id(p) not in fo_ids], fo=[p for _, p in named if id(p) in fo_ids])
    assert split.zo and split.fo and all(".layers.1." in n for n, p in named if id(p) in fo_ids)

    reference = copy.deepcopy(model)
    ref = dict(reference.trainable())
    zo_names = [n for n, p in named if id(p) not in fo_ids]
    fo_names = [n for n, p in named if id(p) in fo_ids]
    slice_batch = Batch(batch.ids[:2], batch.lengths[:2], None)
    # FO on the slice at θ, for the ZO set
    (reference.loss_sum(slice_batch) / (2 * 11)).backward()
    g_fo = {n: ref[n].grad.clone() for n in zo_names}
    reference.zero_grad()
    z = dict(zip(zo_names, direction([ref[n] for n in zo_names], seed)))
    with torch.no_grad():
        for n in zo_names:
            ref[n].add_(spec.zo_eps * z[n])
        plus = reference.loss_sum(batch).item() / units
        for n in zo_names:
            ref[n].sub_(2 * spec.zo_eps * z[n])
    minus_loss = reference.loss_sum(batch) / units  # full batch at θ_ZO − εz: the FO set's exact gradient
    minus_loss.backward()
    g_head = {n: ref[n].grad.clone() for n in fo_names}
    projected = (plus - minus_loss.item()) / (2 * spec.zo_eps)

    pieces = [Batch(batch.ids[:2], batch.lengths[:2], None), Batch(batch.ids[2:], batch.lengths[2:], None)]
    terms = mix_order_step(model, split, pieces, [slice_batch], units, 2 * 11, spec, seed, Distributed())
    # the loss is float32 whatever the model's dtype (logits are cast to it): tolerances are float32's
    assert terms["projected_grad"] == pytest.approx(projected, rel=1e-4)
    got = dict(model.trainable())
    for n in fo_names:
        torch.testing.assert_close(got[n].grad, g_head[n], rtol=1e-5, atol=1e-9)
    for n in zo_names:
        g_zo = (projected * z[n]).numpy()
        fo = g_fo[n].numpy()
        norm_zo = np.linalg.norm(g_zo)
        expected = spec.mix_coef * fo + (1 - spec.mix_coef) * np.linalg.norm(fo) * g_zo / norm_zo
        np.testing.assert_allclose(got[n].grad.numpy(), expected, rtol=1e-5, atol=1e-9)


def test_zeroth_order_forwards_keep_no_activations():
    """With no first-order layers, a mix-order step saves only what backprop on its slice saves."""
    model = _peft_tiny(torch.float32)
    params = [p for _, p in model.trainable()]
    spec = load_finetune_recipe("htuning").with_overrides({"htuning.fo_layers": 0}).htuning
    batch = _batch(n=8, seq=64)
    pieces, slice_pieces = [batch], [Batch(batch.ids[:1], batch.lengths[:1], None)]

    def saved_bytes(fn) -> int:
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return total[0]

    mix = saved_bytes(lambda: mix_order_step(model, MixOrderSplit(params, []), pieces, slice_pieces, 8 * 63, 63,
                                             spec, 0, Distributed()))
    slice_only = saved_bytes(lambda: first_order_step(model, params, slice_pieces, 63, Distributed()))
    full_batch = saved_bytes(lambda: first_order_step(model, params, pieces, 8 * 63, Distributed()))
    # (the weights that every backward saves once keep full_batch under 8x slice_only)
    assert mix == slice_only and full_batch > 4 * slice_only, (mix, slice_only, full_batch)


# ----------------------------------------------------------------------------- runs and their outputs

def test_lora_lowers_held_out_loss_and_the_adapter_reloads_with_peft(tiny_llama_dir, text_file, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    run = FinetuneRun(_options(tiny_llama_dir, text_file, out, "lora", recipe={"schedule.steps": 10}))
    run.setup()
    summary = run.train()
    assert summary["after"]["loss"] < 0.9 * summary["before"]["loss"]
    with torch.no_grad():
        in_memory = run.model.lm(IDS).logits
    run.save(summary)
    run.cleanup()
    assert {"adapter_config.json", "adapter_model.safetensors", "mlxkit.json", "finetune_log.jsonl"} <= \
        {p.name for p in out.iterdir()}
    assert not FinetuneRun.work_dir_for(out).exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    reloaded = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, in_memory, rtol=0, atol=1e-6)
        assert not torch.allclose(AutoModelForCausalLM.from_pretrained(tiny_llama_dir)(IDS).logits, in_memory,
                                  atol=1e-3)  # the adapter changed the model
    # the held-out loss in the summary, recomputed independently from the reloaded adapter
    from mlxkit.engines.eval.language_model import evaluate

    assert evaluate(reloaded, run.val_data.ids).nll == pytest.approx(summary["after"]["loss"], rel=1e-5)
    log = [json.loads(line) for line in (out / "finetune_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(11)) and all("eval" in r for r in log if r["step"] in (0, 3, 10))


def test_merge_gives_the_adapters_logits(tiny_llama_dir, text_file, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    run = FinetuneRun(_options(tiny_llama_dir, text_file, out, "htuning", merge=True))
    run.setup()
    summary = run.train()
    with torch.no_grad():
        adapter_logits = run.model.lm(IDS).logits
    run.save(summary)
    run.cleanup()
    assert (out / "model.safetensors.index.json").exists() and not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, adapter_logits, rtol=0, atol=1e-5)
    assert json.loads((out / "mlxkit.json").read_text())["results"]["format"] == "merged"


@pytest.mark.parametrize("name", ["htuning", "full"])
def test_resumed_run_equals_an_uninterrupted_one(name, tiny_llama_dir, text_file, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_finetune(_options(tiny_llama_dir, text_file, straight, name))
    assert run_finetune(_options(tiny_llama_dir, text_file, resumed, name, stop_after_steps=3)) == {}
    assert (FinetuneRun.work_dir_for(resumed) / "checkpoint").exists() and not resumed.exists()
    run_finetune(_options(tiny_llama_dir, text_file, resumed, name))
    if name == "full":
        a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    else:
        a, b = _adapter(straight), _adapter(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def losses(path):
        return [(r["step"], r.get("loss"), r.get("eval")) for r in map(json.loads, (path / "finetune_log.jsonl")
                                                                       .read_text().splitlines())]
    assert losses(straight) == losses(resumed)


def test_a_run_with_other_settings_discards_the_unfinished_one_with_a_notice(tiny_llama_dir, text_file, tmp_path):
    from mlxkit.engines.core.progress import Reporter

    straight = tmp_path / "straight"
    run_finetune(_options(tiny_llama_dir, text_file, straight, "lora", recipe={"lora.r": 4}))
    out = tmp_path / "out"
    run_finetune(_options(tiny_llama_dir, text_file, out, "lora", stop_after_steps=2))
    notices = []
    reporter = Reporter()
    reporter.notice = notices.append
    run_finetune(_options(tiny_llama_dir, text_file, out, "lora", recipe={"lora.r": 4}), reporter)
    assert any(n.startswith("discarded an unfinished fine-tuning run") and "recipe" in n for n in notices), notices
    a, b = _adapter(straight), _adapter(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_on_a_puzzle_child(tmp_path, text_file):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mlxkit.engines.models.decilm.convert import from_parent

    child_dir = tmp_path / "child"
    from_parent(make_tiny_llama()).save_pretrained(child_dir)
    make_char_tokenizer().save_pretrained(child_dir)
    assert json.loads((child_dir / "config.json").read_text())["model_type"] == "mlx_decilm"
    out = tmp_path / "adapter"
    summary = run_finetune(_options(child_dir, text_file, out, "lora"))
    assert summary["after"]["loss"] < summary["before"]["loss"]
    base = AutoModelForCausalLM.from_pretrained(child_dir)
    assert type(base).__name__ == "MlxDeciLMForCausalLM"
    reloaded = PeftModel.from_pretrained(base, out).eval()
    assert sum("lora_B" in k for k in _adapter(out)) == 14  # 7 linear layers in each of 2 blocks
    from mlxkit.engines.eval.language_model import evaluate
    from mlxkit.engines.data.text import pack, read_texts, split, tokenize

    ids = tokenize(make_char_tokenizer(), read_texts(text_file), (6 * 4 + 2) * 32)
    _, val = split(pack(ids, 32), 2 / (ids.numel() // 32), 0)
    assert evaluate(reloaded, val).nll == pytest.approx(summary["after"]["loss"], rel=1e-5)


def _labelled(path: Path, n: int = 48) -> Path:
    """Two classes told apart by their words."""
    rows = [{"text": f"{'sunny warm bright day' if i % 2 else 'cold rain dark night'} number {i}",
             "label": "good" if i % 2 else "bad"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_classification_end_to_end_and_the_head_reloads(tiny_llama_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = _labelled(tmp_path / "labels.jsonl")
    out = tmp_path / "classifier"
    options = _options(tiny_llama_dir, data, out, "htuning", recipe={
        "objective": "classification", "data.held_out_sequences": 8, "schedule.steps": 12, "optim.lr": 2e-2})
    run = FinetuneRun(options)
    run.setup()
    summary = run.train()
    assert summary["after"]["loss"] < summary["before"]["loss"]
    assert summary["after"]["accuracy"] >= 0.75
    val = run.val_data.batch(list(range(len(run.val_data))))
    with torch.no_grad():
        in_memory = run.model.classify(run.model.hidden_states(val.ids), val.lengths)
    run.save(summary)
    run.cleanup()
    head, labels = load_classification_head(out)
    assert labels == ["bad", "good"]
    backbone = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), out).eval()
    with torch.no_grad():
        hidden = backbone.get_base_model().model(input_ids=val.ids).last_hidden_state
        logits = head(hidden[torch.arange(len(val.lengths)), val.lengths - 1])
    torch.testing.assert_close(logits, in_memory, rtol=0, atol=1e-5)

    # the same objective through the CLI, fine-tuning every weight: a whole checkpoint with the head beside it
    cli_out = tmp_path / "cli"
    result = runner.invoke(app, ["finetune", "--recipe", "full", "--model", str(tiny_llama_dir), "--data", str(data),
                                 "--objective", "classification", "--steps", "2", "--out", str(cli_out), "--json",
                                 *[f"--set={k}={v}" for k, v in TINY.items() if k != "schedule.steps"]])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["objective"] == "classification" and "accuracy" in payload["after"]
    assert payload["format"] == "full" and (cli_out / "model.safetensors").exists()
    assert load_classification_head(cli_out)[1] == ["bad", "good"]


@pytest.mark.distributed
def test_two_processes_match_one_with_the_same_global_batch(tiny_llama_dir, text_file, tmp_path):
    single = tmp_path / "single"
    run_finetune(_options(tiny_llama_dir, text_file, single, "htuning"))
    double = tmp_path / "double"
    env = {**os.environ, "MLXKIT_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29541",
               "-m", "mlxkit", "finetune", "--recipe", "htuning", "--model", str(tiny_llama_dir),
               "--data", str(text_file), "--out", str(double), "--quiet",
               *[f"--set={k}={v}" for k, v in {**TINY, **HT}.items()]]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = _adapter(single), _adapter(double)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=2e-5) for k in a)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in b.items() if "lora_B" in k)
    assert json.loads((double / "mlxkit.json").read_text())["results"]["world_size"] == 2


# ----------------------------------------------------------------------------- errors before any work

def _bad_inputs(tmp_path: Path, text_file: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    no_label = tmp_path / "nolabel.jsonl"
    no_label.write_text(json.dumps({"text": "a", "label": 1}) + "\n" + json.dumps({"text": "b"}) + "\n")
    return {
        "unknown key": (["--data", str(text_file), "--set", "optim.learning_rate=1"], "optim.learning_rate"),
        "empty data": (["--data", str(empty)], "holds no text"),
        "label missing": (["--data", str(no_label), "--objective", "classification"], "no field 'label'"),
        "no target modules": (["--data", str(text_file), "--set", "lora.target_modules=[c_attn]"], "c_attn"),
        "no data": ([], "needs --data"),
        "bad value": (["--data", str(text_file), "--set", "htuning.mix_coef=1.5"], "htuning.mix_coef"),
        "merge full": (["--data", str(text_file), "--recipe", "full", "--merge"], "--merge"),
        "unknown recipe": (["--data", str(text_file), "--recipe", "qlora"], "qlora"),
    }


@pytest.fixture
def quiet_transformers():
    """As under the `mlx` command, which turns transformers' progress bars off before importing it."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    yield
    if was:
        logging.enable_progress_bar()


@pytest.mark.parametrize("case", ["unknown key", "empty data", "label missing", "no target modules", "no data",
                                  "bad value", "merge full", "unknown recipe"])
def test_bad_input_is_one_error_line_and_leaves_nothing(case, tiny_llama_dir, text_file, tmp_path,
                                                        quiet_transformers):
    args, message = _bad_inputs(tmp_path, text_file)[case]
    out = tmp_path / "out"
    result = runner.invoke(app, ["finetune", "--model", str(tiny_llama_dir), "--out", str(out),
                                 "--set", "data.seq_len=32", *args])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.output
    assert "Traceback" not in result.output
    assert not out.exists() and not FinetuneRun.work_dir_for(out).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_recipes_lists_the_finetune_recipes():
    result = runner.invoke(app, ["recipes", "--json"])
    assert result.exit_code == 0, result.output
    rows = {(r["verb"], r["name"]) for r in json.loads(result.stdout)}
    assert {("finetune", "htuning"), ("finetune", "lora"), ("finetune", "full")} <= rows


def test_examples_batch_cuts_right_padding():
    ex = Examples(torch.tensor([[5, 6, 0, 0], [7, 8, 9, 0]]), torch.tensor([2, 3]), torch.tensor([0, 1]))
    assert ex.batch([0]).ids.tolist() == [[5, 6]] and ex.batch([1, 0]).ids.shape == (2, 3)
