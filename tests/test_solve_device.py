"""An SSI solve creates every tensor on its factor's device.

The CPU-only torch of the tests has no GPU, so a factor built on the CPU is moved to the *meta*
device (shapes and dtypes, no data) and solved there. Matrix products of a meta and a CPU tensor do
not raise on meta as they would on CUDA, so a dispatch mode records every operation whose tensor
arguments sit on more than one device. The first test shows it catches one stored tensor left behind.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mlxkit.engines.solve.grid import csr_to_stencil, stencil_mask, stencil_to_csr
from mlxkit.engines.solve.ssi import SSIFactor, _InverseBlock, _LUBlock

DEVICE = torch.device("meta")


def nine_point(height: int, width: int, symmetric: bool) -> np.ndarray:
    s = np.random.default_rng(height).standard_normal((height, width, 3, 3)) * stencil_mask(height, width)
    if symmetric:
        a = stencil_to_csr(s)
        s = csr_to_stencil((a + a.T) / 2, height, width)
    s[..., 1, 1] = np.abs(s).sum((-1, -2)) + 0.5
    return s


class MixedDevices(TorchDispatchMode):
    """Records the operations that meet tensors (other than 0-d scalars) on different devices.

    Dispatch modes are per thread, so the factors under test solve on the calling thread.
    """

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        devices = {t.device for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
        if len(devices) > 1:
            self.mixed.append(f"{func}: {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def solve_on_device(factor: SSIFactor, shape: tuple[int, ...], transpose: bool = False) -> tuple[torch.Tensor, list]:
    with MixedDevices() as mode:
        x = factor.solve(torch.empty(*shape, dtype=torch.float64, device=DEVICE), transpose=transpose)
    return x, mode.mixed


def move(factor: SSIFactor, keep_on_cpu: int | None = None) -> None:
    """Every stored tensor of `factor` onto DEVICE, except piece number `keep_on_cpu`'s block."""
    pieces = [p for group in factor._leaf_pieces for p in group] + [p for step in factor._steps for p in step]
    for k, piece in enumerate(pieces):
        piece.index = tuple(i.to(DEVICE) for i in piece.index)
        if k != keep_on_cpu:
            fields = {f.name: getattr(piece.block, f.name) for f in dataclasses.fields(piece.block)}
            piece.block = dataclasses.replace(piece.block, **{name: value.to(DEVICE) for name, value in fields.items()
                                                              if isinstance(value, torch.Tensor)})
    factor._node_w = factor._node_w.to(DEVICE)
    factor.device = DEVICE


def test_the_harness_catches_a_block_left_on_the_cpu():
    factor = SSIFactor(nine_point(40, 36, symmetric=False), workers=1)
    move(factor, keep_on_cpu=0)
    _, mixed = solve_on_device(factor, (40, 36))
    assert mixed


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("transpose", [False, True])
def test_solve_sweeps_stay_on_the_factor_device(symmetric, transpose):
    # 90 x 70 has separators above and below the explicit-inverse size, so both block kinds run.
    factor = SSIFactor(nine_point(90, 70, symmetric=symmetric), workers=1)
    kinds = {type(p.block) for step in factor._steps for p in step}
    assert kinds == {_InverseBlock, _LUBlock}
    move(factor)
    x, mixed = solve_on_device(factor, (90, 70, 2), transpose)
    assert not mixed
    assert x.device == DEVICE and x.shape == (90, 70, 2) and x.dtype == torch.float64


@pytest.mark.parametrize("symmetric", [True, False])
def test_the_factorisation_stays_on_its_device(symmetric):
    # SSIFactor's constructor reads values (finiteness, symmetry, pivot ratios), which meta tensors
    # lack, so the factorisation itself runs on a meta stencil without them.
    s = torch.from_numpy(nine_point(90, 70, symmetric=symmetric))[None]
    factor = SSIFactor.__new__(SSIFactor)
    factor.dtype, factor.device, factor.workers, factor.symmetric = torch.float64, DEVICE, 1, symmetric
    factor.batch, factor.height, factor.width, factor.batched = 1, 90, 70, False
    factor.plan = SSIFactor(s[0].numpy()).plan
    factor.profile = []
    with MixedDevices() as mode:
        factor._factor([s.to(DEVICE)])
    assert not mode.mixed
    pieces = [p for group in factor._leaf_pieces for p in group] + [p for step in factor._steps for p in step]
    stored = [v for p in pieces for v in [*vars(p.block).values(), *p.index] if isinstance(v, torch.Tensor)]
    assert stored and all(t.device == DEVICE for t in stored)
    assert factor._ratio.device == DEVICE
