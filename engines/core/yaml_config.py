"""Load YAML written by users into pydantic models, reporting every problem at once.

Recipes, hardware profiles and merge configs all come through here: a safe loader (no
arbitrary Python objects), a mapping at the top level, and one error that lists each
invalid key by its dotted path.
"""

from __future__ import annotations

import importlib
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from mlxkit.engines.errors import InputError

ModelT = TypeVar("ModelT", bound=BaseModel)


def validation_problems(exc: ValidationError) -> str:
    """`a.b: msg; c: msg` for every error pydantic found."""
    problems = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "(top level)"
        problems.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
    return "; ".join(problems)


def read_yaml_mapping(text: str, origin: str, error: type[InputError] = InputError) -> dict[str, Any]:
    """Parse `text` with the safe loader; the top level must be a mapping (empty text is `{}`)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{origin} is not valid YAML: {' '.join(str(exc).split())}") from None
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
        return load_yaml_model(model, path.read_text(), f"{what} {path}", error)
    resource = packaged_yaml(package, str(name_or_path))
    if resource is None:
        here = f"; to read the file '{path}', write ./{path}" if path.is_file() else ""
        raise error(f"unknown {what} '{name_or_path}' (available: {', '.join(packaged_names(package))}, "
                    f"or a path to a YAML file){here}")
    return load_yaml_model(model, resource.read_text(), f"{what} {name_or_path} (packaged)", error)
