"""The Puzzle MIP: optimality against brute force, caps, infeasibility messages, diverse solutions, sweeps."""

from __future__ import annotations

import itertools
import random
import re
import warnings

import pytest

from conftest import lp_terms
from mlxkit.engines.errors import InfeasibleError, InputError
from mlxkit.engines.puzzle.search.budgets import Budgets
from mlxkit.engines.puzzle.search.mip import (Group, Option, SearchProblem, Solver, SolverWarning, decoupled_problem, solve,
                                       sweep_batch_sizes)

STATS = ("memory_mib", "runtime_ms", "num_params")


def _random_problem(seed: int, layers: int = 3, attention: int = 3, ffn: int = 3, decoupled: bool = True,
                    bigger_is_better: bool = False) -> SearchProblem:
    rng = random.Random(seed)

    def option(name: str, size: float) -> Option:
        # Bigger options cost more and score better, with noise, as in a real library.
        costs = {"memory_mib": 1000 * size * rng.uniform(0.8, 1.2), "runtime_ms": 50 * size * rng.uniform(0.7, 1.3),
                 "num_params": 1e8 * size}
        score = (1 - size) * rng.uniform(0.5, 2.0) + rng.uniform(0, 0.1)
        return Option(name, -score if bigger_is_better else score, costs)

    groups = []
    for layer in range(layers):
        a_sizes = [1.0] + sorted((rng.uniform(0, 1) for _ in range(attention - 1)), reverse=True)
        f_sizes = [1.0] + sorted((rng.uniform(0, 1) for _ in range(ffn - 1)), reverse=True)
        if decoupled:
            groups.append(Group(layer, "attention", tuple(option(f"a{i}", s) for i, s in enumerate(a_sizes))))
            groups.append(Group(layer, "ffn", tuple(option(f"f{i}", s) for i, s in enumerate(f_sizes))))
        else:
            groups.append(Group(layer, "block", tuple(option(f"a{i}+f{j}", (a + f) / 2)
                                                      for i, a in enumerate(a_sizes) for j, f in enumerate(f_sizes))))
    return SearchProblem(groups, {"memory_mib": 500.0, "runtime_ms": 5.0}, bigger_is_better=bigger_is_better)


def _brute_force(problem: SearchProblem, caps: dict[str, float], exclude=()) -> tuple[float, dict] | None:
    """Enumerate every architecture; `exclude` = (picks, min_distance) pairs to stay away from."""
    best = None
    keys = [(g.layer, g.kind) for g in problem.groups]
    for combo in itertools.product(*(g.options for g in problem.groups)):
        picks = {k: o.name for k, o in zip(keys, combo)}
        totals = problem.totals(picks)
        if any(totals.get(s, 0.0) > cap + 1e-9 for s, cap in caps.items()):
            continue
        if any(_layer_distance(picks, other) < d for other, d in exclude):
            continue
        value = problem.objective(picks)
        better = best is None or (value > best[0] if problem.bigger_is_better else value < best[0])
        if better:
            best = (value, picks)
    return best


def _layer_distance(a: dict, b: dict) -> int:
    layers = {layer for layer, _ in a}
    return sum(1 for layer in layers if any(a[k] != b[k] for k in a if k[0] == layer))


def _parent(problem: SearchProblem) -> dict[str, float]:
    return problem.totals({(g.layer, g.kind): g.options[0].name for g in problem.groups})


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mip_matches_brute_force(seed, decoupled):
    problem = _random_problem(seed, decoupled=decoupled)
    parent = _parent(problem)

    def cap(stat: str, fraction: float) -> float:  # a fraction of the way from the smallest reachable to the parent
        low = problem.reachable(stat)
        return low + fraction * (parent[stat] - low)

    solver = Solver.build(problem)  # built once, solved for every cap set
    cap_sets = [
        {"memory_mib": cap("memory_mib", 0.5)},
        {"runtime_ms": cap("runtime_ms", 0.3)},
        {"memory_mib": cap("memory_mib", 0.6), "runtime_ms": cap("runtime_ms", 0.5)},
        {"memory_mib": cap("memory_mib", 0.8), "num_params": cap("num_params", 0.4)},
        {},
    ]
    for caps in cap_sets:
        expected = _brute_force(problem, caps)
        assert expected is not None
        got = solver.solve(caps)
        assert got.status == "optimal"
        assert got.objective == pytest.approx(expected[0], abs=1e-6), caps
        for stat, cap in caps.items():
            assert got.totals[stat] <= cap + 1e-6
        assert got.totals == pytest.approx(problem.totals(got.picks))


def test_bigger_is_better_maximises():
    problem = _random_problem(5, bigger_is_better=True)
    caps = {"memory_mib": _parent(problem)["memory_mib"] * 0.75}
    expected = _brute_force(problem, caps)
    assert solve(problem, caps).objective == pytest.approx(expected[0], abs=1e-6)


def test_infeasible_caps_name_the_best_reachable_values():
    problem = _random_problem(3)
    smallest = problem.reachable("memory_mib")
    with pytest.raises(InfeasibleError) as err:
        Solver.build(problem).solve({"memory_mib": smallest * 0.5, "runtime_ms": 1e9})
    message = str(err.value)
    assert "memory ≤" in message and "is infeasible: the smallest reachable is" in message
    assert f"{smallest / 1024:.1f} GiB" in message or f"{smallest:.1f} MiB" in message
    assert "runtime" not in message  # only the cap that cannot be met is blamed
    with pytest.raises(InfeasibleError, match=r"runtime ≤ .* the fastest reachable is .*ms"):
        Solver.build(problem).solve({"runtime_ms": problem.reachable("runtime_ms") - 1})
    # In GiB, as users write it.
    big = SearchProblem([Group(0, "block", (Option("x", 0.0, {"memory_mib": 14.2 * 1024}),))])
    with pytest.raises(InfeasibleError, match=r"memory ≤ 10\.0 GiB is infeasible: the smallest reachable is 14\.2 GiB"):
        solve(big, {"memory_mib": 10 * 1024})


def test_jointly_infeasible_caps_are_reported():
    # Two layers, each either small-and-slow or fast-and-big: each cap alone is reachable, not both.
    groups = [Group(i, "block", (Option("small", 0.0, {"memory_mib": 1.0, "runtime_ms": 10.0}),
                                 Option("fast", 0.0, {"memory_mib": 10.0, "runtime_ms": 1.0}))) for i in range(2)]
    problem = SearchProblem(groups)
    with pytest.raises(InfeasibleError, match="no architecture meets all caps together.*alone reachable"):
        solve(problem, {"memory_mib": 5.0, "runtime_ms": 5.0})


def test_diverse_solutions_keep_a_minimum_hamming_distance():
    problem = _random_problem(7, layers=4, attention=2, ffn=3)
    caps = {"memory_mib": _parent(problem)["memory_mib"] * 0.8}
    # Brute force enumerates every option, so compare against the unpruned model here.
    solver = Solver.build(problem, prune_dominated=False)
    solutions = solver.solve_many(caps, k=3, min_distance=2)
    assert len(solutions) == 3
    for a, b in itertools.combinations(solutions, 2):
        assert a.distance(b) >= 2
    best = _brute_force(problem, caps)
    assert solutions[0].objective == pytest.approx(best[0], abs=1e-6)
    second = _brute_force(problem, caps, exclude=[(solutions[0].picks, 2)])
    assert solutions[1].objective == pytest.approx(second[0], abs=1e-6)
    third = _brute_force(problem, caps, exclude=[(solutions[0].picks, 2), (solutions[1].picks, 2)])
    assert solutions[2].objective == pytest.approx(third[0], abs=1e-6)
    assert solutions[0].objective <= solutions[1].objective <= solutions[2].objective
    # The diversity rows are gone afterwards: the same solver finds the optimum again.
    assert solver.solve(caps).objective == pytest.approx(best[0], abs=1e-6)
    # With dominated options pruned (the default) the optimum is the same and the distances hold.
    pruned = Solver.build(problem).solve_many(caps, k=3, min_distance=2)
    assert pruned[0].objective == pytest.approx(best[0], abs=1e-6)
    assert all(a.distance(b) >= 2 for a, b in itertools.combinations(pruned, 2))


def test_too_few_diverse_solutions_warn():
    groups = [Group(i, "block", (Option("a", 0.0, {"memory_mib": 2.0}), Option("b", 1.0, {"memory_mib": 1.0})))
              for i in range(2)]
    with pytest.warns(SolverWarning, match="only 2 of 5"):
        solutions = Solver.build(SearchProblem(groups)).solve_many({}, k=5, min_distance=2)
    assert len(solutions) == 2 and solutions[0].distance(solutions[1]) == 2


def test_bad_inputs_raise_input_errors():
    problem = _random_problem(0)
    solver = Solver.build(problem)
    with pytest.raises(InputError, match="known stats"):
        solver.solve({"watts": 3.0})
    with pytest.raises(InputError):
        solver.solve_many({}, k=0)
    with pytest.raises(InputError):
        solver.solve_many({}, k=2, min_distance=9)
    with pytest.raises(InputError, match="duplicate"):
        Group(0, "ffn", (Option("a", 0, {}), Option("a", 1, {})))
    # An option that is worse and no cheaper than another is left out of the model.
    dominated = Group(0, "ffn", (Option("a", 0.0, {"memory_mib": 1.0}), Option("b", 1.0, {"memory_mib": 1.0})))
    assert Solver.build(SearchProblem([dominated])).num_binaries == 1
    assert Solver.build(SearchProblem([dominated]), prune_dominated=False).num_binaries == 2
    with pytest.raises(InputError, match="two 'ffn' groups"):
        SearchProblem([Group(0, "ffn", (Option("a", 0, {}),)), Group(0, "ffn", (Option("b", 0, {}),))])


def test_batch_sweep_keeps_the_best_objective():
    layers = [{"attention": {"full": (0.0, {"kv_per_seq": 10.0, "weights": 5.0}),
                             "half": (0.3, {"kv_per_seq": 5.0, "weights": 3.0}),
                             "none": (2.0, {"kv_per_seq": 0.0, "weights": 0.0})},
               "ffn": {"full": (0.0, {"weights": 20.0}), "half": (0.5, {"weights": 10.0})}} for _ in range(2)]

    def make(batch: int):
        # Memory = weights + batch × KV; a throughput target rewards bigger batches (more tokens per runtime).
        priced = [{kind: {name: (score, {"memory_mib": c.get("weights", 0) + batch * c.get("kv_per_seq", 0),
                                         "runtime_ms": 10.0 + batch * c.get("kv_per_seq", 0) / 10})
                          for name, (score, c) in options.items()} for kind, options in layer.items()}
                  for layer in layers]
        # Activation workspace grows with the batch too: batch 64 cannot fit at all.
        problem = decoupled_problem(priced, fixed_costs={"memory_mib": 2.0 * batch}, metric="kl_div",
                                    tokens=batch * 100)
        caps = Budgets.parse(memory="100MiB", throughput="8000").constraints(tokens=batch * 100)
        return problem, caps

    result = sweep_batch_sizes(make, [1, 2, 4, 8, 64])
    # Batches 1 and 2 are too slow for 8000 tok/s (each layer costs ≥ 20 ms); 64 does not fit.
    assert isinstance(result.per_batch[64], str) and "memory" in result.per_batch[64]
    assert isinstance(result.per_batch[1], str) and "runtime" in result.per_batch[1]
    feasible = {b: s for b, s in result.per_batch.items() if not isinstance(s, str)}
    assert result.best.objective == pytest.approx(min(s.objective for s in feasible.values()))
    assert result.best_batch == max(b for b, s in feasible.items() if s.objective == pytest.approx(result.best.objective))
    with pytest.raises(InfeasibleError, match="no batch size"):
        sweep_batch_sizes(lambda b: (make(b)[0], {"memory_mib": 1.0}), [1, 2])


def test_80_layers_54_combinations_solve_to_proven_optimality():
    # How long this takes is measured by bench/bench_mip.py, not asserted here.
    rng = random.Random(0)
    groups = []
    for layer in range(80):
        options = []
        for a, a_size in enumerate((1.0, 0.5, 0.25, 0.125, 0.1, 0.0)):
            for f, f_size in enumerate((1.0, 0.87, 0.75, 0.5, 0.25, 0.2, 0.1, 0.05, 0.0)):
                score = (1 - a_size) * rng.uniform(0.05, 3) + (1 - f_size) * rng.uniform(0.05, 1)
                options.append(Option(f"a{a}+f{f}", score, {"memory_mib": 765 * a_size + 672 * f_size,
                                                            "runtime_ms": 354 * a_size + 463 * f_size + 20}))
        groups.append(Group(layer, "block", tuple(options)))
    problem = SearchProblem(groups, {"memory_mib": 2000.0})
    caps = {"memory_mib": 80_000, "runtime_ms": 0.6 * 80 * 837}
    with warnings.catch_warnings():
        warnings.simplefilter("error", SolverWarning)
        solution = Solver.build(problem).solve(caps)
    assert solution.status == "optimal" and len(solution.choices) == 80
    assert all(solution.totals[stat] <= cap + 1e-6 for stat, cap in caps.items())


def _hard_problem(layers: int = 120, options: int = 54, seed: int = 0) -> tuple[SearchProblem, dict[str, float]]:
    """Random scores and three independent random costs per option: CBC needs minutes to prove an optimum."""
    rng = random.Random(seed)
    groups = []
    for layer in range(layers):
        opts = []
        for i in range(options):
            m, r, p = rng.uniform(1, 100), rng.uniform(1, 100), rng.uniform(1, 100)
            opts.append(Option(f"o{i}", rng.uniform(0, 10) - 0.03 * (m + r + p),
                               {"memory_mib": m, "runtime_ms": r, "num_params": p}))
        groups.append(Group(layer, "block", tuple(opts)))
    caps = {stat: 30.0 * layers for stat in ("memory_mib", "runtime_ms", "num_params")}
    return SearchProblem(groups), caps


def test_time_limit_returns_a_feasible_unproven_solution_with_its_status():
    problem, caps = _hard_problem()
    solver = Solver.build(problem, time_limit_s=1.0)
    with pytest.warns(SolverWarning, match="time limit; the solution may not be optimal"):
        solution = solver.solve(caps)
    assert solution.status == "feasible"
    # The incumbent is a real architecture: one option per group, within every cap, honestly totalled.
    assert len(solution.choices) == len(problem.layers)
    assert solution.totals == pytest.approx(problem.totals(solution.picks))
    assert solution.objective == pytest.approx(problem.objective(solution.picks))
    assert all(solution.totals[stat] <= cap + 1e-6 for stat, cap in caps.items())
    assert solution.to_dict()["status"] == "feasible"


def test_write_lp_holds_the_objective_one_hot_rows_and_caps(tmp_path):
    problem = _random_problem(4)
    caps = {"memory_mib": _parent(problem)["memory_mib"] * 0.8}
    solver = Solver.build(problem, prune_dominated=False)
    path = solver.write_lp(tmp_path / "puzzle.lp", caps)
    text = path.read_text()
    # Binaries are named L<layer>_<kind>_<option> (these option names need no escaping).
    names = {(g.layer, g.kind, o.name): f"L{g.layer}_{g.kind}_{o.name}" for g in problem.groups for o in g.options}
    objective = lp_terms(text.split("Subject To")[0].split(":", 1)[1])
    for group in problem.groups:
        for option in group.options:
            var = names[(group.layer, group.kind, option.name)]
            assert objective.get(var, 0.0) == pytest.approx(option.score, abs=1e-9)
    cap_row = re.search(r"cap_memory_mib:(.*?)<= *([-+0-9.e]+)", text, re.S)
    coefficients = lp_terms(cap_row.group(1))
    assert float(cap_row.group(2)) == pytest.approx(caps["memory_mib"] - problem.fixed_costs["memory_mib"])
    for group in problem.groups:
        for option in group.options:
            assert coefficients[names[(group.layer, group.kind, option.name)]] == pytest.approx(
                option.costs["memory_mib"])
    assert text.count("one_L") == len(problem.groups)
    # The file describes the model only: the solver still solves without the rows it wrote.
    assert solver.solve({}).objective == pytest.approx(_brute_force(problem, {})[0], abs=1e-6)


