"""Every merge method by name. `get()` raises a clear error on an unknown one."""

from __future__ import annotations

from mlxkit.engines.errors import InputError
from mlxkit.engines.merge.methods.base import MergeMethod
from mlxkit.engines.merge.methods.dare import Dare
from mlxkit.engines.merge.methods.iso_c import IsoC
from mlxkit.engines.merge.methods.iso_cts import IsoCTS
from mlxkit.engines.merge.methods.linear import Linear
from mlxkit.engines.merge.methods.slerp import Slerp
from mlxkit.engines.merge.methods.task_arithmetic import TaskArithmetic
from mlxkit.engines.merge.methods.ties import Ties

METHODS: dict[str, MergeMethod] = {m.name: m for m in [
    IsoC(), IsoCTS(), TaskArithmetic(), Ties(), Dare("dare-ties", consensus=True),
    Dare("dare-linear", consensus=False), Linear(), Slerp(),
]}


def canonical_name(name: str) -> str:
    """mergekit spells methods with underscores; accept both."""
    return name.strip().lower().replace("_", "-")


def get(name: str) -> MergeMethod:
    key = canonical_name(name)
    if key not in METHODS:
        raise InputError(f"unknown merge method '{name}' (choose from {', '.join(METHODS)})")
    return METHODS[key]
