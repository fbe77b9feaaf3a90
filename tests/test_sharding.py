"""FSDP2 sharding over 2 CPU processes (gloo): results match one process, resume is exact, shards are halves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, make_tiny_llama
from mlxkit.engines.distill.recipe import load_distill_recipe
from mlxkit.engines.distill.trainer import DistillationOptions, DistillationRun, run_distillation
from mlxkit.engines.finetune.recipe import load_finetune_recipe
from mlxkit.engines.finetune.trainer import FinetuneOptions, run_finetune

pytestmark = pytest.mark.distributed

KD = {"data.seq_len": 32, "data.held_out_sequences": 2, "optim.batch_sequences": 4,
      "optim.micro_batch_sequences": 1, "optim.lr": 1e-2, "optim.warmup_fraction": 0.0,
      "schedule.eval_every": 2, "schedule.checkpoint_every": 2}
STEPS = 4
LORA = {"schedule.steps": STEPS, "optim.batch_sequences": 4, "optim.micro_batch_sequences": 1, "optim.lr": 1e-2,
        "data.seq_len": 32, "data.held_out_sequences": 2, "schedule.eval_every": 2, "schedule.checkpoint_every": 2}
ENV = {**os.environ, "MLXKIT_BACKEND": "gloo", "OMP_NUM_THREADS": "1", "MLXKIT_THREADS": "1"}
# Summation order differs between one process and two (each rank sums its own share first), so the
# weights agree to float32 rounding, not bit for bit.
ATOL = 2e-5




def _weights(out: Path, pattern: str = "*.safetensors") -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(out.glob(pattern)) for k, v in load_file(f).items()}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=ATOL) for k in a)


def _torchrun(script: Path, *args: str, port: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(script), *args]
    done = subprocess.run(command, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _driver(tmp_path: Path) -> Path:
    """A script that runs KD under the launch with the options it is given as JSON, and reports each rank's shard."""
    script = tmp_path / "kd_driver.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(REPO / "tests")!r})
        from pathlib import Path
        from mlxkit.engines.distill.recipe import load_distill_recipe
        from mlxkit.engines.distill.trainer import DistillationOptions, DistillationRun
        spec = json.loads(sys.argv[1])
        reports = Path(spec.pop("reports"))

        import gc
        import torch.distributed as dist
        from torch.distributed.fsdp import FSDPModule
        destroy = dist.destroy_process_group
        def counting_destroy(*args, **kwargs):  # how many sharded modules still hold the group it destroys
            alive = sum(isinstance(o, FSDPModule) for o in gc.get_objects())
            (reports / f"destroy{{dist.get_rank()}}.json").write_text(json.dumps({{"fsdp_modules": alive}}))
            return destroy(*args, **kwargs)
        dist.destroy_process_group = counting_destroy
        from mlxkit.engines.models import loading
        reads = []  # which models this rank read whole from their checkpoints
        load_model = loading.load_model
        def counting_load(spec, **kwargs):
            reads.append(str(getattr(spec, "spec", spec)))
            return load_model(spec, **kwargs)
        loading.load_model = counting_load
        recipe = load_distill_recipe("kd").with_overrides(spec.pop("recipe"))
        run = DistillationRun(DistillationOptions(mode="kd", recipe=recipe, out=Path(spec.pop("out")),
                                                  data=Path(spec.pop("data")), **spec))
        try:
            run.setup()
            local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in run.student.parameters())
            report = {{"rank": run.dist.rank, "local_parameters": local, "sharded": run.sharded, "reads": len(reads)}}
            (reports / f"rank{{run.dist.rank}}.json").write_text(json.dumps(report))
            summary = run.train()
            if summary is not None:
                run.save(summary)
        finally:
            run.cleanup()
    """))
    return script


def _kd_spec(pair, text_file, out, **extra) -> str:
    reports = out.parent / f"{out.name}-reports"
    reports.mkdir(exist_ok=True)
    return json.dumps({"teacher": str(pair[0]), "student": str(pair[1]), "out": str(out), "data": str(text_file),
                       "tokens": STEPS * 4 * 32, "recipe": KD, "reports": str(reports), **extra})


def test_sharded_and_replicated_kd_over_two_processes_match_one(pair, text_file, tmp_path):
    single = tmp_path / "single"
    run_distillation(DistillationOptions(mode="kd", teacher=str(pair[0]), student=str(pair[1]), out=single,
                                         recipe=load_distill_recipe("kd").with_overrides(KD), data=text_file,
                                         tokens=STEPS * 4 * 32))
    driver = _driver(tmp_path)
    full = sum(p.numel() for p in make_tiny_llama(seed=1).parameters())
    for sharding, port in (("auto", 29571), ("none", 29572)):
        out = tmp_path / sharding
        _torchrun(driver, _kd_spec(pair, text_file, out, sharding=sharding), port=port)
        reports = [json.loads(f.read_text()) for f in sorted((tmp_path / f"{sharding}-reports").glob("rank*.json"))]
        assert sorted(r["rank"] for r in reports) == [0, 1]
        if sharding == "auto":
            # Each rank holds half of every parameter (dim 0 split in two; every dim 0 here is even).
            assert all(r["sharded"] and r["local_parameters"] == full // 2 for r in reports)
            # Rank 0 alone read the teacher and the student; rank 1 built both on the meta device.
            assert [r["reads"] for r in sorted(reports, key=lambda r: r["rank"])] == [2, 0]
            # No sharded module outlives the process group into the interpreter's exit.
            at_destroy = [json.loads(f.read_text()) for f in sorted((tmp_path / "auto-reports").glob("destroy*.json"))]
            assert at_destroy == [{"fsdp_modules": 0}] * 2
        else:
            assert all(not r["sharded"] and r["local_parameters"] == full and r["reads"] == 2 for r in reports)
        assert _close(_weights(single), _weights(out)), sharding
        manifest = json.loads((out / "mlxkit.json").read_text())
        assert manifest["results"]["world_size"] == 2


def test_a_sharded_run_resumes_exactly_and_refuses_another_world_size(pair, text_file, tmp_path):
    driver = _driver(tmp_path)
    straight = tmp_path / "straight"
    _torchrun(driver, _kd_spec(pair, text_file, straight), port=29573)
    resumed = tmp_path / "resumed"
    _torchrun(driver, _kd_spec(pair, text_file, resumed, stop_after_steps=3), port=29574)
    checkpoint = DistillationRun.work_dir_for(resumed) / "checkpoint"
    assert json.loads((checkpoint / "state.json").read_text())["step"] == 3 and not resumed.exists()
    assert sorted(p.name for p in checkpoint.glob("rng-rank*.pt")) == ["rng-rank0.pt", "rng-rank1.pt"]
    # One process cannot take over two processes' shards.
    from mlxkit.engines.errors import InputError

    with pytest.raises(InputError, match="written by 2 processes"):
        run_distillation(DistillationOptions(mode="kd", teacher=str(pair[0]), student=str(pair[1]), out=resumed,
                                             recipe=load_distill_recipe("kd").with_overrides(KD), data=text_file,
                                             tokens=STEPS * 4 * 32, sharding="fsdp"))
    _torchrun(driver, _kd_spec(pair, text_file, resumed), port=29575)
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logs = [[{k: v for k, v in json.loads(line).items() if not k.endswith(("_s", "_per_s"))}
             for line in (out / "distill_log.jsonl").read_text().splitlines()] for out in (straight, resumed)]
    assert logs[0] == logs[1]


def test_sharded_lora_over_two_processes_matches_one(tiny_llama_dir, text_file, tmp_path):
    single = tmp_path / "single"
    run_finetune(FinetuneOptions(model=str(tiny_llama_dir), data=text_file, out=single,
                                 recipe=load_finetune_recipe("lora").with_overrides(LORA)))
    double = tmp_path / "double"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29576",
               "-m", "mlxkit", "finetune", "--recipe", "lora", "--model", str(tiny_llama_dir), "--data",
               str(text_file), "--out", str(double), "--json", *[f"--set={k}={v}" for k, v in LORA.items()]]
    done = subprocess.run(command, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["world_size"] == 2
    a, b = _weights(single, "adapter_model.safetensors"), _weights(double, "adapter_model.safetensors")
    assert _close(a, b)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in b.items() if "lora_B" in k)
