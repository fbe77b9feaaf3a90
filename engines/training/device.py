"""Where a verb computes and in which precision: `--device` and `--dtype`, resolved once.

The rule every verb follows:

* `--device auto` is CUDA when torch sees a GPU, else the CPU. Under torchrun or accelerate,
  `auto` and `cuda` mean `cuda:LOCAL_RANK`, so each process drives its own GPU.
* `--dtype auto` is bfloat16 on a GPU that supports it (float32 on one that does not) and
  float32 on a CPU.
* Training keeps master weights and optimiser state in float32 and runs the forward under
  autocast in the compute dtype; losses, KL and log-softmax are computed in float32.
  Inference-only models (a teacher, a parent being scored) are held in the compute dtype.
* Outputs are written in the parent's dtype (the dtype of the checkpoint a run starts from);
  an explicit `--dtype` other than auto writes in that dtype; `--save-dtype` overrides both.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, ContextManager, TypeVar

import torch

from mlxkit.engines.errors import BackendError, InputError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DEVICE_HELP = ("Compute device: auto (CUDA when available, else CPU), cpu, cuda or cuda:N; under torchrun each "
               "rank takes cuda:LOCAL_RANK.")
DTYPE_HELP = ("Compute dtype: auto (bfloat16 on a GPU that supports it, float32 on a CPU), float32, bfloat16 or "
              "float16. Training keeps float32 master weights and optimiser state, runs the forward under "
              "autocast and computes losses in float32.")
SAVE_DTYPE_HELP = ("dtype of the written weights (float32, bfloat16, float16). Default: the parent's dtype, or "
                   "--dtype when it is given explicitly.")

M = TypeVar("M", bound=torch.nn.Module)


def local_rank() -> int | None:
    """This process's GPU index under a launcher (torchrun and accelerate set LOCAL_RANK), else None."""
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value is not None and value.strip().isdigit() else None


def resolve_device(spec: str = "auto") -> torch.device:
    """`auto | cpu | cuda | cuda:N` → a torch device; a CUDA device torch cannot see is a `BackendError`."""
    text = (spec or "auto").strip().lower()
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise InputError(f"unknown device '{spec}' (use {DEVICE_CHOICES})") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"unknown device '{spec}' (use {DEVICE_CHOICES})")
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise BackendError(f"--device {spec} was asked for, but this torch sees no CUDA device "
                           f"(torch {torch.__version__}; use --device cpu)")
    index = device.index
    from_launcher = index is None and local_rank() is not None
    if index is None:
        index = local_rank() or 0
    count = torch.cuda.device_count()
    if index >= count and from_launcher:
        raise BackendError(f"this process is LOCAL_RANK={index} of a launcher, but torch sees {count} GPU(s) "
                           "here: start at most one process per visible GPU (--nproc_per_node, "
                           "CUDA_VISIBLE_DEVICES)")
    if index >= count:
        raise BackendError(f"--device {spec} asks for GPU {index}, but torch sees {count}")
    return torch.device("cuda", index)


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """`auto | float32 | bfloat16 | float16` → the compute dtype on `device`."""
    text = (spec or "auto").strip().lower()
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    text = aliases.get(text, text)
    if text == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if text not in DTYPE_NAMES:
        raise InputError(f"unknown dtype '{spec}' (use auto, {', '.join(DTYPE_NAMES)})")
    return getattr(torch, text)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Placement:
    """A run's device and compute dtype, with the rules that follow from them."""

    device: torch.device
    dtype: torch.dtype
    explicit_dtype: bool = False  # --dtype was given (not auto): outputs are written in it

    @classmethod
    def resolve(cls, device: str = "auto", dtype: str = "auto") -> "Placement":
        resolved = resolve_device(device)
        return cls(resolved, resolve_dtype(dtype, resolved), (dtype or "auto").strip().lower() != "auto")

    @classmethod
    def cpu(cls) -> "Placement":
        return cls(torch.device("cpu"), torch.float32)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def mixed(self) -> bool:
        """Compute runs in a lower precision than the float32 master weights."""
        return self.dtype != torch.float32

    def autocast(self) -> ContextManager[None]:
        """The forward's precision context: autocast in the compute dtype, or nothing in float32."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def save_dtype(self, parent_dtype: torch.dtype, override: str | None = None) -> torch.dtype:
        """The dtype outputs are written in: `override`, else an explicit --dtype, else the parent's."""
        if override is not None and override.strip().lower() not in ("", "auto"):
            chosen = resolve_dtype(override, self.device)
            return chosen
        if self.explicit_dtype:
            return self.dtype
        return parent_dtype if parent_dtype.is_floating_point else torch.float32


def training_placement(device: str = "auto", dtype: str = "auto") -> Placement:
    """`Placement.resolve` for a run that trains; float16 is refused there.

    float16's five exponent bits flush small gradients to zero unless the loss is scaled (a
    GradScaler), and mlxkit's trainers do not scale it. bfloat16 has float32's range and needs no
    scaling, so it is the lower precision for training.
    """
    placement = Placement.resolve(device, dtype)
    if placement.dtype == torch.float16:
        raise InputError("--dtype float16 cannot train here: its gradients need loss scaling, which mlxkit's "
                         "trainers do not do; use --dtype bfloat16 (or float32)")
    return placement


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter or buffer (CPU for a module that holds none)."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of a module's first floating-point parameter (float32 for one that holds none)."""
    for tensor in module.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def build_on(device: torch.device | str, build: Callable[[], M]) -> M:
    """`build()` constructed on the meta device and then given uninitialised storage on `device`.

    For modules whose every parameter is overwritten right after (block initialisation,
    assembly): nothing is allocated twice and nothing is initialised only to be thrown away.
    Buffers that a module computes in its constructor (RoPE frequencies) are not kept by
    `to_empty`, so modules holding them must be built on the CPU and moved instead.
    """
    with torch.device("meta"):
        module = build()
    return module.to_empty(device=device)
