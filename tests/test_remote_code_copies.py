"""The exported architecture files are self-contained against the reader's transformers.

The modeling file ships inside every exported model and runs on the reader's transformers, so
it may import transformers' public API but nothing under `transformers.models.*` (per-model
internals, which change between releases). What it needs from Llama is copied in, each copy
marked `# Copied from <dotted path>[ with Old->New]` on the line above it, and checked here
against the installed transformers the way transformers' own copy checks work: the two
definitions must be the same program once docstrings, comments, type annotations and the
hub-kernel decorators (which swap in downloaded kernels, not wanted in an offline export) are
set aside and the marker's renames applied.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from conftest import REPO

DECILM = REPO / "engines" / "models" / "decilm"
SHIPPED = ("modeling_mlx_decilm.py", "configuration_mlx_decilm.py", "blocks.py")
MARKER = re.compile(r"^# Copied from (transformers(?:\.\w+)+)\.(\w+)(?: with (\w+)->(\w+))?\s*$")
# Decorators that fetch kernels from the Hub at run time; an exported copy leaves them out.
HUB_KERNEL_DECORATORS = re.compile(r"^use_kernel_")


class _Normalise(ast.NodeTransformer):
    """Drops what does not change what a definition computes: docstrings, annotations, hub-kernel decorators."""

    def _strip(self, node: ast.AST) -> ast.AST:
        body = getattr(node, "body", None)
        if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
        if hasattr(node, "decorator_list"):
            node.decorator_list = [d for d in node.decorator_list
                                   if not HUB_KERNEL_DECORATORS.match(_decorator_name(d))]
        return self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        node.returns = None
        return self._strip(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        return self._strip(node)

    def visit_arg(self, node: ast.arg) -> ast.AST:
        node.annotation = None
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        # `x: T = v` and `x = v` compute the same thing.
        if node.value is None:
            return node
        return ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno)


def _decorator_name(decorator: ast.expr) -> str:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target)


def normalised(source: str, rename: tuple[str, str] | None = None) -> str:
    """One top-level definition's source, reduced to what it computes and printed canonically."""
    if rename:
        source = source.replace(rename[0], rename[1])
    tree = ast.parse(inspect.cleandoc(source) if source.startswith((" ", "\t")) else source)
    return ast.unparse(ast.fix_missing_locations(_Normalise().visit(tree)))


def copied_blocks(path: Path) -> list[tuple[str, str, str, str, tuple[str, str] | None]]:
    """(copy's name, origin module, origin name, copy's source, rename) for each marked definition."""
    text = path.read_text()
    lines = text.splitlines()
    definitions = {node.lineno: node for node in ast.parse(text).body
                   if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    blocks = []
    for number, line in enumerate(lines, start=1):
        match = MARKER.match(line)
        if not match:
            continue
        node = definitions.get(number + 1)
        assert node is not None, f"{path.name}:{number}: a 'Copied from' marker must sit right above a definition"
        module, name, old, new = match.groups()
        blocks.append((node.name, module, name, ast.get_source_segment(text, node),
                       (old, new) if old else None))
    return blocks


def original_source(module: str, name: str) -> str:
    """The definition's source as the installed transformers has it, read from its file: some
    are wrapped by decorators that `inspect.getsource` cannot see through."""
    path = Path(importlib.import_module(module).__file__)
    text = path.read_text()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return ast.get_source_segment(text, node)
    raise AssertionError(f"{module} defines no {name}")


BLOCKS = copied_blocks(DECILM / "modeling_mlx_decilm.py")


def test_the_modeling_file_carries_its_llama_internals():
    names = {block[0] for block in BLOCKS}
    assert {"rotate_half", "apply_rotary_pos_emb", "repeat_kv", "eager_attention_forward",
            "MlxDeciLMRotaryEmbedding"} <= names


@pytest.mark.parametrize("block", BLOCKS, ids=[block[0] for block in BLOCKS])
def test_each_copy_matches_the_installed_transformers(block):
    copy_name, module, name, copy_source, rename = block
    expected = normalised(original_source(module, name), rename)
    assert normalised(copy_source) == expected, (
        f"{copy_name} differs from {module}.{name} in the installed transformers: update the copy")


def test_an_altered_copy_is_caught():
    """The comparison sees a one-token change in a copied body, and ignores what it claims to ignore."""
    copy_name, module, name, copy_source, rename = next(b for b in BLOCKS if b[0] == "repeat_kv")
    expected = normalised(original_source(module, name), rename)
    assert normalised(copy_source.replace("n_rep == 1", "n_rep == 2")) != expected
    assert normalised(copy_source.replace("head_dim)\n", "head_dim)  # a comment\n")) == expected
    annotated = copy_source.replace("n_rep: int", "n_rep: float")
    assert normalised(annotated) == expected


def _imported_modules(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.append(node.module)
    return modules


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_files_import_no_model_internals_of_transformers(name):
    internal = [module for module in _imported_modules(DECILM / name) if module.startswith("transformers.models")]
    assert internal == [], f"{name} imports {internal}; copy what it needs in, marked 'Copied from'"


def test_the_internal_import_check_sees_one(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n\n\ndef f():\n    from transformers.models.llama import modeling_llama\n")
    assert "transformers.models.llama" in _imported_modules(probe)
