"""The merge recipe schema (mergekit-like YAML), validated with pydantic.

    models:
      - model: ./ft-wiki
      - model: ./ft-code
        parameters: {weight: [{filter: mlp, value: 0.5}, {value: 1.0}]}
    base_model: ./base
    merge_method: iso-cts
    parameters: {common_frac: 0.8}
    alpha: 1.0            # or "auto" with eval_data (one file per model)
    out_dtype: bfloat16

A parameter value is a scalar or a list of `{filter, value}`: the first entry whose filter is a
substring of the tensor name wins (`*` or no filter matches everything), as in mergekit. A filter
starting with `re:` is a regular expression searched in the name.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

import yaml

from mlxkit.engines.errors import RecipeError

Scalar = Union[bool, int, float, str]

# Token embeddings and LM heads of common architectures (Llama/Mistral/Qwen, GPT-2, BLOOM, NeoX).
DEFAULT_EMBEDDING_PATTERN = r"(^|\.)(embed_tokens|lm_head|wte|word_embeddings|embed_out)(\.|$)"


class FilteredValue(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    filter: Optional[str] = None
    value: Scalar


ParamValue = Union[Scalar, list[FilteredValue]]


def resolve_param(value: ParamValue, tensor: str) -> Any:
    """The value a (possibly filtered) parameter takes for one tensor; None when no filter matches."""
    if not isinstance(value, list):
        return value
    for entry in value:
        f = entry.filter
        if f is None or f == "*" or (f.startswith("re:") and re.search(f[3:], tensor)) or \
                (not f.startswith("re:") and f in tensor):
            return entry.value
    return None


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str
    parameters: dict[str, ParamValue] = Field(default_factory=dict)


class MergeConfig(BaseModel):
    """One merge: which models, which method, which settings. Saved with the output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: list[ModelEntry] = Field(min_length=1)
    base_model: Optional[str] = None
    merge_method: str = "iso-cts"
    parameters: dict[str, ParamValue] = Field(default_factory=dict)
    alpha: Union[float, Literal["auto"]] = 1.0
    alpha_grid: Optional[list[float]] = None
    eval_data: list[str] = Field(default_factory=list)
    eval_tokens: int = Field(8192, ge=16)
    eval_seq_len: int = Field(256, ge=2)
    out_dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    max_shard_size: str = "5GB"
    average_embeddings: bool = True
    embedding_pattern: str = DEFAULT_EMBEDDING_PATTERN
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        # mergekit's `dtype` is its compute/output dtype; we compute in float32, so it names the output.
        if isinstance(data, dict) and "dtype" in data:
            data = dict(data)
            dtype = data.pop("dtype")
            data.setdefault("out_dtype", dtype)
        return data

    @field_validator("merge_method")
    @classmethod
    def _known_method(cls, name: str) -> str:
        from mlxkit.engines.merge.methods import registry

        return registry.get(name).name

    @field_validator("embedding_pattern")
    @classmethod
    def _valid_regex(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"embedding_pattern is not a regular expression: {exc}") from None
        return pattern

    @model_validator(mode="after")
    def _consistent(self) -> "MergeConfig":
        from mlxkit.engines.merge.methods import registry

        method = registry.get(self.merge_method)
        n = len(self.models)
        if n < method.min_models or (method.max_models is not None and n > method.max_models):
            want = str(method.min_models) if method.min_models == method.max_models else f"at least {method.min_models}"
            raise ValueError(f"method '{method.name}' takes {want} models (got {n})")
        known = method.all_parameters()
        per_model = {name for name, p in known.items() if p.per_model}
        for name in self.parameters:
            if name not in known:
                raise ValueError(f"method '{method.name}' has no parameter '{name}' "
                                 f"(it takes: {', '.join(known) or 'none'})")
        for entry in self.models:
            for name in entry.parameters:
                if name not in per_model:
                    raise ValueError(f"'{name}' is not a per-model parameter of '{method.name}' "
                                     f"(per-model: {', '.join(sorted(per_model)) or 'none'})")
        if self.alpha == "auto":
            if not method.uses_deltas:
                raise ValueError(f"alpha: auto needs a task-vector method, not '{method.name}'")
            if len(self.eval_data) != n:
                raise ValueError(f"alpha: auto needs eval_data with one text file per model "
                                 f"({n} models, {len(self.eval_data)} files)")
        elif self.eval_data:
            raise ValueError("eval_data is only used with alpha: auto")
        if self.alpha_grid is not None and (not self.alpha_grid or min(self.alpha_grid) < 0):
            raise ValueError("alpha_grid must be a non-empty list of non-negative numbers")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_defaults=False), sort_keys=False)


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a YAML recipe: a file, or a bundled name under mlxkit.recipes/merge."""
    p = Path(path)
    if not p.exists():
        bundled = Path(__file__).resolve().parents[2] / "recipes" / "merge" / f"{path}.yaml"
        if not bundled.exists():
            raise RecipeError(f"recipe '{path}' is neither a file nor a bundled merge recipe")
        p = bundled
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe '{p}' is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"recipe '{p}' must be a mapping at the top level")
    return data


def load_recipe(path: str | Path) -> MergeConfig:
    return validate_config(read_recipe(path), origin=str(path))


def validate_config(data: dict[str, Any], origin: str = "options") -> MergeConfig:
    try:
        return MergeConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'recipe'}: {e['msg'].removeprefix('Value error, ')}"
                             for e in exc.errors())
        raise RecipeError(f"invalid merge settings ({origin}): {problems}") from None


def config_from_options(*, models: list[str], recipe: Optional[str], base: Optional[str], method: Optional[str],
                        isotropic: bool, alpha: Optional[str], eval_data: list[str], common_frac: Optional[float],
                        params: list[str], average_embeddings: Optional[bool], dtype: Optional[str],
                        max_shard_size: Optional[str], seed: Optional[int]) -> MergeConfig:
    """Merge CLI flags into a config: flags override the recipe; positional models replace its list."""
    if isotropic and method and method.replace("_", "-") not in ("iso-cts",):
        raise RecipeError(f"--isotropic means --method iso-cts; it conflicts with --method {method}")
    data: dict[str, Any] = {}
    if recipe:
        data = dict(read_recipe(recipe))
    if models:
        data["models"] = [{"model": m} for m in models]
    if not data.get("models"):
        raise RecipeError("no models to merge: pass model paths or a --recipe with models:")
    if method or isotropic:
        data["merge_method"] = method or "iso-cts"
    parameters = dict(data.get("parameters") or {})
    for item in params:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"--param takes key=value (got '{item}')")
        parameters[key.strip().replace("-", "_")] = yaml.safe_load(raw)
    if common_frac is not None:
        parameters["common_frac"] = common_frac
    data["parameters"] = parameters
    if alpha is not None:
        data["alpha"] = "auto" if alpha.strip().lower() == "auto" else _number(alpha, "--alpha")
    if eval_data:
        data["eval_data"] = list(eval_data)
    for key, value in (("base_model", base), ("average_embeddings", average_embeddings), ("out_dtype", dtype),
                       ("max_shard_size", max_shard_size), ("seed", seed)):
        if value is not None:
            data[key] = value
    return validate_config(data, origin=recipe or "command line")


def _number(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise RecipeError(f"{flag} takes a number or 'auto' (got '{text}')") from None
