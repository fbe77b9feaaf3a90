"""The training core: device and dtype rule, collectives on the backend's device, bf16 runs against fp32."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch._subclasses.fake_tensor import FakeTensorMode

from mlxkit.engines.distill.recipe import load_distill_recipe
from mlxkit.engines.distill.trainer import DistillationOptions, DistillationRun, run_distillation
from mlxkit.engines.errors import BackendError, InputError
from mlxkit.engines.finetune.recipe import load_finetune_recipe
from mlxkit.engines.finetune.trainer import FinetuneOptions, run_finetune
from mlxkit.engines.training import distributed as distributed_module
from mlxkit.engines.training.checkpoint import TrainingState
from mlxkit.engines.training.checkpointer import Checkpointer
from mlxkit.engines.training.device import Placement, resolve_device, resolve_dtype
from mlxkit.engines.training.distributed import Distributed, cpu_threads_per_rank
from mlxkit.engines.training.step import check_global_batch

DISTILL = {"data.seq_len": 32, "data.held_out_sequences": 2, "optim.batch_sequences": 4,
           "optim.micro_batch_sequences": 2, "optim.lr": 1e-2, "optim.warmup_fraction": 0.0,
           "schedule.eval_every": 2, "schedule.checkpoint_every": 2}
STEPS = 3




def _dtypes(directory: Path, pattern: str = "*.safetensors") -> set[str]:
    found = set()
    for file in directory.glob(pattern):
        with safe_open(str(file), "pt") as handle:
            found |= {str(handle.get_slice(name).get_dtype()) for name in handle.keys()}
    return found


# ----------------------------------------------------------------------------- the device and dtype rule

def test_auto_is_the_cpu_in_float32_here_and_cuda_is_a_clear_error():
    placement = Placement.resolve("auto", "auto")
    assert placement.device == torch.device("cpu") and placement.dtype == torch.float32 and not placement.mixed
    with pytest.raises(BackendError, match="no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(InputError, match="unknown device"):
        resolve_device("tpu")
    with pytest.raises(InputError, match="unknown dtype"):
        resolve_dtype("int8", torch.device("cpu"))


def test_save_dtype_follows_the_parent_unless_a_dtype_is_given():
    auto = Placement.resolve("cpu", "auto")
    assert auto.save_dtype(torch.bfloat16) == torch.bfloat16 and auto.save_dtype(torch.float32) == torch.float32
    explicit = Placement.resolve("cpu", "bfloat16")
    assert explicit.save_dtype(torch.float32) == torch.bfloat16
    assert explicit.save_dtype(torch.float32, "float16") == torch.float16


def test_auto_on_a_gpu_means_this_rank_s_gpu_in_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    placement = Placement.resolve("auto", "auto")
    assert placement.device == torch.device("cuda", 3) and placement.dtype == torch.bfloat16
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(BackendError, match="GPU 9"):
        resolve_device("cuda:9")


# ----------------------------------------------------------------------------- collectives

def test_on_cuda_ranks_join_with_nccl_on_their_gpu_and_reduce_only_tensors_there(monkeypatch):
    calls: dict[str, object] = {}
    reduced_devices: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("set_device", device))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kwargs: calls.setdefault("init", kwargs))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, *a, **k: reduced_devices.append(tensor.device))
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MLXKIT_DIST_TIMEOUT": "900"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MLXKIT_BACKEND", raising=False)
    # Fake CUDA tensors have no storage to copy into: only what reaches the collective is checked here.
    monkeypatch.setattr(distributed_module, "copy_back", lambda flat, tensors: None)

    dist = Distributed.from_env(resolve_device("auto"))
    assert dist.backend == "nccl" and dist.device == torch.device("cuda", 1)
    assert calls["set_device"] == torch.device("cuda", 1)
    init = calls["init"]
    assert init["backend"] == "nccl" and init["device_id"] == torch.device("cuda", 1)  # type: ignore[index]
    assert init["timeout"] == datetime.timedelta(seconds=900)  # type: ignore[index]

    torch.__future__.set_swap_module_params_on_conversion(False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        grads = [torch.randn(3, 4, device="cuda:1"), torch.randn(5, device="cuda:1")]
        sums = torch.zeros(3, dtype=torch.float64, device="cuda:1")
        dist.all_reduce_sum([*grads, sums])
    assert len(reduced_devices) == 2  # one collective per dtype
    assert all(device == torch.device("cuda", 1) for device in reduced_devices)


def test_cpu_ranks_use_gloo_and_the_cores_divided_by_the_local_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("MLXKIT_THREADS", raising=False)
    monkeypatch.setattr(distributed_module.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_threads_per_rank() == 4
    monkeypatch.setenv("MLXKIT_THREADS", "3")
    assert cpu_threads_per_rank() == 3


def test_a_global_batch_that_does_not_split_names_the_setting_and_a_value_that_works():
    check_global_batch(8, 4, "optim.batch_sequences")
    with pytest.raises(InputError, match=r"optim.batch_sequences=4 .* 8 processes.*--set optim.batch_sequences=8"):
        check_global_batch(4, 8, "optim.batch_sequences")


# ----------------------------------------------------------------------------- bf16 against fp32

def _distill(pair, text_file, out, mode, dtype, **recipe):
    loaded = load_distill_recipe(mode).with_overrides({**DISTILL, **recipe})
    return run_distillation(DistillationOptions(mode=mode, teacher=str(pair[0]), student=str(pair[1]), out=out,
                                                recipe=loaded, data=text_file, tokens=STEPS * 4 * 32,
                                                device="cpu", dtype=dtype))


@pytest.mark.parametrize("mode", ["gkd", "kd"])
def test_bf16_distillation_agrees_with_fp32_and_saves_bf16(pair, text_file, tmp_path, mode):
    full = _distill(pair, text_file, tmp_path / "fp32", mode, "float32")
    half = _distill(pair, text_file, tmp_path / "bf16", mode, "bfloat16")
    assert half["compute_dtype"] == "bfloat16" and half["saved_dtype"] == "bfloat16"
    assert _dtypes(tmp_path / "bf16") == {"BF16"} and _dtypes(tmp_path / "fp32") == {"F32"}
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    # bf16 keeps 8 bits of mantissa (~0.4 % per rounding). Over three steps at lr 1e-2 the two runs'
    # held-out KL and final loss were measured 0.13 % apart at most; 1 % leaves room for other CPUs' kernels.
    for run in (full, half):
        assert run["after"]["kl_div"] < run["before"]["kl_div"]
    assert half["before"]["kl_div"] == pytest.approx(full["before"]["kl_div"], rel=0.01)
    assert half["after"]["kl_div"] == pytest.approx(full["after"]["kl_div"], rel=0.01)
    assert half["final_loss"] == pytest.approx(full["final_loss"], rel=0.01)


def test_bf16_lora_agrees_with_fp32_and_saves_a_bf16_adapter(tiny_llama_dir, text_file, tmp_path):
    settings = {"schedule.steps": STEPS, "optim.batch_sequences": 4, "optim.micro_batch_sequences": 2,
                "optim.lr": 1e-2, "data.seq_len": 32, "data.held_out_sequences": 2, "schedule.eval_every": 2,
                "schedule.checkpoint_every": 2}
    runs = {}
    for dtype in ("float32", "bfloat16"):
        recipe = load_finetune_recipe("lora").with_overrides(settings)
        runs[dtype] = run_finetune(FinetuneOptions(model=str(tiny_llama_dir), data=text_file,
                                                   out=tmp_path / dtype, recipe=recipe, device="cpu", dtype=dtype))
    full, half = runs["float32"], runs["bfloat16"]
    assert _dtypes(tmp_path / "bfloat16", "adapter_model.safetensors") == {"BF16"}
    assert _dtypes(tmp_path / "float32", "adapter_model.safetensors") == {"F32"}
    assert half["after"]["loss"] < half["before"]["loss"]
    assert half["after"]["loss"] == pytest.approx(full["after"]["loss"], rel=0.02)
    assert half["final_loss"] == pytest.approx(full["final_loss"], rel=0.02)


def test_gradient_checkpointing_changes_memory_not_results(pair, text_file, tmp_path):
    from safetensors.torch import load_file

    plain = _distill(pair, text_file, tmp_path / "plain", "kd", "float32", gradient_checkpointing=False)
    recomputed = _distill(pair, text_file, tmp_path / "recomputed", "kd", "float32", gradient_checkpointing=True)
    assert recomputed["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-5)
    a, b = load_file(str(tmp_path / "plain" / "model.safetensors")), \
        load_file(str(tmp_path / "recomputed" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_cuda_on_a_machine_without_it_is_refused_before_anything_is_written(pair, text_file, tmp_path):
    loaded = load_distill_recipe("gkd").with_overrides(DISTILL)
    with pytest.raises(BackendError, match="no CUDA device"):
        run_distillation(DistillationOptions(mode="gkd", teacher=str(pair[0]), student=str(pair[1]),
                                             out=tmp_path / "out", recipe=loaded, data=text_file, device="cuda"))
    assert not (tmp_path / "out").exists() and not DistillationRun.work_dir_for(tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the step loop's cadence

def test_checkpoints_come_by_step_count_and_by_wall_time(tmp_path):
    from mlxkit.engines.core.progress import Reporter
    from mlxkit.engines.training.checkpoint import TrainingState
    from mlxkit.engines.training.loop import StepLoop, StepOutcome

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    now = [0.0]

    def step(index: int) -> StepOutcome:
        now[0] += 4 * 60.0 if index < 4 else 1.0  # four slow steps, then fast ones
        return StepOutcome({"loss": 1.0}, 10)

    taken: list[int] = []
    state = TrainingState(0, 0, 0, {})
    loop = StepLoop(tmp_path / "log.jsonl", Distributed(), Reporter(), state, total_steps=12, eval_every=100,
                    checkpoint_every=5, checkpoint_minutes=10.0, clock=lambda: now[0])
    assert loop.run(title="t", step=step, evaluate=lambda: {}, optimizer=optimizer,
                    checkpoint=lambda: taken.append(state.step))
    # 12 minutes after the start at step 3 (wall time), then step 5 and step 10 (count); none after the last step.
    assert taken == [3, 5, 10]
    records = loop.records()
    assert [r["step"] for r in records] == list(range(13)) and records[-1]["tokens"] == 120


def test_the_evaluation_before_the_first_step_is_a_task_of_its_own(tmp_path):
    """A fresh run evaluates before its step task starts; on a 135M model that is tens of seconds, which a
    log must show as a stage rather than as silence."""
    import contextlib

    from mlxkit.engines.core.progress import Reporter, TaskHandle
    from mlxkit.engines.training.checkpoint import TrainingState
    from mlxkit.engines.training.loop import StepLoop, StepOutcome

    events: list[str] = []

    class Watch(Reporter):
        @contextlib.contextmanager
        def task(self, description: str, total: int | None = None):
            events.append(f"start {description}")
            yield TaskHandle()
            events.append(f"end {description}")

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    loop = StepLoop(tmp_path / "log.jsonl", Distributed(), Watch(), TrainingState(0, 0, 0, {}), total_steps=2,
                    eval_every=100, checkpoint_every=100)
    loop.run(title="GKD", step=lambda index: StepOutcome({"loss": 1.0}, 10),
             evaluate=lambda: events.append("evaluate") or {}, optimizer=optimizer, checkpoint=lambda: None)
    first = "GKD: held-out evaluation before the first step"
    assert events[:3] == [f"start {first}", "evaluate", f"end {first}"]
    assert events[3] == "start GKD"


def test_a_log_torn_below_its_checkpoint_is_restored_from_the_copy_taken_with_it(tmp_path):
    from mlxkit.engines.training.work import back_up_log, truncate_log

    log = tmp_path / "log.jsonl"
    records = [json.dumps({"step": i}) for i in range(6)]
    log.write_text("".join(line + "\n" for line in records[:4]))
    back_up_log(log)  # the checkpoint that follows counts 4 records
    log.write_text("".join(line + "\n" for line in records))
    log.write_bytes(log.read_bytes()[:20])  # a kill tore the file to its first record and a half
    truncate_log(log, 4)
    assert log.read_text().splitlines() == records[:4]
    log.write_text(records[0] + "\n")
    (tmp_path / "log.jsonl.at-checkpoint").write_text(records[0] + "\n")
    with pytest.raises(InputError, match="lost records"):
        truncate_log(log, 4)


def _two_layers(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].requires_grad_(False)  # a frozen base under an adapter
    return model


def test_a_plain_checkpoint_of_the_trainable_tensors_restores_them_and_leaves_the_frozen_ones(tmp_path):
    trained = _two_layers(0)
    optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=0.1)
    trained(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    expected = {name: tensor.clone() for name, tensor in trained.state_dict().items()}
    Checkpointer(tmp_path, Distributed(), sharded=False, trainable_only=True).save(
        trained, optimizer, TrainingState(5, 40, 6, {"train_seconds": 1.5}))

    fresh = _two_layers(1)
    frozen = fresh[0].weight.clone()
    fresh_optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=0.1)
    checkpointer = Checkpointer(tmp_path, Distributed(), sharded=False, trainable_only=True)
    state = checkpointer.load(fresh, fresh_optimizer)
    assert state == TrainingState(5, 40, 6, {"train_seconds": 1.5})
    assert torch.equal(fresh[1].weight, expected["1.weight"]) and torch.equal(fresh[1].bias, expected["1.bias"])
    assert torch.equal(fresh[0].weight, frozen) and not torch.equal(frozen, expected["0.weight"])
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 1
    # a model that was never sharded is written as it is: nothing is rebuilt
    assert checkpointer.unsharded(fresh, lambda: pytest.fail("rebuilt a model that was never sharded")) is fresh


def test_a_plain_checkpoint_is_written_by_rank_0_alone(tmp_path):
    model = _two_layers(0)
    optimizer = torch.optim.SGD(model[1].parameters(), lr=0.1)
    Checkpointer(tmp_path, Distributed(rank=1, world_size=2), sharded=False).save(
        model, optimizer, TrainingState(1, 1, 1, {}))
    assert not (tmp_path / "checkpoint").exists()
    assert Checkpointer(tmp_path, Distributed(), sharded=False).load(model, optimizer) is None
