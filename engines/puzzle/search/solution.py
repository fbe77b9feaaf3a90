"""The solve stage: price the library, solve the MIP under the budgets (swept over batch sizes and refined
in context when asked), and describe the best solution and its alternatives as a typed `SolvedSearch`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlxkit.engines.core.atomic import atomic_write_json
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.hardware.profile import HardwareProfile
from mlxkit.engines.hardware.scenario import Scenario
from mlxkit.engines.models.decilm.blocks import BlockChoice, ParentShape, parent_attention, parent_ffn
from mlxkit.engines.puzzle.library.schema import BlockLibrary
from mlxkit.engines.puzzle.library.store import LibraryDir, read_library
from mlxkit.engines.puzzle.search.budgets import Budgets
from mlxkit.engines.puzzle.search.mip import SearchProblem, Solution, Solver, sweep_batch_sizes
from mlxkit.engines.puzzle.search.options import SearchOptions
from mlxkit.engines.puzzle.search.parent import SearchParent
from mlxkit.engines.puzzle.search.pricing import (LibraryCosts, library_problem, parent_choice_names, parent_totals,
                                                   price_library, solution_block_choices, stored_costs)
from mlxkit.engines.puzzle.search.refine import (ChildMeasurement, Corrections, RefinementResult, isolated_sum,
                                                  measure_child, refine, tokens_hash)
from mlxkit.engines.puzzle.search.serving_fit import check_attention_kept
from mlxkit.engines.training.device import Placement

@dataclass(frozen=True)
class SolvedSearch:
    """The solve stage's outcome: what was solved for, the best solution and its alternatives.

    Pricing and the MIP take seconds and are solved again on every run; their outcome reaches the
    later stages' keys through `choice_names` (the staged child's key).
    """

    target: str
    scenario: Scenario  # the batch included, after a sweep
    budgets: dict[str, Any]
    budgets_defaulted: bool
    caps: dict[str, float]
    library: Path
    metric: str
    costs: str
    best: Solution
    choices: list[BlockChoice]  # the best solution's block per layer
    objective_isolated: float
    # The kept child's KL as this target's in-context corrections estimate it (None without any).
    estimate_corrected: float | None
    corrected: bool  # chosen by a corrected solve
    solve_time_s: float
    predicted: dict[str, Any]
    alternatives: list[Solution]
    written: dict[str, str]  # --write-costs / --write-lp files
    batch_sweep: dict[int, Any] | None = None
    refinement: dict[str, Any] | None = None

    @property
    def choice_names(self) -> list[dict[str, Any]]:
        return [{"layer": i, "attention": c.attention.name, "ffn": c.ffn.name} for i, c in enumerate(self.choices)]

    def report(self) -> dict[str, Any]:
        """The solve's part of the search report (`--json`)."""
        report: dict[str, Any] = {
            "target": self.target, "scenario": self.scenario.to_dict(), "budgets": self.budgets, "caps": self.caps,
            "budgets_defaulted": self.budgets_defaulted, "library": str(self.library), "metric": self.metric,
            "costs": self.costs, "objective": self.best.objective, "status": self.best.status,
            "objective_isolated": self.objective_isolated, "estimate_corrected": self.estimate_corrected,
            "corrected": self.corrected, "solve_time_s": self.solve_time_s, "choices": self.choice_names,
            "predicted": self.predicted,
            "alternatives": [{"objective": s.objective, "totals": s.totals, "choices": s.choices,
                              "distance_from_best": s.distance(self.best)} for s in self.alternatives],
            **self.written,
        }
        if self.batch_sweep is not None:
            report["batch_sweep"] = self.batch_sweep
        if self.refinement is not None:
            report["refinement"] = self.refinement
        return report


def solve_search(options: SearchOptions, library: BlockLibrary, library_path: Path, shape: ParentShape | None,
           profile: HardwareProfile, scenario: Scenario, budgets: Budgets, defaulted: bool, reporter: Reporter,
           placement: Placement, parent: SearchParent | None) -> SolvedSearch:
    """Price the library, solve the MIP (refined in context when asked) and describe the best solution
    (rank 0's stage)."""
    stored = stored_costs(library) if options.costs == "library" else None

    def price(batch: int) -> LibraryCosts:
        # The stored stats stand for whatever they were measured for; only profile prices follow the batch.
        return stored if stored is not None else price_library(library, profile, scenario.with_batch(batch), shape)

    def make(batch: int) -> tuple[SearchProblem, dict[str, float]]:
        tokens = scenario.with_batch(batch).tokens
        problem = library_problem(library, price(batch), metric=options.metric, tokens=tokens)
        return problem, budgets.constraints(tokens, parent_totals(problem, shape).get("runtime_ms"))

    t0 = time.perf_counter()
    sweep_report = None
    if options.batch_sweep:
        sweep = sweep_batch_sizes(make, options.batch_sweep)
        scenario = scenario.with_batch(sweep.best_batch)
        sweep_report = {b: (s.objective if isinstance(s, Solution) else s) for b, s in sweep.per_batch.items()}
    costs = price(scenario.batch)
    problem, caps = make(scenario.batch)
    held_out = _held_out_scoring(options, library, library_path, problem)
    rounds = options.refine if options.refine is not None else (3 if options.out is not None else 0)
    sampled = library.calibration is not None and library.calibration.startswith("sampled")
    if options.refine is None and rounds and sampled and held_out is not None:
        # Measured: on text sampled from the parent, refining chose children that were better on that
        # text and much worse on real text (BENCHMARKS.md, "In-context refinement").
        rounds = 0
        reporter.notice("not refining by default: the library was calibrated on text sampled from the parent, "
                        "where refinement chose children worse on real text; --refine N forces it, and a "
                        "library built with --data refines by default")
    refining = bool(rounds) and held_out is not None
    # Every search solves on the isolated scores first: a refining one then measures and corrects, so the
    # same command gives the same child whatever ran before it; one that does not refine only estimates
    # its child with this target's last corrections (measured: they predict a child's KL better than the
    # isolated sum, but a solve on corrections from another budget's child can pick a worse child).
    corrections = (Corrections.read(held_out.root, options.metric, held_out.tokens_hash, profile.name)
                   if held_out is not None and not refining else None)
    parents = parent_choice_names(problem, shape)
    solver = Solver.build(problem)
    # Written before solving, so that an infeasible budget can be inspected too.
    written = _write_costs_and_lp(options, costs, solver, caps)
    min_distance = options.min_distance or max(1, round(0.2 * len(problem.layers)))
    solutions = solver.solve_many(caps, k=options.solutions, min_distance=min_distance)
    solve_s = time.perf_counter() - t0
    parent_stats = parent_totals(problem, shape)
    best = solutions[0]
    refinement = None
    if refining:
        assert held_out is not None
        corrections = Corrections(options.metric, held_out.tokens_hash, profile.name)
        assert parent is not None  # held_out needs trained blocks, so the library records its parent
        outcome = refine(problem, lambda p: Solver.build(p).solve(caps), _child_measurer(held_out, parent, reporter),
                         parents, corrections, max_rounds=rounds, first=best)
        corrections.write(held_out.root)
        solved = corrections.corrected(problem, parents)
        best = outcome.solution
        solutions = [best] + [s for s in Solver.build(solved).solve_many(caps, k=options.solutions,
                                                                          min_distance=min_distance)
                              if s.choices != best.choices][:options.solutions - 1]
        refinement = outcome.to_dict()
        _announce_refinement(outcome, reporter)
    elif options.refine and held_out is None:
        reporter.notice("--refine skipped: it needs a library with trained blocks and its held-out tokens, "
                        "scored by a loss (kl_div or lm_loss)")
    choices = solution_block_choices(best)
    check_attention_kept(choices, options)

    return SolvedSearch(
        target=profile.name, scenario=scenario, budgets=budgets.describe(), budgets_defaulted=defaulted, caps=caps,
        library=library_path, metric=options.metric, costs=options.costs, best=best, choices=choices,
        objective_isolated=isolated_sum(problem, best),
        estimate_corrected=isolated_sum(corrections.corrected(problem, parents), best) if corrections else None,
        corrected=refinement is not None and refinement["best_round"] > 0, solve_time_s=round(solve_s, 3),
        predicted=_predicted(best.totals, parent_stats, scenario, profile), alternatives=solutions[1:],
        written=written, batch_sweep=sweep_report, refinement=refinement)


@dataclass(frozen=True)
class _HeldOutScoring:
    """The library's directory and the held-out tokens its variants were scored on."""

    root: Path
    val_ids: torch.Tensor
    tokens_hash: str


def _held_out_scoring(options: SearchOptions, library: BlockLibrary, library_path: Path,
                      problem: SearchProblem) -> _HeldOutScoring | None:
    """What in-context refinement needs, or None where it cannot run: no trained blocks (an NVlabs demo
    library), no held-out tokens kept, or a bigger-is-better metric."""
    if not library.has_trained_blocks or problem.bigger_is_better:
        return None
    val = held_out_tokens(library_path, options.eval_sequences)
    return None if val is None else _HeldOutScoring(library_root(library_path).root, val, tokens_hash(val))


def library_root(library_path: Path) -> LibraryDir:
    return LibraryDir(library_path if library_path.is_dir() else library_path.parent)


def held_out_tokens(library_path: Path, sequences: int) -> torch.Tensor | None:
    """The first `sequences` held-out sequences the library was scored on (None where it kept none)."""
    tokens_file = library_root(library_path).work / "tokens.pt"
    if not tokens_file.exists():
        return None
    return torch.load(tokens_file, weights_only=True)["val"][:sequences]


def _child_measurer(held_out: _HeldOutScoring, search_parent: SearchParent, reporter: Reporter):
    """`measure(solution)` for `refine`: the solution's child assembled and measured against the parent."""
    from mlxkit.engines.puzzle.search.assemble import assemble_child

    library = read_library(held_out.root)
    assert library.parent is not None
    round_index = 0

    def measure(solution: Solution) -> ChildMeasurement:
        nonlocal round_index
        round_index += 1
        parent = search_parent.converted
        choices = solution_block_choices(solution)
        child = assemble_child(parent, LibraryDir(held_out.root), choices).eval()
        replaced = sum((c.attention != parent_attention(library.parent.shape))
                       + (c.ffn != parent_ffn(library.parent.shape)) for c in choices)
        with reporter.task(f"refinement round {round_index}: the child's {replaced} replaced subblocks in context",
                           total=replaced) as task:
            return measure_child(parent, child, choices, held_out.val_ids, on_subblock=task.advance)

    return measure


def _announce_refinement(outcome: RefinementResult, reporter: Reporter) -> None:
    for index, entry in enumerate(outcome.rounds):
        reporter.notice(f"refinement round {index + 1}: predicted KL {entry.predicted_isolated:.4f} from isolated "
                        f"scores, {entry.predicted_corrected:.4f} corrected; measured {entry.measured:.4f}")
    reporter.notice(f"refinement kept round {outcome.best_round + 1}'s child ({outcome.stopped})")


def _write_costs_and_lp(options: SearchOptions, costs: LibraryCosts, solver: Solver,
                        caps: dict[str, float]) -> dict[str, str]:
    written = {}
    if options.write_costs is not None:
        atomic_write_json(options.write_costs, costs.model_dump(mode="json", exclude_none=True))
        written["costs_file"] = str(options.write_costs)
    if options.write_lp is not None:
        written["lp_file"] = str(solver.write_lp(options.write_lp, caps))
    return written


def _predicted(totals: dict[str, float], parent: dict[str, float], scenario: Scenario,
               profile: HardwareProfile) -> dict[str, Any]:
    runtime, parent_runtime = totals.get("runtime_ms"), parent.get("runtime_ms")
    return {
        "memory_mib": totals.get("memory_mib"), "parent_memory_mib": parent.get("memory_mib"),
        "memory_capacity_mib": profile.capacity_mib,
        "runtime_ms": runtime, "parent_runtime_ms": parent_runtime,
        "tokens_per_s": scenario.tokens / runtime * 1e3 if runtime else None,
        "parent_tokens_per_s": scenario.tokens / parent_runtime * 1e3 if parent_runtime else None,
        "speedup": parent_runtime / runtime if runtime and parent_runtime else None,
        "num_params": totals.get("num_params"), "parent_num_params": parent.get("num_params"),
    }
