"""The Puzzle architecture search as a mixed-integer program (PuLP + CBC).

A grouped knapsack, following the paper (LANA-style): every layer has one or more
*groups* (decoupled: an attention group and an FFN group; NVlabs demo format: one group of
combined block variants), each group picks exactly one *option*, and each option carries
a score (a replace-1-block metric such as KL) and linear costs (`memory_mib`,
`runtime_ms`, `num_params`, ...). Non-block costs (embeddings, LM head, workspace) are a
constant added to every total.

    minimise   Σ score · x             (maximise for bigger-is-better metrics)
    subject to Σ_j x_gj = 1            for every group g
               fixed[s] + Σ cost_s · x ≤ cap_s   for every constrained stat s

Build once, solve many: `Solver.build(problem)` creates the binaries, the one-hot rows and
the objective once; `.solve(caps)` adds the cap rows, solves and drops them again, so a
budget sweep or a batch sweep reuses the model. `.write_lp(path, caps)` writes the model
with its cap rows in the LP file format, for inspection or another solver.

Errors and warnings: caps that no architecture can meet raise `InfeasibleError` naming the
best value each cap's stat can reach on its own; a time-limited solve returns its incumbent
with `status="feasible"` and emits `SolverWarning`; a time limit reached before any
solution was found raises `BackendError` (nothing is known about feasibility then).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from mlxkit.engines.core.atomic import atomic_file
from mlxkit.engines.errors import BackendError, InfeasibleError, InputError


class SolverWarning(UserWarning):
    """A solve stopped early (time limit) or returned fewer diverse solutions than asked for."""


class _NoSolutionInTime(Exception):
    """CBC hit its time limit before finding any solution (internal: mapped to BackendError or a warning)."""


@contextlib.contextmanager
def _quiet_pulp():
    """PuLP 3.x deprecates the 2.x API (LpVariable(), PULP_CBC_CMD, the constraints mapping) in favour
    of 4.0 names that 2.x lacks; we support both, so its DeprecationWarnings are noise for users."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"pulp(\..*)?")
        yield


@dataclass(frozen=True)
class Option:
    """One choice within a group: a named variant with its score and its additive costs."""

    name: str
    score: float
    costs: Mapping[str, float]
    meta: Mapping[str, Any] | None = field(default=None, compare=False)  # e.g. the library's original name
    removes: bool = False  # the option computes nothing (a no_op subblock, or a block of two)


@dataclass(frozen=True)
class Group:
    """The options of one layer's subblock (`kind` = "attention", "ffn") or whole block (`kind` = "block")."""

    layer: int
    kind: str
    options: tuple[Option, ...]

    def __post_init__(self) -> None:
        if not self.options:
            raise InputError(f"layer {self.layer} {self.kind}: no options to choose from")
        names = [o.name for o in self.options]
        if len(set(names)) != len(names):
            raise InputError(f"layer {self.layer} {self.kind}: duplicate option names")
        for option in self.options:
            if not math.isfinite(option.score):
                raise InputError(f"layer {self.layer} {self.kind} option {option.name}: score is not finite")


@dataclass
class SearchProblem:
    """Groups of options, constant non-block costs, and the direction of the score.

    `tokens` (batch × (in + out) of the scenario the costs were priced for) is optional and
    only used to phrase runtime caps as throughput in messages.
    """

    groups: list[Group]
    fixed_costs: dict[str, float] = field(default_factory=dict)
    bigger_is_better: bool = False
    metric: str = "score"
    tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.groups:
            raise InputError("the search problem has no layers")
        if all(o.removes for g in self.groups for o in g.options):
            raise InputError("every option of every layer removes its subblock: no child would compute anything")
        seen = set()
        for g in self.groups:
            if (g.layer, g.kind) in seen:
                raise InputError(f"layer {g.layer} has two '{g.kind}' groups")
            seen.add((g.layer, g.kind))

    @property
    def layers(self) -> list[int]:
        return sorted({g.layer for g in self.groups})

    @property
    def num_options(self) -> int:
        return sum(len(g.options) for g in self.groups)

    def reachable(self, stat: str, best: str = "min") -> float:
        """The smallest (or largest) total of `stat` any architecture reaches, ignoring other caps."""
        pick = min if best == "min" else max
        return self.fixed_costs.get(stat, 0.0) + sum(pick(o.costs.get(stat, 0.0) for o in g.options)
                                                     for g in self.groups)

    def totals(self, picks: Mapping[tuple[int, str], str]) -> dict[str, float]:
        """Summed costs (fixed included) of an assignment `{(layer, kind): option name}`."""
        out = dict(self.fixed_costs)
        for g in self.groups:
            option = _option(g, picks[(g.layer, g.kind)])
            for stat, value in option.costs.items():
                out[stat] = out.get(stat, 0.0) + value
        return out

    def objective(self, picks: Mapping[tuple[int, str], str]) -> float:
        return sum(_option(g, picks[(g.layer, g.kind)]).score for g in self.groups)


@dataclass(frozen=True)
class Solution:
    """One architecture: per layer, the chosen option of each group."""

    choices: list[dict[str, Any]]  # [{"layer": i, "attention": "kv1", "ffn": "ffn768"}, ...] in layer order
    objective: float
    totals: dict[str, float]
    status: str  # "optimal" or "feasible" (time limit hit)
    solve_time_s: float

    @property
    def picks(self) -> dict[tuple[int, str], str]:
        return {(c["layer"], k): v for c in self.choices for k, v in c.items() if k != "layer"}

    def distance(self, other: "Solution") -> int:
        """Hamming distance in layers: how many layers differ in any group."""
        mine = {c["layer"]: c for c in self.choices}
        return sum(1 for c in other.choices if mine.get(c["layer"]) != c)

    def to_dict(self) -> dict[str, Any]:
        return {"choices": self.choices, "objective": self.objective, "totals": self.totals,
                "status": self.status, "solve_time_s": self.solve_time_s}


class Solver:
    """A PuLP/CBC model of one `SearchProblem`, built once and solved for many caps.

    Example
    -------
    >>> solver = Solver.build(problem)
    >>> best = solver.solve({"memory_mib": 80 * 1024, "runtime_ms": 30_000})
    >>> diverse = solver.solve_many({"memory_mib": 80 * 1024}, k=3, min_distance=8)
    """

    def __init__(self, problem: SearchProblem, model: Any, x: dict[tuple[int, int], Any],
                 time_limit_s: float | None, threads: int | None, gap: float | None) -> None:
        self.problem, self._model, self._x = problem, model, x
        self.time_limit_s, self.threads, self.gap = time_limit_s, threads, gap
        self._counter = 0

    @classmethod
    def build(cls, problem: SearchProblem, *, time_limit_s: float | None = 60.0, threads: int | None = None,
              gap: float | None = None, prune_dominated: bool = True) -> "Solver":
        """Create the binaries, one-hot rows and objective.

        `time_limit_s` is the default limit per solve (the NVlabs demo's default is 60 s);
        `gap` is CBC's relative optimality gap (None: CBC's default, i.e. proven optimal).
        `prune_dominated` leaves out options that another option of the same group beats on
        score and on every cost; optima are unchanged, and diverse alternatives are drawn
        from the undominated options only.
        """
        import pulp

        with _quiet_pulp():
            return cls._build(pulp, problem, time_limit_s, threads, gap, prune_dominated)

    @classmethod
    def _build(cls, pulp: Any, problem: SearchProblem, time_limit_s: float | None, threads: int | None,
               gap: float | None, prune_dominated: bool) -> "Solver":
        model = pulp.LpProblem("puzzle", pulp.LpMaximize if problem.bigger_is_better else pulp.LpMinimize)
        x: dict[tuple[int, int], Any] = {}
        used: set[str] = set()
        for gi, group in enumerate(problem.groups):
            # Dominated options (another option scores no worse and costs no more on every stat)
            # never appear in an optimum; leaving them out shrinks CBC's search several-fold.
            keep = _undominated(group, problem.bigger_is_better) if prune_dominated else range(len(group.options))
            for oi in keep:
                x[(gi, oi)] = pulp.LpVariable(_variable_name(group, oi, used), cat=pulp.LpBinary)
            model += (pulp.lpSum(x[(gi, oi)] for oi in keep) == 1, f"one_L{group.layer}_{group.kind}")
        if any(o.removes for g in problem.groups for o in g.options):
            # A child that computes nothing (every layer removed) is excluded from the space: it is
            # never an answer, however well its library stats or score fit the caps.
            model += (pulp.lpSum(var for (gi, oi), var in x.items() if not problem.groups[gi].options[oi].removes)
                      >= 1, "keep_one_subblock")
        model += pulp.LpAffineExpression([(var, problem.groups[gi].options[oi].score) for (gi, oi), var in x.items()])
        return cls(problem, model, x, time_limit_s, threads, gap)

    @property
    def num_binaries(self) -> int:
        """Binaries in the model (options left after pruning dominated ones)."""
        return len(self._x)

    def write_lp(self, path: str | os.PathLike, caps: Mapping[str, float]) -> Path:
        """Write the model with the cap rows for `caps` in the LP file format (PuLP's `writeLP`).

        Variables are named `L<layer>_<kind>_<option>`; one-hot rows `one_L<layer>_<kind>`;
        cap rows `cap_<stat>`, whose right-hand side is the cap minus the fixed (non-block) cost.
        """
        self._check_cap_values(caps)
        path = Path(path)
        with _quiet_pulp(), self._working_copy():
            self._add_cap_rows(caps)
            with atomic_file(path) as tmp:
                self._model.writeLP(str(tmp))
        return path

    # ---- public solves

    def solve(self, caps: Mapping[str, float], *, time_limit_s: float | None = None) -> Solution:
        """The best architecture under `caps` (`{stat: upper bound}`, fixed costs included).

        Raises
        ------
        InfeasibleError
            When no architecture meets the caps; the message gives the best value each capped
            stat can reach on its own.
        """
        return self.solve_many(caps, k=1, time_limit_s=time_limit_s)[0]

    def solve_many(self, caps: Mapping[str, float], *, k: int = 1, min_distance: int = 1,
                   time_limit_s: float | None = None) -> list[Solution]:
        """Up to `k` solutions, best first, each differing from all earlier ones in ≥ `min_distance` layers.

        Returns fewer than `k` (with a `SolverWarning`) when the diversity rows make the
        problem infeasible; raises `InfeasibleError` if even the first is infeasible.
        """
        if k < 1:
            raise InputError(f"number of solutions must be ≥ 1 (got {k})")
        layers = self.problem.layers
        if not 1 <= min_distance <= len(layers):
            raise InputError(f"minimum distance must be between 1 and {len(layers)} layers (got {min_distance})")
        self._check_caps(caps)
        solutions: list[Solution] = []
        with _quiet_pulp(), self._working_copy():
            self._add_cap_rows(caps)
            for index in range(k):
                try:
                    solution = self._solve_once(time_limit_s)
                except _NoSolutionInTime as exc:
                    if index == 0:
                        raise BackendError(str(exc)) from None
                    warnings.warn(f"only {index} of {k} diverse solutions: {exc}", SolverWarning, stacklevel=2)
                    break
                if solution is None:
                    if index == 0:
                        raise InfeasibleError(self._infeasible_message(caps, joint=True))
                    warnings.warn(f"only {index} of {k} solutions differ in ≥ {min_distance} layers under these caps",
                                  SolverWarning, stacklevel=2)
                    break
                solutions.append(solution)
                if index + 1 < k:
                    self._add_diversity_row(solution, len(layers) - min_distance)
        return solutions

    # ---- internals

    def _check_caps(self, caps: Mapping[str, float]) -> None:
        self._check_cap_values(caps)
        if any(self.problem.reachable(stat) > bound for stat, bound in caps.items()):
            raise InfeasibleError(self._infeasible_message(caps, joint=False))

    def _check_cap_values(self, caps: Mapping[str, float]) -> None:
        for stat, bound in caps.items():
            if not isinstance(bound, (int, float)) or math.isnan(bound):
                raise InputError(f"cap on {stat} must be a number (got {bound!r})")
            if not any(stat in o.costs for g in self.problem.groups for o in g.options) and stat not in self.problem.fixed_costs:
                raise InputError(f"no option has a '{stat}' stat, so it cannot be capped; "
                                 f"known stats: {', '.join(sorted(self._known_stats()))}")

    def _known_stats(self) -> set[str]:
        return {s for g in self.problem.groups for o in g.options for s in o.costs} | set(self.problem.fixed_costs)

    def _add_cap_rows(self, caps: Mapping[str, float]) -> None:
        import pulp

        for stat, bound in caps.items():
            terms = [(var, self.problem.groups[gi].options[oi].costs.get(stat, 0.0))
                     for (gi, oi), var in self._x.items() if self.problem.groups[gi].options[oi].costs.get(stat, 0.0)]
            rhs = bound - self.problem.fixed_costs.get(stat, 0.0)
            self._model += (pulp.LpAffineExpression(terms) <= rhs, f"cap_{_safe(stat)}")

    def _add_diversity_row(self, solution: Solution, max_same: int) -> None:
        """Σ_layers same_i ≤ L − d, where same_i = 1 iff every group of layer i repeats its pick."""
        import pulp

        picks = solution.picks
        by_layer: dict[int, list[Any]] = {}
        for gi, g in enumerate(self.problem.groups):
            oi = next(i for i, o in enumerate(g.options) if o.name == picks[(g.layer, g.kind)])
            by_layer.setdefault(g.layer, []).append(self._x[(gi, oi)])
        same_terms = []
        self._counter += 1
        for layer, chosen in by_layer.items():
            if len(chosen) == 1:
                same_terms.append(chosen[0])
                continue
            # same ≥ Σ chosen − (G − 1): forced to 1 when all groups repeat; free to be 0 otherwise.
            same = pulp.LpVariable(f"same_{self._counter}_{layer}", lowBound=0, upBound=1)
            self._add_row(same - pulp.lpSum(chosen) >= 1 - len(chosen), "same")
            same_terms.append(same)
        self._add_row(pulp.lpSum(same_terms) <= max_same, "div")

    def _add_row(self, row: Any, prefix: str) -> None:
        self._counter += 1
        self._model += (row, f"{prefix}_{self._counter}")

    @contextlib.contextmanager
    def _working_copy(self):
        """Cap and diversity rows go on a shallow copy that lives for one `solve_many` call.

        The copy shares the binaries, one-hot rows and objective with the built model, so
        nothing is rebuilt; dropping it drops the rows and any auxiliary variables (PuLP 3
        keeps variables registered on a model, so deleting rows in place would leave orphans).
        """
        built = self._model
        self._model = built.copy()
        try:
            yield
        finally:
            self._model = built

    def _solve_once(self, time_limit_s: float | None) -> Solution | None:
        import pulp

        limit = time_limit_s if time_limit_s is not None else self.time_limit_s
        try:
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=limit, threads=self.threads, gapRel=self.gap)
        except pulp.PulpSolverError as exc:  # pragma: no cover - pulp ships CBC
            raise BackendError(f"the CBC solver is not available: {exc}") from exc
        start = time.perf_counter()
        try:
            self._model.solve(solver)
        except pulp.PulpSolverError as exc:
            raise BackendError(f"CBC failed: {exc}") from exc
        elapsed = time.perf_counter() - start
        sol_status = getattr(self._model, "sol_status", None)
        if self._model.status == pulp.LpStatusInfeasible or sol_status == pulp.LpSolutionInfeasible:
            return None  # proven: no architecture meets the rows
        if self._model.status != pulp.LpStatusOptimal or sol_status == pulp.LpSolutionNoSolutionFound:
            # CBC stopped (time limit) before any incumbent: neither a solution nor a proof of infeasibility.
            within = f"within the {limit:g} s time limit" if limit else "before it stopped"
            raise _NoSolutionInTime(f"CBC found no architecture {within}, and did not prove that none exists; "
                                    "allow the solver more time")
        picks: dict[tuple[int, str], str] = {}
        for gi, g in enumerate(self.problem.groups):
            values = {oi: (self._x[(gi, oi)].value() or 0.0) for oi in range(len(g.options)) if (gi, oi) in self._x}
            best = max(values, key=values.__getitem__)
            picks[(g.layer, g.kind)] = g.options[best].name
        status = "optimal" if sol_status in (None, pulp.LpSolutionOptimal) else "feasible"
        if status == "feasible":
            stopped = f"at the {limit:g} s time limit" if limit else "early (optimality gap)"
            warnings.warn(f"CBC stopped {stopped}; the solution may not be optimal", SolverWarning, stacklevel=3)
        choices = []
        for layer in self.problem.layers:
            entry: dict[str, Any] = {"layer": layer}
            entry.update({kind: name for (lay, kind), name in picks.items() if lay == layer})
            choices.append(entry)
        return Solution(choices, self.problem.objective(picks), self.problem.totals(picks), status, elapsed)

    def _infeasible_message(self, caps: Mapping[str, float], joint: bool) -> str:
        parts = []
        for stat, bound in caps.items():
            best = self.problem.reachable(stat)
            cap_text = describe_cap(stat, bound, self.problem.tokens)
            if best > bound:
                parts.append(f"{cap_text} is infeasible: the {_smallest(stat)} reachable is "
                             f"{describe_value(stat, best, self.problem.tokens)}")
            elif joint:
                parts.append(f"{cap_text} (alone reachable: {describe_value(stat, best, self.problem.tokens)})")
        if joint:
            return ("no architecture meets all caps together (a child keeps at least one attention or FFN "
                    "subblock): " + "; ".join(parts))
        return "; ".join(parts)


def solve(problem: SearchProblem, caps: Mapping[str, float], **kwargs: Any) -> Solution:
    """One-shot `Solver.build(problem).solve(caps)`."""
    return Solver.build(problem).solve(caps, **kwargs)


# --------------------------------------------------------------------------- batch sweep

@dataclass(frozen=True)
class SweepResult:
    best_batch: int
    best: Solution
    per_batch: dict[int, Solution | str]  # a Solution, or the infeasibility message


def sweep_batch_sizes(make: Callable[[int], tuple[SearchProblem, Mapping[str, float]]], batches: Iterable[int],
                      **solve_kwargs: Any) -> SweepResult:
    """Re-price and solve for each batch size; keep the best objective (paper App. B).

    `make(batch)` returns the problem priced at that batch and its caps (a throughput
    target becomes a different runtime cap at each batch). Ties go to the larger batch,
    which serves more tokens per second.

    Raises
    ------
    InfeasibleError
        When no batch size is feasible; the message lists each batch's reason.
    """
    per_batch: dict[int, Solution | str] = {}
    best: tuple[int, Solution] | None = None
    for batch in sorted(set(batches)):
        problem, caps = make(batch)
        try:
            solution = Solver.build(problem).solve(caps, **solve_kwargs)
        except InfeasibleError as exc:
            per_batch[batch] = str(exc)
            continue
        per_batch[batch] = solution
        better = (best is None or (solution.objective > best[1].objective + 1e-12 if problem.bigger_is_better
                                   else solution.objective < best[1].objective - 1e-12)
                  or abs(solution.objective - best[1].objective) <= 1e-12)
        if better:
            best = (batch, solution)
    if best is None:
        reasons = "; ".join(f"batch {b}: {m}" for b, m in per_batch.items())
        raise InfeasibleError(f"no batch size is feasible ({reasons})")
    return SweepResult(best[0], best[1], per_batch)


# --------------------------------------------------------------------------- messages

def _smallest(stat: str) -> str:
    return "fastest" if stat.endswith("runtime_ms") or stat.endswith("_ms") else "smallest"


def describe_value(stat: str, value: float, tokens: int | None = None) -> str:
    """Human units: GiB for memory, s/ms for runtimes (+ tok/s when known), B/M for params."""
    if stat.endswith("memory_mib"):
        return f"{value / 1024:.1f} GiB" if value >= 1024 else f"{value:.1f} MiB"
    if stat.endswith("_ms"):
        text = f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.3g} ms"
        if stat == "runtime_ms" and tokens and value > 0:
            text += f" ({tokens / (value / 1e3):,.0f} tok/s)"
        return text
    if stat.endswith("num_params"):
        return f"{value / 1e9:.2f}B" if value >= 1e9 else f"{value / 1e6:.1f}M"
    return f"{value:g}"


def describe_cap(stat: str, bound: float, tokens: int | None = None) -> str:
    label = {"memory_mib": "memory", "runtime_ms": "runtime", "num_params": "parameters"}.get(stat, stat)
    return f"{label} ≤ {describe_value(stat, bound, tokens)}"


def _undominated(group: Group, bigger_is_better: bool) -> list[int]:
    """Indices of the options no other option beats on score and on every cost (first of equals kept).

    Options that remove their subblock are compared only with each other, so a computing option
    survives for the row that keeps at least one.
    """
    stats = sorted({s for o in group.options for s in o.costs})
    sign = -1.0 if bigger_is_better else 1.0
    vectors = [(sign * o.score, *(o.costs.get(s, 0.0) for s in stats)) for o in group.options]
    keep = []
    for i, vi in enumerate(vectors):
        dominated = False
        for j, vj in enumerate(vectors):
            if j == i or any(a > b for a, b in zip(vj, vi)) or group.options[j].removes != group.options[i].removes:
                continue
            if vj != vi or j < i:  # strictly better somewhere, or an identical option listed earlier
                dominated = True
                break
        if not dominated:
            keep.append(i)
    return keep


def _safe(text: str) -> str:
    """`text` with every character LP files do not allow in names replaced by `_`."""
    return re.sub(r"[^A-Za-z0-9_]", "_", text)


def _variable_name(group: Group, index: int, used: set[str]) -> str:
    """`L<layer>_<kind>_<option>`, made unique when two option names differ only in unsafe characters."""
    name = f"L{group.layer}_{group.kind}_{_safe(group.options[index].name)}"
    if name in used:
        name = f"{name}_{index}"
    used.add(name)
    return name


def _option(group: Group, name: str) -> Option:
    for option in group.options:
        if option.name == name:
            return option
    raise InputError(f"layer {group.layer} {group.kind} has no option '{name}'")


def decoupled_problem(layers: Sequence[Mapping[str, Mapping[str, tuple[float, Mapping[str, float]]]]], *,
                      fixed_costs: Mapping[str, float] | None = None, bigger_is_better: bool = False,
                      metric: str = "score", tokens: int | None = None) -> SearchProblem:
    """Build a problem from ``[{"attention": {name: (score, costs)}, "ffn": {...}}, ...]`` (one dict per layer)."""
    groups = [Group(i, kind, tuple(Option(name, float(score), dict(costs)) for name, (score, costs) in options.items()))
              for i, layer in enumerate(layers) for kind, options in layer.items()]
    return SearchProblem(groups, dict(fixed_costs or {}), bigger_is_better, metric, tokens)
