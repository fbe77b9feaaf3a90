"""Scale-out over an existing launcher: torchrun or accelerate set the usual env variables.

Work is split round-robin by rank; CPU runs use the gloo backend. With one process
(no launcher) everything degrades to plain local calls.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    initialised_here: bool = False

    @classmethod
    def from_env(cls) -> "Distributed":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch
        import torch.distributed as dist

        rank = int(os.environ["RANK"])
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() and os.environ.get("MLXKIT_BACKEND") != "gloo" else "gloo"
            dist.init_process_group(backend=backend)
            return cls(rank, world, True)
        return cls(rank, world, False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's items: every world_size-th, starting at its rank."""
        return list(items[self.rank::self.world_size])

    def all_reduce_sum(self, tensors: Sequence["torch.Tensor"]) -> None:
        """Sum each tensor over the processes, in place, with one collective per dtype (float64 stays float64)."""
        if self.world_size == 1 or not tensors:
            return
        import torch
        import torch.distributed as dist

        for dtype in dict.fromkeys(t.dtype for t in tensors):
            group = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.all_reduce(flat)
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.initialised_here:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()
            self.initialised_here = False


def gradients(params: Sequence["torch.nn.Parameter"]) -> list["torch.Tensor"]:
    """Each parameter's gradient, zero-filled where this rank computed none, so every rank reduces the same list."""
    import torch

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]
