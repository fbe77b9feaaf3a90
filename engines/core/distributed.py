"""Scale-out over an existing launcher: torchrun or accelerate set the usual env variables.

Work is split round-robin by rank; CPU runs use the gloo backend. With one process
(no launcher) everything degrades to plain local calls.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence, TypeVar

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
