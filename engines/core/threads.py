"""Run a block of work on one intra-op thread, then restore torch's setting."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def one_intra_op_thread(active: bool = True) -> Iterator[None]:
    """Within the block torch uses one intra-op thread (when `active`); the old count comes back after.

    For work made of many tiny ops (small batched matrices, small classifiers), where handing each
    op to a second thread costs more than the op. Switching the count is itself slow on a loaded
    machine, so callers switch once around a stretch of work, not once per operation.
    """
    before = torch.get_num_threads()
    if not active or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
