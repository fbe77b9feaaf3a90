"""Classification data for robust training: an `.npz` file with inputs `x` and integer labels `y`.

Everything is checked when the file is read, before any work starts: both arrays present,
one label per example, inputs finite, shaped like the model's input and inside the valid
range the attacks keep to, labels whole numbers within the model's classes.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mlxkit.engines.core.seeds import seeded_generator
from mlxkit.engines.errors import InputError


@dataclass(frozen=True)
class LabelledArrays:
    x: torch.Tensor   # [N, *input_shape], float32
    y: torch.Tensor   # [N], int64

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, indices: torch.Tensor) -> "LabelledArrays":
        return LabelledArrays(self.x[indices], self.y[indices])

    def to(self, device: torch.device) -> "LabelledArrays":
        return LabelledArrays(self.x.to(device), self.y.to(device))


def read_npz(path: str | os.PathLike, input_shape: list[int], num_classes: int, low: float,
             high: float) -> LabelledArrays:
    """The arrays of `path`, checked against the model's input shape and classes and the valid range."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"data '{path}' does not exist" if not path.exists() else f"data '{path}' is not a file")
    if path.suffix != ".npz":
        raise InputError(f"data '{path}' must be an .npz file holding arrays 'x' and 'y'")
    if not zipfile.is_zipfile(path):  # else np.load tries it as a pickle and says so, which misleads
        raise InputError(f"data '{path}' is not an .npz file: not a zip archive (an .npz is a zip of .npy arrays)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in ("x", "y") if key not in archive.files]
            if missing:
                raise InputError(f"data '{path}' has no array {' or '.join(repr(k) for k in missing)} "
                                 f"(it holds: {', '.join(archive.files) or 'nothing'}); robust training needs "
                                 "inputs 'x' and labels 'y'")
            x, y = archive["x"], archive["y"]
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"data '{path}' cannot be read as .npz ({str(exc).splitlines()[0][:200]})") from None
    where = f"data '{path}'"
    if x.dtype.kind not in "fiub" or y.dtype.kind not in "fiub":
        raise InputError(f"{where}: 'x' and 'y' must be numeric arrays (got {x.dtype} and {y.dtype})")
    if y.ndim != 1 or x.ndim < 1 or x.shape[0] != y.shape[0]:
        raise InputError(f"{where}: 'y' must hold one label per example of 'x' (shapes {list(x.shape)} and "
                         f"{list(y.shape)})")
    if y.shape[0] == 0:
        raise InputError(f"{where} holds no examples")
    if list(x.shape[1:]) != list(input_shape):
        raise InputError(f"{where}: each example of 'x' has shape {list(x.shape[1:])}, the model takes "
                         f"{list(input_shape)}")
    if not np.isfinite(x).all():
        raise InputError(f"{where}: 'x' holds NaN or infinite values")
    if x.min() < low or x.max() > high:
        raise InputError(f"{where}: 'x' spans [{x.min():.4g}, {x.max():.4g}], outside the valid input range "
                         f"[{low:g}, {high:g}] (set data.low / data.high, or rescale the inputs)")
    if y.dtype.kind == "f" and (not np.isfinite(y).all() or (y != np.round(y)).any()):
        raise InputError(f"{where}: labels 'y' must be whole numbers")
    if y.min() < 0 or y.max() >= num_classes:
        raise InputError(f"{where}: labels 'y' span {int(y.min())}..{int(y.max())}, the model has "
                         f"{num_classes} classes (0..{num_classes - 1})")
    return LabelledArrays(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
                          torch.from_numpy(y.astype(np.int64)))


def split_held_out(data: LabelledArrays, held_out: int, seed: int) -> tuple[LabelledArrays, LabelledArrays]:
    """(training part, `held_out` evaluation examples), by a seeded permutation."""
    if held_out >= len(data):
        raise InputError(f"the data has {len(data)} examples, too few to hold out data.held_out_examples="
                         f"{held_out} and still train (lower it, or pass --eval-data)")
    order = torch.randperm(len(data), generator=seeded_generator(seed, "crt-held-out"))
    return data.subset(order[held_out:]), data.subset(order[:held_out])
