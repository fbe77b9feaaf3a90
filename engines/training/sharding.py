"""FSDP2 sharding of a transformers model over the launch's processes, and its sharded checkpoints.

With several processes a trainer shards its models with `torch.distributed.fsdp.fully_shard`:
each decoder layer is one unit, then the root (embeddings, final norm, head). Each rank keeps
1/W of every parameter, of its gradient and of its optimiser state; a unit's full weights
exist only while it computes.

* The student trains with float32 master shards; with a lower compute dtype FSDP's mixed
  precision casts the gathered weights to it (`param_dtype`) and reduces gradients in float32,
  which is the same rule autocast follows in a replicated run.
* The teacher is sharded the same way, in its own (compute) dtype, and only runs forwards.
* Every loss is normalised by the global batch, so gradients are summed over ranks, not
  averaged (`set_gradient_divide_factor(1.0)`).
* Forwards go through the root module (`model(...)`), whose hooks gather the root's weights;
  the head then stays gathered for the chunked logit loss until the backward is done.

Checkpoints are written with `torch.distributed.checkpoint`: every rank writes its own shards,
into a fresh directory that replaces the previous checkpoint only once all ranks are done, so
a kill during a save leaves the previous checkpoint whole. A sharded checkpoint resumes under
the same number of processes. The finished model is gathered onto rank 0 and written as one
ordinary safetensors checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.training.checkpoint import STATE, TrainingState, rng_state, set_rng_state
from mlxkit.engines.training.device import Placement
from mlxkit.engines.training.distributed import Distributed


def sharding_on(setting: str, dist: Distributed) -> bool:
    if setting not in ("auto", "fsdp", "none"):
        raise InputError(f"sharding must be auto, fsdp or none (got '{setting}')")
    return dist.world_size > 1 and setting != "none"


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a transformers causal LM (`model.model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise InputError(f"cannot shard {type(model).__name__}: it has no model.layers list of decoder layers "
                         "(use --sharding none)")
    return layers


def shard_model(model: torch.nn.Module, placement: Placement, *, trainable: bool) -> None:
    """Shard `model` in place: each decoder layer, then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if trainable and placement.mixed:
        policy = MixedPrecisionPolicy(param_dtype=placement.dtype, reduce_dtype=torch.float32)
    units = list(decoder_layers(model)) + [model]
    for unit in units:
        fully_shard(unit, mp_policy=policy)
    if trainable:
        for unit in units:  # each unit's setting is its own
            unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
            # A plain sum: gloo has no pre-multiplied sum, and with a factor of 1 there is nothing to scale.
            unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


def meta_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM that `config` describes, built on the meta device: shapes and dtypes, no storage."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def build_sharded(model: torch.nn.Module, placement: Placement, dist: Distributed, *, dtype: torch.dtype,
                  trainable: bool, prepare: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """`model` sharded over the ranks, of which only rank 0 ever read the whole.

    Rank 0 passes the model it loaded (on the CPU); every other rank passes the same architecture
    built on the meta device (`meta_model`), which allocates nothing. Every
    rank shards its copy: FSDP2 moves rank 0's weights to its device one unit at a time, so no
    GPU holds a whole model. Rank 0's full state dict is then broadcast into the other ranks'
    shards, as torchtune's distributed recipes load, and buffers no state dict holds (RoPE
    frequencies) are broadcast beside it. `prepare` runs on every rank before sharding (the
    trainable flags, gradient checkpointing), so every rank shards the same way.
    """
    import torch.distributed as torch_dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = model.to(dtype=dtype)
    full = model.state_dict() if dist.is_main else {}
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    if prepare is not None:
        prepare(model)
    shard_model(model, placement, trainable=trainable)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is None:
                continue
            if buffer.device.type == "meta":
                buffer = torch.empty_like(buffer, device=placement.device)
                module._buffers[name] = buffer
            torch_dist.broadcast(buffer, src=0)
    return model


def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank calls it; rank 0 gets the whole model's tensors on the CPU, the others an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _rng_file(directory: Path, rank: int) -> Path:
    return directory / f"rng-rank{rank}.pt"


def save_sharded_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            state: TrainingState, dist: Distributed) -> None:
    """Every rank writes its shards into a fresh directory, which then replaces `directory`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    fresh = directory.with_name(directory.name + ".partial")
    if dist.is_main:
        shutil.rmtree(fresh, ignore_errors=True)
        fresh.mkdir(parents=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(fresh))
    torch.save(rng_state(), _rng_file(fresh, dist.rank))
    dist.barrier()
    if dist.is_main:
        (fresh / STATE).write_text(json.dumps({"step": state.step, "tokens_seen": state.tokens_seen,
                                               "log_lines": state.log_lines, "extra": state.extra,
                                               "world_size": dist.world_size}, indent=1))
        previous = directory.with_name(directory.name + ".previous")
        if directory.exists():
            os.replace(directory, previous)
        os.replace(fresh, directory)
        shutil.rmtree(previous, ignore_errors=True)
    dist.barrier()


def load_sharded_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            dist: Distributed) -> TrainingState | None:
    """Restore this rank's shards in place; None when there is no checkpoint yet."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    previous = directory.with_name(directory.name + ".previous")
    if not (directory / STATE).exists() and (previous / STATE).exists():
        directory = previous  # killed between the two renames of a save
    if not (directory / STATE).exists():
        return None
    try:
        recorded = json.loads((directory / STATE).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"checkpoint '{directory}' cannot be resumed ({exc}); delete it to start over") from None
    if recorded.get("world_size") != dist.world_size:
        raise InputError(f"checkpoint '{directory}' was written by {recorded.get('world_size')} processes; resume it "
                         f"with as many (this launch has {dist.world_size}), or delete it to start over")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    target: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(target, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"])
    set_rng_state(torch.load(_rng_file(directory, dist.rank), weights_only=True))
    return TrainingState(int(recorded["step"]), int(recorded["tokens_seen"]), int(recorded["log_lines"]),
                         recorded["extra"])
