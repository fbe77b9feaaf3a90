"""Every merge method by name. `get()` raises a clear error on an unknown one."""

from __future__ import annotations

from mlxkit.engines.errors import InputError
from mlxkit.engines.merge.methods.arcee_fusion import ArceeFusion
from mlxkit.engines.merge.methods.base import MergeMethod
from mlxkit.engines.merge.methods.breadcrumbs import Breadcrumbs
from mlxkit.engines.merge.methods.dare import Dare
from mlxkit.engines.merge.methods.della import Della
from mlxkit.engines.merge.methods.fisher import Fisher
from mlxkit.engines.merge.methods.iso_c import IsoC
from mlxkit.engines.merge.methods.iso_cts import IsoCTS
from mlxkit.engines.merge.methods.karcher import Karcher
from mlxkit.engines.merge.methods.linear import Linear
from mlxkit.engines.merge.methods.model_stock import ModelStock
from mlxkit.engines.merge.methods.multislerp import MultiSlerp
from mlxkit.engines.merge.methods.nearswap import NearSwap
from mlxkit.engines.merge.methods.nuslerp import NuSlerp
from mlxkit.engines.merge.methods.passthrough import Passthrough
from mlxkit.engines.merge.methods.ram import Ram
from mlxkit.engines.merge.methods.regmean import RegMean
from mlxkit.engines.merge.methods.sce import Sce
from mlxkit.engines.merge.methods.slerp import Slerp
from mlxkit.engines.merge.methods.task_arithmetic import TaskArithmetic
from mlxkit.engines.merge.methods.ties import Ties
from mlxkit.engines.merge.methods.tsv_m import TsvM

METHODS: dict[str, MergeMethod] = {m.name: m for m in [
    IsoC(), IsoCTS(), TsvM(), TaskArithmetic(), Ties(), Dare("dare-ties", consensus=True),
    Dare("dare-linear", consensus=False), Breadcrumbs("breadcrumbs", consensus=False),
    Breadcrumbs("breadcrumbs-ties", consensus=True), Della("della", consensus=True),
    Della("della-linear", consensus=False), Sce(), ModelStock(), ArceeFusion(), Linear(), Slerp(), NuSlerp(),
    MultiSlerp(), Karcher(), Passthrough(), NearSwap(), Ram("ram"), Ram("ramplus-tl", plus=True),
    RegMean(), Fisher(),
]}


def canonical_name(name: str) -> str:
    """mergekit spells methods with underscores; accept both."""
    return name.strip().lower().replace("_", "-")


def get(name: str) -> MergeMethod:
    key = canonical_name(name)
    if key not in METHODS:
        raise InputError(f"unknown merge method '{name}' (choose from {', '.join(METHODS)})")
    return METHODS[key]
