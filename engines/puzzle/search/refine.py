"""In-context refinement of the MIP's scores: measure the chosen child, correct, solve again.

Replace-1-block scores are measured with every other layer the parent's, so their sum
under-predicts a child that replaces many blocks: the errors of replaced attention layers
compound. After a solve, the assembled child is measured on the library's held-out tokens,
and so is the child with each replaced subblock put back to the parent's (one swap at a
time). The KL a replaced subblock adds in that context, Δ = KL(child) − KL(child with the
parent's subblock there), replaces its isolated score; every option not measured in context
has its isolated score scaled by how much the last child's KL exceeded its summed scores.
The corrected problem is solved again, and the loop stops when the choice repeats or after
`max_rounds` measured children. The child with the lowest measured KL is kept.

The corrections of the last refining search for a hardware target are written beside the library
(`refinement-<target>.json`), keyed by the metric and the held-out tokens; searches on that library
for the same target that do not refine (a `--dry-run`, a frontier, `--refine 0`) solve with them.
Another target's children replace other blocks (a CPU child prunes FFNs, an H100 child replaces
attention), and corrections measured in one such context mislead the solve in the other, so
they are never shared across targets. A refining search always starts from
the isolated scores, so the same command gives the same child whatever ran before it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from mlxkit.engines.core.atomic import atomic_write_json
from mlxkit.engines.eval.metrics import kl_from_log_probs
from mlxkit.engines.models.decilm.blocks import BlockChoice, ParentShape, parent_attention, parent_ffn
from mlxkit.engines.models.decilm.modeling_mlx_decilm import SUBBLOCK_MODULES
from mlxkit.engines.puzzle.search.mip import Group, Option, SearchProblem, Solution

REFINEMENT_FORMAT = 2
SubblockKey = tuple[int, str]  # (layer, "attention" | "ffn")


@dataclass(frozen=True)
class ChildMeasurement:
    """One assembled child on the held-out tokens: its KL, and what each replaced subblock adds to it."""

    child_kl: float
    contributions: dict[SubblockKey, float]  # Δ of each subblock that is not the parent's
    chosen: dict[SubblockKey, str]           # the option name of each of those subblocks


@dataclass
class Corrections:
    """In-context scores of measured options, and the factor for every other non-parent option."""

    metric: str
    tokens_hash: str
    target: str
    in_context: dict[str, float] = field(default_factory=dict)  # "layer:kind:option" -> Δ
    scale: float = 1.0  # KL(last child) / Σ its isolated scores

    @staticmethod
    def key(layer: int, kind: str, option: str) -> str:
        return f"{layer}:{kind}:{option}"

    def update(self, measurement: ChildMeasurement, isolated_sum: float) -> None:
        for (layer, kind), delta in measurement.contributions.items():
            # A replacement that costs nothing in context (or helps, within noise) is free, never a reward.
            self.in_context[self.key(layer, kind, measurement.chosen[(layer, kind)])] = max(0.0, delta)
        if isolated_sum > 0:
            self.scale = measurement.child_kl / isolated_sum

    def corrected(self, problem: SearchProblem, parent_names: dict[tuple[int, str], str]) -> SearchProblem:
        """`problem` with corrected scores: parent options keep theirs (zero), measured ones take Δ, the rest scale."""
        groups = []
        for group in problem.groups:
            options = []
            for option in group.options:
                score = option.score
                if option.name != parent_names.get((group.layer, group.kind)):
                    score = self.in_context.get(self.key(group.layer, group.kind, option.name), score * self.scale)
                options.append(Option(option.name, score, option.costs, option.meta, option.removes))
            groups.append(Group(group.layer, group.kind, tuple(options)))
        return SearchProblem(groups, dict(problem.fixed_costs), problem.bigger_is_better, problem.metric,
                             problem.tokens)

    def to_json(self) -> dict[str, Any]:
        return {"format": REFINEMENT_FORMAT, "metric": self.metric, "tokens_hash": self.tokens_hash,
                "target": self.target, "scale": self.scale, "in_context": self.in_context}

    @classmethod
    def read(cls, library_dir: Path, metric: str, tokens_hash: str, target: str) -> "Corrections | None":
        """The corrections written beside a library for this metric, these held-out tokens and this target."""
        path = refinement_file(library_dir, target)
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            if (data.get("format") != REFINEMENT_FORMAT or data.get("metric") != metric
                    or data.get("tokens_hash") != tokens_hash or data.get("target") != target):
                return None
            scale = float(data["scale"])
            in_context = {str(k): float(v) for k, v in dict(data["in_context"]).items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # a damaged file is ignored: the isolated scores still stand
        if not math.isfinite(scale) or not all(math.isfinite(v) for v in in_context.values()):
            return None
        return cls(metric, tokens_hash, target, in_context, scale)

    def write(self, library_dir: Path) -> Path:
        path = refinement_file(library_dir, self.target)
        atomic_write_json(path, self.to_json())
        return path


def refinement_file(library_dir: Path, target: str) -> Path:
    """Where the corrections for `target` (a hardware profile's name) live beside a library."""
    return Path(library_dir) / f"refinement-{re.sub(r'[^A-Za-z0-9_.-]', '_', target)}.json"


def tokens_hash(ids: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()[:16]


# --------------------------------------------------------------------------- measuring a child in context

def _log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(model(input_ids=ids, use_cache=False).logits[:, :-1].float(), dim=-1)


def _swap(child_layer, source_layer, kind: str) -> tuple[Any, ...]:
    """Put `source_layer`'s `kind` subblock (and its norms) into `child_layer`; returns what was there."""
    saved = tuple(getattr(child_layer, name) for name in SUBBLOCK_MODULES[kind])
    for name in SUBBLOCK_MODULES[kind]:
        setattr(child_layer, name, getattr(source_layer, name))
    return saved


def _restore(child_layer, kind: str, saved: tuple[Any, ...]) -> None:
    for name, module in zip(SUBBLOCK_MODULES[kind], saved):
        setattr(child_layer, name, module)


@torch.inference_mode()
def measure_child(parent, child, choices: Sequence[BlockChoice], val_ids: torch.Tensor,
                  on_subblock: Callable[[], None] | None = None) -> ChildMeasurement:
    """KL(parent || child) on `val_ids` (mean over the positions with a next token), and for every
    subblock the child does not share with the parent, the KL it adds: the child's KL minus that of
    the child with the parent's subblock swapped back in. `parent` is the parent as an MlxDeciLM model."""
    shape = ParentShape.from_config(parent.config)
    ids = val_ids.to(next(parent.parameters()).device)
    reference = _log_probs(parent, ids)

    def kl() -> float:
        return float(kl_from_log_probs(reference, _log_probs(child, ids)).mean())

    child_kl = kl()
    contributions: dict[SubblockKey, float] = {}
    chosen: dict[SubblockKey, str] = {}
    for layer, choice in enumerate(choices):
        for kind, variant, parents in (("attention", choice.attention, parent_attention(shape)),
                                       ("ffn", choice.ffn, parent_ffn(shape))):
            if variant == parents:
                continue
            child_layer = child.model.layers[layer]
            saved = _swap(child_layer, parent.model.layers[layer], kind)
            try:
                contributions[(layer, kind)] = child_kl - kl()
                chosen[(layer, kind)] = variant.name
            finally:
                _restore(child_layer, kind, saved)
            if on_subblock is not None:
                on_subblock()
    return ChildMeasurement(child_kl, contributions, chosen)


# --------------------------------------------------------------------------- the loop

@dataclass
class RefinementRound:
    choices: list[dict[str, Any]]
    predicted_isolated: float   # Σ replace-1-block scores of this choice
    predicted_corrected: float  # the corrected estimate the solve that chose it had (round 0: isolated)
    measured: float             # the assembled child's KL on the held-out tokens
    objective_solved: float


@dataclass
class RefinementResult:
    best_round: int
    solution: Solution
    rounds: list[RefinementRound]
    corrections: Corrections
    stopped: str  # why the loop ended

    def to_dict(self) -> dict[str, Any]:
        return {"best_round": self.best_round, "stopped": self.stopped, "scale": self.corrections.scale,
                "rounds": [r.__dict__ for r in self.rounds]}


def refine(problem: SearchProblem, solve: Callable[[SearchProblem], Solution],
           measure: Callable[[Solution], ChildMeasurement], parent_names: dict[tuple[int, str], str],
           corrections: Corrections, *, max_rounds: int = 3,
           first: Solution | None = None) -> RefinementResult:
    """Solve, measure the child, correct the scores, and solve again, at most `max_rounds` measurements.

    `solve(problem)` returns the best solution under the caller's caps; `measure(solution)` assembles
    and measures its child. `corrections` may carry earlier in-context scores; it is updated in place.
    """
    if problem.bigger_is_better:
        raise ValueError("refinement corrects scores that add up to a loss (KL, NLL), not a bigger-is-better metric")
    rounds: list[RefinementRound] = []
    solutions: list[Solution] = []
    seen: list[list[dict[str, Any]]] = []
    solution = first if first is not None else solve(corrections.corrected(problem, parent_names))
    corrected_objective = solution.objective
    stopped = f"{max_rounds} rounds"
    for _ in range(max_rounds):
        measurement = measure(solution)
        isolated = isolated_sum(problem, solution)
        rounds.append(RefinementRound(solution.choices, isolated, corrected_objective, measurement.child_kl,
                                      solution.objective))
        solutions.append(solution)
        seen.append(solution.choices)
        corrections.update(measurement, isolated)
        if len(rounds) == max_rounds:
            break
        solution = solve(corrections.corrected(problem, parent_names))
        corrected_objective = solution.objective
        if solution.choices in seen:
            stopped = "the choice repeated"
            break
    best = min(range(len(rounds)), key=lambda k: rounds[k].measured)
    return RefinementResult(best, solutions[best], rounds, corrections, stopped)


def isolated_sum(problem: SearchProblem, solution: Solution) -> float:
    """Σ of the solution's options' scores in `problem` (the replace-1-block estimate of its child)."""
    scores = {(g.layer, g.kind, o.name): o.score for g in problem.groups for o in g.options}
    total = 0.0
    for entry in solution.choices:
        for kind in ("attention", "ffn", "block"):
            if kind in entry:
                total += scores[(entry["layer"], kind, entry[kind])]
    return total
