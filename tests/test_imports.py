"""Import hygiene, read from the source (AST), not by importing anything.

1. No module uses another package's private names: a `_name` (not a `__dunder__`) defined in
   a module of package P, or a private module `_mod` of package P, is used only inside P.
2. The subpackages of engines/ import each other without a cycle at module level. Imports
   inside functions (deferred, to keep `mlx --help` fast) and under `if TYPE_CHECKING:` do
   not run at import time and are left out of the graph.
3. No module imports itself back through others, counting the deferred imports too: such a cycle
   works only while every import in it stays deferred, and it hides which module owns what.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO

# Source folder -> the package it installs as (setup.py maps them the same way).
ROOTS = {"engines": "mlxkit.engines", "cli": "mlxkit.cli"}


@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. mlxkit.engines.models.loading
    path: Path
    is_package: bool  # an __init__.py

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def _modules() -> dict[str, Module]:
    found = {}
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join([package, *parts])
            found[name] = Module(name, path, is_package)
    return found


MODULES = _modules()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module name an ImportFrom reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = module.package.split(".")
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner_of_private(dotted: str) -> str | None:
    """The package that owns the first private part of `dotted` (a module or a name in one), if any.

    A private module `_mod` belongs to the package holding it; a private name belongs to the
    package of the module that defines it.
    """
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if i and _is_private(part):
            holder = ".".join(parts[:i])
            if holder in MODULES and not MODULES[holder].is_package:
                return holder.rpartition(".")[0]  # a name in a module: owned by that module's package
            return holder
    return None


def _inside(package: str, owner: str) -> bool:
    return package == owner or package.startswith(owner + ".")


def _runtime_nodes(tree: ast.Module):
    """Module-level statements, descending into if/try/with/class bodies but not into functions
    or `if TYPE_CHECKING:` blocks."""
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            pending.extend(getattr(node, field, []) or [])


def _private_uses(module: Module, source: str | None = None) -> list[str]:
    tree = ast.parse(module.path.read_text() if source is None else source, filename=str(module.path))
    problems = []
    bound_modules: dict[str, str] = {}  # local name -> mlxkit module it is bound to
    for node in ast.walk(tree):
        targets: list[tuple[str, str | None]] = []  # (dotted target, local name bound)
        if isinstance(node, ast.Import):
            targets = [(alias.name, alias.asname) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            targets = [(f"{source}.{alias.name}", alias.asname or alias.name) for alias in node.names]
        for dotted, local in targets:
            if not dotted.startswith("mlxkit."):
                continue
            owner = _owner_of_private(dotted)
            if owner is not None and not _inside(module.package, owner):
                problems.append(f"{module.path.relative_to(REPO)}:{node.lineno} imports {dotted} (private to {owner})")
            if local is not None and dotted in MODULES:
                bound_modules[local] = dotted
    for node in ast.walk(tree):  # `loading._check_hub` through an imported module
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _is_private(node.attr):
            target = bound_modules.get(node.value.id)
            if target is not None:
                owner = MODULES[target].package
                if not _inside(module.package, owner):
                    problems.append(f"{module.path.relative_to(REPO)}:{node.lineno} uses {target}.{node.attr} "
                                    f"(private to {owner})")
    return problems


def test_no_module_uses_another_packages_private_names():
    problems = [problem for module in MODULES.values() for problem in _private_uses(module)]
    assert not problems, "private names used across packages:\n" + "\n".join(problems)


def _subpackage(dotted: str) -> str | None:
    """`mlxkit.engines.models.loading` -> `models`; `mlxkit.engines.errors` -> `errors`."""
    parts = dotted.split(".")
    if parts[:2] != ["mlxkit", "engines"] or len(parts) < 3:
        return None
    return parts[2]


def _engine_graph() -> dict[str, dict[str, str]]:
    """subpackage -> {imported subpackage: 'file:line' of one import that makes the edge}."""
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for module in MODULES.values():
        here = _subpackage(module.name)
        if here is None:
            continue
        tree = ast.parse(module.path.read_text(), filename=str(module.path))
        for node in _runtime_nodes(tree):
            if isinstance(node, ast.Import):
                sources = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, node)
                # `from mlxkit.engines import models` names a subpackage, not a name in engines/__init__
                sources = [f"{source}.{alias.name}" if source == "mlxkit.engines" else source for alias in node.names]
            else:
                continue
            for source in sources:
                there = _subpackage(source)
                if there is not None and there != here:
                    graph[here].setdefault(there, f"{module.path.relative_to(REPO)}:{node.lineno}")
    return graph


def _cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(set(graph) | {n for edges in graph.values() for n in edges}):
        if node not in index:
            visit(node)
    return found


def test_engine_subpackages_import_each_other_without_cycles():
    graph = _engine_graph()
    assert graph, "the scan found no imports between engine subpackages at all"
    cycles = _cycles(graph)
    details = [f"{a} -> {b} ({graph[a][b]})" for cycle in cycles for a in cycle for b in graph[a] if b in cycle]
    assert not cycles, f"import cycles between engines/ subpackages: {cycles}\n" + "\n".join(details)


def test_the_scan_sees_what_it_should():
    """Guards the checks themselves: they find a planted private import and a planted cycle."""
    planted = Module("mlxkit.engines.merge.planted", REPO / "engines" / "merge" / "planted.py", False)
    problems = _private_uses(planted, "from mlxkit.engines.models.loading import _check_hub\n"
                                      "from ..models import loading\n"
                                      "loading._first_line(None)\n"
                                      "from mlxkit.cli._errors import fail\n"
                                      "from mlxkit import __version__\n"
                                      "from mlxkit.engines.merge.sources import _local\n")
    assert len(problems) == 3, problems  # _check_hub, loading._first_line, cli._errors; not __version__ or merge's own
    assert _cycles({"a": {"b": ""}, "b": {"c": ""}, "c": {"a": ""}, "d": {"a": ""}}) == [["a", "b", "c"]]
    assert _subpackage("mlxkit.engines.errors") == "errors" and _subpackage("mlxkit.cli.main") is None


def _module_graph() -> dict[str, dict[str, str]]:
    """Module -> {mlxkit module it imports anywhere in its body, function bodies included: where}
    (a package's name stands for its __init__)."""
    graph: dict[str, dict[str, str]] = {name: {} for name in MODULES}
    for name, module in MODULES.items():
        for node in ast.walk(ast.parse(module.path.read_text(), filename=str(module.path))):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, node)
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                if target in MODULES and target != name:
                    graph[name].setdefault(target, f"{module.path.relative_to(REPO)}:{node.lineno}")
    return graph


def test_no_module_imports_itself_back_even_through_deferred_imports():
    graph = _module_graph()
    assert sum(map(len, graph.values())) > 200, "the scan found too few imports"
    cycles = _cycles(graph)
    details = [f"{a} -> {b} ({graph[a][b]})" for cycle in cycles for a in cycle for b in graph[a] if b in cycle]
    assert not cycles, f"import cycles between modules: {cycles}\n" + "\n".join(details)
