"""Scale-out over an existing launcher: torchrun and accelerate set the usual environment variables.

One process group per process, initialised by the first `Distributed.from_env` and destroyed
by the `close()` of that same object, so a verb made of several distributed stages (a search
that builds a library, then distils a child) keeps one group from start to end.

* CUDA: each rank calls `torch.cuda.set_device(LOCAL_RANK)` and joins with NCCL, bound to
  that device; every tensor handed to a collective is on it.
* CPU: gloo. torchrun sets `OMP_NUM_THREADS=1` for every rank; here each rank instead takes
  the machine's cores divided by the ranks on this node (`MLXKIT_THREADS` overrides).
* `close()` collects the garbage that still holds the group before destroying it, so no
  sharded module outlives the group into the interpreter's exit.
* The group's timeout is explicit (`MLXKIT_DIST_TIMEOUT` seconds, default 2 hours): long
  enough for the stages rank 0 runs alone while the others wait at a barrier.

Work is split round-robin by rank. With one process (no launcher) everything degrades to
plain local calls.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import torch

from mlxkit.engines.errors import InputError

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 2 * 3600.0


def timeout_seconds() -> float:
    raw = os.environ.get("MLXKIT_DIST_TIMEOUT")
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise InputError(f"MLXKIT_DIST_TIMEOUT must be a number of seconds (got '{raw}')") from None
    if not value > 0:
        raise InputError(f"MLXKIT_DIST_TIMEOUT must be positive (got '{raw}')")
    return value


def cpu_threads_per_rank() -> int:
    """Cores divided by the ranks on this node, at least 1 (`MLXKIT_THREADS` overrides)."""
    raw = os.environ.get("MLXKIT_THREADS")
    if raw is not None and raw.strip().isdigit() and int(raw) > 0:
        return int(raw)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")) or 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world))


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    initialised_here: bool = False
    notes: list[str] = field(default_factory=list)  # what the launch changed, for the caller to report

    @classmethod
    def from_env(cls, device: torch.device | None = None) -> "Distributed":
        """This process's place in the launch; joins (or reuses) the process group when there are several.

        `device` is where the run computes (default: CUDA:LOCAL_RANK when available, else CPU); it
        decides the backend. A run whose group already exists (an outer stage made it) reuses it.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if device is None:
            from mlxkit.engines.training.device import resolve_device

            device = resolve_device("auto")
        if world <= 1:
            return cls(device=device)
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        if dist.is_initialized():
            backend = dist.get_backend()
            return cls(rank, world, _collective_device(backend, device), backend, False)
        notes: list[str] = []
        use_nccl = device.type == "cuda" and os.environ.get("MLXKIT_BACKEND", "").lower() != "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            threads = cpu_threads_per_rank()
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
                notes.append(f"{threads} CPU thread(s) per rank ({world} ranks; MLXKIT_THREADS overrides)")
        backend = "nccl" if use_nccl else "gloo"
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_seconds())}
        if use_nccl:
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
        return cls(rank, world, _collective_device(backend, device), backend, True, notes)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's items: every world_size-th, starting at its rank."""
        return list(items[self.rank::self.world_size])

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum each tensor over the processes, in place, with one collective per dtype (float64 stays float64).

        The collective sees one flat buffer on the backend's device; tensors elsewhere are copied
        there and back.
        """
        if self.world_size == 1 or not tensors:
            return
        import torch.distributed as dist

        for dtype in dict.fromkeys(t.dtype for t in tensors):
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1).to(self.device) for t in group])
            dist.all_reduce(flat)
            copy_back(flat, group)

    def broadcast_object(self, value: T | None, build: Callable[[], T] | None = None) -> T:
        """Rank 0's `value` (or what `build()` returns there) on every rank."""
        if build is not None and self.is_main:
            value = build()
        if self.world_size == 1:
            return value  # type: ignore[return-value]
        import torch.distributed as dist

        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()

    def close(self) -> None:
        if self.initialised_here:
            import gc

            import torch.distributed as dist

            self.barrier()
            # FSDP2 modules sit in reference cycles whose device meshes hold the group; left for the
            # interpreter's exit, gloo's group is destroyed during teardown, which can abort the process
            # ("terminate called without an active exception") after a finished run.
            gc.collect()
            dist.destroy_process_group()
            self.initialised_here = False


def copy_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Write consecutive slices of `flat` back into `tensors`, whatever device each is on."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _collective_device(backend: str, device: torch.device) -> torch.device:
    """NCCL reduces tensors on this rank's GPU; gloo reduces CPU tensors."""
    return device if backend == "nccl" else torch.device("cpu")


def gradients(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient, zero-filled where this rank computed none, so every rank reduces the same list."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]
