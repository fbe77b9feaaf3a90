"""GPU hazards of the training path, checked on a CPU: host reads in the step loop, float16 without loss
scaling, and a launcher's ranks against the visible GPUs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import make_tiny_llama, save_with_tokenizer
from mlxkit.cli.main import app
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.distill.recipe import load_distill_recipe
from mlxkit.engines.distill.trainer import DistillationOptions, run_distillation
from mlxkit.engines.errors import BackendError, NonFiniteError
from mlxkit.engines.training import loop as loop_module
from mlxkit.engines.training.checkpoint import TrainingState
from mlxkit.engines.training.device import resolve_device
from mlxkit.engines.training.distributed import Distributed
from mlxkit.engines.training.loop import StepLoop, StepOutcome, log_interval

runner = CliRunner()


def _loop(tmp_path: Path, *, log_every: int, total: int = 10, eval_every: int = 5, checkpoint_every: int = 100):
    state = TrainingState(0, 0, 0, {})
    return StepLoop(tmp_path / "log.jsonl", Distributed(), Reporter(), state, total, eval_every, checkpoint_every,
                    log_every=log_every)


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)


def _counting_read_back(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = loop_module.read_back

    def counting(rows):
        calls.append(len(rows))
        return original(rows)

    monkeypatch.setattr(loop_module, "read_back", counting)
    return calls


def test_terms_left_on_the_device_are_read_once_per_logged_window_and_logged_per_step(tmp_path, monkeypatch):
    calls = _counting_read_back(monkeypatch)
    loop = _loop(tmp_path, log_every=4)
    losses = [torch.tensor(float(i) + 0.5, dtype=torch.float64) for i in range(10)]
    loop.run(title="t", step=lambda i: StepOutcome({"loss": losses[i]}, 8, {"loss": losses[i]}),
             evaluate=lambda: {"ok": 1}, checkpoint=lambda: None, optimizer=_optimizer())
    records = loop.records()
    assert [r["step"] for r in records] == list(range(11))
    assert [r["loss"] for r in records[1:]] == [i + 0.5 for i in range(10)]
    assert [r["tokens"] for r in records[1:]] == [8 * (i + 1) for i in range(10)]
    assert [r["step"] for r in records if "eval" in r] == [0, 5, 10]
    # Reads at steps 4 and 8 (the interval), 5 (an evaluation) and 10 (the last): four waits, not ten.
    assert len(calls) == 4
    assert loop.state.step == 10 and all(isinstance(r["loss"], float) for r in records[1:])


def test_a_non_finite_term_is_caught_at_the_next_read_and_never_checkpointed(tmp_path):
    loop = _loop(tmp_path, log_every=4, checkpoint_every=2)
    checkpoints: list[int] = []

    def step(i: int) -> StepOutcome:
        value = torch.tensor(math.nan if i == 2 else 1.0, dtype=torch.float64)
        return StepOutcome({"loss": value}, 8)

    with pytest.raises(NonFiniteError, match=r"the training loss became non-finite at step 2 \(loss"):
        loop.run(title="t", step=step, evaluate=lambda: {}, optimizer=_optimizer(),
                 checkpoint=lambda: checkpoints.append(loop.state.step))
    assert checkpoints == [2]  # the checkpoint after step 2 holds only checked steps
    assert loop.state.step == 2


def test_log_interval_reads_every_step_on_a_cpu_and_every_few_on_a_gpu():
    assert log_interval(torch.device("cpu")) == 1
    assert log_interval(torch.device("cuda", 0)) == loop_module.LOG_EVERY_CUDA > 1


@pytest.fixture
def gkd_pair(tmp_path) -> tuple[Path, Path]:
    return (save_with_tokenizer(make_tiny_llama(seed=0), tmp_path / "teacher"),
            save_with_tokenizer(make_tiny_llama(seed=1), tmp_path / "student"))


def _gkd(pair, text_file, out: Path) -> dict:
    recipe = load_distill_recipe("gkd").with_overrides({
        "data.seq_len": 32, "data.held_out_sequences": 2, "optim.batch_sequences": 4, "optim.micro_batch_sequences": 2,
        "optim.lr": 1e-2, "optim.warmup_fraction": 0.0, "schedule.eval_every": 3, "schedule.checkpoint_every": 100})
    options = DistillationOptions(mode="gkd", teacher=str(pair[0]), student=str(pair[1]), out=out, recipe=recipe,
                                  data=text_file, tokens=7 * 4 * 32)
    return run_distillation(options)


def test_gkd_reading_its_terms_every_few_steps_logs_and_trains_exactly_as_reading_every_step(
        gkd_pair, text_file, tmp_path, monkeypatch):
    from mlxkit.engines.distill import trainer

    _gkd(gkd_pair, text_file, tmp_path / "every")
    calls = _counting_read_back(monkeypatch)
    monkeypatch.setattr(trainer, "log_interval", lambda device: 4)
    _gkd(gkd_pair, text_file, tmp_path / "deferred")
    assert 0 < len(calls) < 7

    def log(out: Path) -> list[tuple]:
        rows = [json.loads(line) for line in (out / "distill_log.jsonl").read_text().splitlines()]
        return [(r["step"], r.get("tokens"), r.get("loss"), r.get("kl"), r.get("eval")) for r in rows]

    assert log(tmp_path / "deferred") == log(tmp_path / "every")
    from safetensors.torch import load_file

    for every, deferred in zip(sorted((tmp_path / "every").glob("*.safetensors")),
                               sorted((tmp_path / "deferred").glob("*.safetensors"))):
        a, b = load_file(every), load_file(deferred)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_gkd_step_returns_its_terms_without_reading_them(gkd_pair, text_file, tmp_path, monkeypatch):
    from mlxkit.engines.distill import trainer

    seen: list[dict] = []
    original = trainer.DistillationRun.train_step

    def recording(self, step):
        outcome = original(self, step)
        seen.append(outcome.terms)
        return outcome

    monkeypatch.setattr(trainer.DistillationRun, "train_step", recording)
    _gkd(gkd_pair, text_file, tmp_path / "out")
    assert seen and all(isinstance(v, torch.Tensor) for terms in seen for v in terms.values())


@pytest.mark.parametrize("verb", ["gkd", "bld", "finetune", "search"])
def test_float16_training_is_refused_up_front(verb, gkd_pair, text_file, tmp_path):
    out = tmp_path / "out"
    teacher, student = map(str, gkd_pair)
    args = {"gkd": ["distill", "--gkd", "--teacher", teacher, "--student", student, "--data", str(text_file)],
            "bld": ["library", "build", "--model", teacher, "--data", str(text_file)],
            "finetune": ["finetune", "--model", teacher, "--data", str(text_file)],
            "search": ["search", "--model", teacher, "--target", "cpu", "--data", str(text_file)]}[verb]
    result = runner.invoke(app, [*args, "--out", str(out), "--device", "cpu", "--dtype", "float16"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "float16" in lines[0] and "loss scaling" in lines[0] and "bfloat16" in lines[0]
    assert not out.exists()


def test_more_launcher_ranks_than_visible_gpus_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(BackendError, match=r"LOCAL_RANK=3 .* sees 2 GPU\(s\).*one process per visible GPU"):
        resolve_device("auto")
    with pytest.raises(BackendError, match="LOCAL_RANK=3"):
        resolve_device("cuda")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda", 1)


# ---- a training step on a device other than the CPU --------------------------------------------------
# The meta device stands in for a GPU (see test_device_placement.py): an operation mixing a meta tensor
# with a CPU tensor raises, and reading a meta tensor's value (`.item()`, `.tolist()`) raises too, so a
# step that runs through on meta creates no CPU tensor and reads nothing back to the host.

META = torch.device("meta")


@pytest.fixture
def no_packed_sequence_check(monkeypatch):
    """transformers' own host read: each forward without an attention mask asks whether its position ids
    pack several sequences (`bool(tensor)`), which waits for the GPU once per forward of a transformers
    model. It is not mlxkit's to remove; the GPU check counts it among the syncs it reports."""
    from transformers import masking_utils

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)


def _onto_meta(model: torch.nn.Module) -> None:
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device=META),
                                                              requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = torch.empty_like(b, device=META)


def test_the_harness_catches_a_host_read_and_a_cpu_tensor():
    x = torch.empty(3, device=META)
    with pytest.raises((RuntimeError, NotImplementedError)):
        x.sum().item()
    with pytest.raises((RuntimeError, NotImplementedError)):
        x + torch.ones(3)


def test_a_gkd_step_on_another_device_makes_no_cpu_tensor_and_reads_nothing_back(gkd_pair, text_file, tmp_path,
                                                                                   no_packed_sequence_check):
    from mlxkit.engines.distill.trainer import DistillationRun
    from mlxkit.engines.training.device import Placement
    from mlxkit.engines.training.spec import build_adamw

    recipe = load_distill_recipe("gkd").with_overrides({
        "data.seq_len": 32, "data.held_out_sequences": 2, "optim.batch_sequences": 4, "optim.micro_batch_sequences": 2})
    run = DistillationRun(DistillationOptions(mode="gkd", teacher=str(gkd_pair[0]), student=str(gkd_pair[1]),
                                              out=tmp_path / "out", recipe=recipe, data=text_file, tokens=4 * 32))
    run.setup()
    try:
        _onto_meta(run.teacher)
        _onto_meta(run.student)
        run.placement = Placement(META, torch.float32)
        run.params = [p for p in run.student.parameters() if p.requires_grad]
        run.optimizer = build_adamw(run.params, recipe.optim)
        outcome = run.train_step(0)
        assert {v.device for v in outcome.terms.values()} == {META}
        assert all(p.device == META for p in run.student.parameters())
    finally:
        run.cleanup()


def test_a_lora_step_on_another_device_makes_no_cpu_tensor_and_reads_nothing_back(tiny_llama_dir, text_file, tmp_path,
                                                                                    no_packed_sequence_check):
    from mlxkit.engines.finetune.recipe import load_finetune_recipe
    from mlxkit.engines.finetune.trainer import FinetuneOptions, FinetuneRun
    from mlxkit.engines.training.device import Placement
    from mlxkit.engines.training.spec import build_adamw

    recipe = load_finetune_recipe("lora").with_overrides({"data.seq_len": 32, "data.held_out_sequences": 2,
                                                          "optim.batch_sequences": 4, "optim.micro_batch_sequences": 2})
    run = FinetuneRun(FinetuneOptions(model=str(tiny_llama_dir), data=text_file, out=tmp_path / "out", recipe=recipe))
    run.setup()
    try:
        _onto_meta(run.model.lm)
        run.placement = Placement(META, torch.float32)
        run.params = [p for _, p in run.model.trainable()]
        run.optimizer = build_adamw(run.params, recipe.optim)
        outcome = run.train_step(0)
        assert {v.device for v in outcome.terms.values()} == {META}
    finally:
        run.cleanup()
