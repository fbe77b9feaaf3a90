"""What `mlx search` is asked for: its options and the budgets they state."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mlxkit.engines.errors import InputError
from mlxkit.engines.puzzle.search.budgets import Budgets

DEFAULT_THROUGHPUT = "1.5x"


@dataclass(frozen=True)
class SearchOptions:
    out: Path | None
    target: str = "h100"
    model: str = "smollm2-135m"
    recipe: str | None = None  # the library recipe (default "quick"); only when no --library is given
    library: Path | None = None
    data: Path | None = None
    throughput: str | None = None
    memory: str | None = None
    latency: str | None = None
    params: str | None = None
    scenario: str | None = None
    costs: Literal["profile", "library"] = "profile"
    metric: str = "kl_div"
    solutions: int = 1
    min_distance: int | None = None
    batch_sweep: tuple[int, ...] = ()
    write_costs: Path | None = None
    write_lp: Path | None = None
    seed: int = 0
    overwrite: bool = False
    eval_sequences: int = 4
    allow_pickle: bool = False
    extra_caps: dict[str, float] = field(default_factory=dict)
    gkd_tokens: int | None = None
    gkd_recipe: str = "gkd"
    gkd_overrides: dict[str, Any] = field(default_factory=dict)
    export: str | None = None  # a format of `mlx export`: searched for, then written into `out`
    engine: str | None = None  # the serving engine; None: the profile's (engines/serving/capabilities.py)
    export_encoding: str = "f32"  # how the exported weights are written (export.plan.ENCODINGS)
    device: str = "auto"                 # see engines/training/device.py for the device and dtype rule
    dtype: str = "auto"
    save_dtype: str | None = None
    sharding: str = "auto"  # of GKD's models (engines/training/sharding.py)
    # Rounds of in-context refinement (engines/puzzle/search/refine.py); None: 3 when a child is built, else 0.
    refine: int | None = None

    def __post_init__(self) -> None:
        if self.export is not None:
            from mlxkit.engines.export.plan import check_options

            check_options(self.export, self.export_encoding)
        if self.engine is not None:
            from mlxkit.engines.serving.capabilities import get_engine

            get_engine(self.engine)  # an unknown name fails before any work
        if self.library is not None and self.recipe is not None:
            # The recipe fixes the search space of a library to build; a given library has its own.
            raise InputError(f"--recipe '{self.recipe}' builds a block library; --library '{self.library}' "
                             "already fixes the search space, so drop one of them")


def budgets_of(options: SearchOptions) -> tuple[Budgets, bool]:
    """The user's budgets; with none given, a 1.5x throughput target (and say so)."""
    given = any(v is not None for v in (options.throughput, options.memory, options.latency, options.params)) \
        or bool(options.extra_caps)
    budgets = Budgets.parse(memory=options.memory, throughput=options.throughput if given else DEFAULT_THROUGHPUT,
                            latency=options.latency, params=options.params, **options.extra_caps)
    return budgets, not given
