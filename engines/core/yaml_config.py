"""Load YAML written by users into pydantic models, reporting every problem at once.

Recipes, hardware profiles, merge configs and `--set` values all come through here: a safe
loader (no arbitrary Python objects) with bounds on size, depth and alias expansion, a mapping
at the top level, and one error that lists each invalid key by its dotted path.
"""

from __future__ import annotations

import importlib
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from mlxkit.engines.errors import InputError

ModelT = TypeVar("ModelT", bound=BaseModel)


class StrictSpec(BaseModel):
    """Base of every recipe section and stored record: an unknown key is an error (a typo would
    otherwise be ignored), values are frozen, and a float must be finite."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def validation_problems(exc: ValidationError) -> str:
    """`a.b: msg; c: msg` for every error pydantic found."""
    problems = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "(top level)"
        problems.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(problems)


# Far beyond any config mlxkit reads (its largest packaged recipe is a few KiB, nested 5 deep), and
# small enough that the parse, and every walk over the result after it, stays quick and shallow.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 64
MAX_YAML_NODES = 100_000  # counted with every alias expanded, as the consumers of the result see it


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader, refusing nesting beyond MAX_YAML_DEPTH while it composes.

    PyYAML's composer recurses once per level, so thousands of nested `[` reach Python's recursion
    limit before any error of its own; the count stops it first.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise _Bound(f"nested more than {MAX_YAML_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class _Bound(Exception):
    """A bound of the loader was passed (internal: becomes the caller's typed error)."""


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a graph whose aliases expand past MAX_YAML_NODES nodes or MAX_YAML_DEPTH levels, or loop.

    An alias is the anchored node itself, so a few lines of anchors can stand for billions of
    nodes; each node's expanded size is computed once, which costs the graph's size, not the
    expansion's.
    """
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        if depth > MAX_YAML_DEPTH:
            raise _Bound(f"nested more than {MAX_YAML_DEPTH} levels deep once its aliases are expanded")
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise _Bound("an alias refers to a node that contains it")
        open_nodes.add(key)
        total = 1
        for child in _children(node):
            total += size(child, depth + 1)
            if total > MAX_YAML_NODES:
                raise _Bound(f"more than {MAX_YAML_NODES} values once its aliases are expanded")
        open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root, 1)


def load_yaml(text: str, origin: str, error: type[InputError] = InputError) -> Any:
    """Parse `text` with the safe loader, within MAX_YAML_BYTES, MAX_YAML_DEPTH and MAX_YAML_NODES.

    Raises `error` naming `origin` for text that is not YAML, passes a bound, or holds a value the
    safe constructor cannot build (a timestamp `2001-13-45`, an integer of 5000 digits).
    """
    if len(text) > MAX_YAML_BYTES:
        raise error(f"{origin} is larger than {MAX_YAML_BYTES >> 20} MiB; a config is a few KiB")
    loader = None
    try:
        loader = _BoundedLoader(text)  # the reader refuses control characters already here
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    except _Bound as exc:
        raise error(f"{origin} is refused: {exc}") from None
    except yaml.YAMLError as exc:
        raise error(f"{origin} is not valid YAML: {' '.join(str(exc).split())}") from None
    except (ValueError, OverflowError) as exc:  # the safe constructor's int(), float() and datetime()
        raise error(f"{origin} is not valid YAML: {' '.join(str(exc).split())}") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_yaml_text(path: str | os.PathLike, origin: str, error: type[InputError] = InputError) -> str:
    """The text of a YAML file, read no further than MAX_YAML_BYTES (a device or a huge file never fills memory)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_YAML_BYTES + 1)
    except OSError as exc:
        raise error(f"cannot read {origin}: {exc.strerror or exc}") from None
    if len(raw) > MAX_YAML_BYTES:
        raise error(f"{origin} is larger than {MAX_YAML_BYTES >> 20} MiB; a config is a few KiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{origin} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_yaml_mapping(text: str, origin: str, error: type[InputError] = InputError) -> dict[str, Any]:
    """Parse `text` with the bounded loader; the top level must be a mapping (empty text is `{}`)."""
    data = load_yaml(text, origin, error)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise error(f"{origin} must be a mapping of keys to values at the top level")
    return data


def validate_model(model: type[ModelT], data: Any, origin: str, error: type[InputError] = InputError) -> ModelT:
    """`model.model_validate(data)`, with every validation error in one typed error."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{origin} is invalid: {validation_problems(exc)}") from None


def load_yaml_model(model: type[ModelT], text: str, origin: str, error: type[InputError] = InputError) -> ModelT:
    """Parse and validate YAML text into `model`."""
    return validate_model(model, read_yaml_mapping(text, origin, error), origin, error)


def with_overrides(recipe: ModelT, overrides: dict[str, Any], error: type[InputError] = InputError) -> ModelT:
    """A copy of `recipe` with dotted keys replaced (`optim.lr=3e-4`), validated again as a whole.

    A key must already exist: a typo is an error naming it, never a new field.
    """
    data = recipe.model_dump()
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            if not isinstance(node.get(key), dict):
                unset = key in node and node[key] is None
                raise error(f"unknown recipe key '{dotted}'" + (f" (this recipe has no '{key}' section)" if unset
                                                                 else ""))
            node = node[key]
        if leaf not in node:
            raise error(f"unknown recipe key '{dotted}'")
        node[leaf] = value
    return validate_model(type(recipe), data, "recipe with overrides", error)


_PACKAGED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def packaged_names(package: str) -> list[str]:
    """The YAML files shipped in `package`, by stem."""
    stems = [p.name[:-5] for p in resources.files(package).iterdir() if p.name.endswith(".yaml")]
    return sorted(stem for stem in stems if packaged_yaml(package, stem) is not None)


def packaged_yaml(package: str, name: str) -> Path | None:
    """The YAML file shipped in `package` under `name`, or None.

    A name is a plain word (no separators, no `..`), and the file it names must lie inside the
    package once symlinks are resolved: a name never reaches a file elsewhere on the machine.
    """
    if not _PACKAGED_NAME.fullmatch(name):
        return None
    root = Path(next(iter(importlib.import_module(package).__path__))).resolve()
    candidate = (root / f"{name}.yaml").resolve()
    if candidate.parent != root or not candidate.is_file():
        return None
    return candidate


def looks_like_file(name_or_path: str | os.PathLike) -> bool:
    """A `.yaml`/`.yml` name, or one with a directory separator, is a file; a bare word is a packaged name."""
    text = os.fspath(name_or_path)
    separators = [os.sep] + ([os.altsep] if os.altsep else []) + ["/"]
    return Path(text).suffix in (".yaml", ".yml") or any(sep in text for sep in separators)


def load_packaged_or_file(model: type[ModelT], name_or_path: str | os.PathLike, package: str, what: str,
                          error: type[InputError] = InputError) -> ModelT:
    """A YAML shipped in `package` by name, or a YAML file by path, validated into `model`.

    `what` names the kind in messages ("recipe", "fine-tuning recipe"). Only what looks like a file
    (`looks_like_file`) is read as one: a bare word is always a packaged name, so a directory or
    file of that name in the working directory (an earlier run's `--out gkd`) never hides it.
    """
    path = Path(name_or_path)
    if looks_like_file(name_or_path):
        if not path.is_file():
            raise error(f"{what} file '{path}' does not exist")
        return load_yaml_model(model, read_yaml_text(path, f"{what} {path}", error), f"{what} {path}", error)
    resource = packaged_yaml(package, str(name_or_path))
    if resource is None:
        here = f"; to read the file '{path}', write ./{path}" if path.is_file() else ""
        raise error(f"unknown {what} '{name_or_path}' (available: {', '.join(packaged_names(package))}, "
                    f"or a path to a YAML file){here}")
    origin = f"{what} {name_or_path} (packaged)"
    return load_yaml_model(model, read_yaml_text(resource, origin, error), origin, error)


def split_pairs(pairs: list[str], flag: str = "--set") -> list[tuple[str, str]]:
    """`key=value` strings split into (dotted key, raw value).

    The key is dotted words (`optim.lr`), each part non-empty; the first `=` ends it, so a value may
    hold `=` itself. Anything else is an `InputError` naming `flag`.
    """
    split = []
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(f"{flag} takes key=value (got '{pair}')")
        if any(not part.strip() or part != part.strip() for part in key.split(".")):
            raise InputError(f"{flag} {key}: every part of a dotted key is a name (got '{key}')")
        split.append((key, raw))
    return split


def parse_overrides(pairs: list[str], flag: str = "--set") -> dict[str, Any]:
    """`--set optim.lr=3e-4` → {"optim.lr": 0.0003}: each value is read by the bounded YAML loader.

    A key given twice is an error rather than the last one winning silently. The values' types and
    ranges are the schema's to check (`with_overrides`), with the key's path in the message.
    """
    overrides: dict[str, Any] = {}
    for key, raw in split_pairs(pairs, flag):
        if key in overrides:
            raise InputError(f"{flag} {key}= is given twice; give it once")
        try:
            overrides[key] = load_yaml(raw, f"{flag} {key}")
        except InputError as exc:
            raise InputError(f"{flag} {key}: cannot read the value '{raw[:80]}' ({exc})") from None
    return overrides
