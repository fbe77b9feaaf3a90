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

Validation reads no tensors: every parameter is checked against its method's `ParamDef` (type,
range, finiteness) here, and every problem is reported at once with its path
(`models.1.parameters.density: ...`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from mlxkit.engines.core.sizes import parse_bytes
from mlxkit.engines.core.yaml_config import packaged_yaml, read_yaml_mapping, validate_model
from mlxkit.engines.errors import InputError, RecipeError
from mlxkit.engines.merge.params import ALPHA, ALPHA_GRID_POINT, ParamDef

Scalar = Union[bool, int, float, str]

# Token embeddings and LM heads of common architectures (Llama/Mistral/Qwen, GPT-2, BLOOM, NeoX).
DEFAULT_EMBEDDING_PATTERN = r"(^|\.)(embed_tokens|lm_head|wte|word_embeddings|embed_out)(\.|$)"

class FilteredValue(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    filter: Optional[str] = None
    value: Scalar


def _filtered_values(value: Any) -> Any:
    """A scalar stays as it is; a list becomes `FilteredValue`s, each problem told in one line.

    Done by hand rather than through pydantic's union so that a bad entry gives one readable
    message instead of one per union member.
    """
    if isinstance(value, (bool, int, float, str)) or isinstance(value, FilteredValue):
        return value
    if not isinstance(value, list):
        raise ValueError(f"a parameter is a number, true/false, or a list of {{filter, value}} entries "
                         f"(got {value!r})")
    entries = []
    for i, entry in enumerate(value):
        if isinstance(entry, FilteredValue):
            entries.append(entry)
            continue
        if not isinstance(entry, dict) or "value" not in entry or set(entry) - {"filter", "value"}:
            raise ValueError(f"entry {i} must be a mapping with 'value' and an optional 'filter' (got {entry!r})")
        filt, val = entry.get("filter"), entry["value"]
        if filt is not None and not isinstance(filt, str):
            raise ValueError(f"entry {i}: filter must be a string (got {filt!r})")
        if isinstance(filt, str) and filt.startswith("re:"):
            try:
                re.compile(filt[3:])
            except re.error as exc:
                raise ValueError(f"entry {i}: filter '{filt}' is not a regular expression ({exc})") from None
        if not isinstance(val, (bool, int, float, str)):
            raise ValueError(f"entry {i}: value must be a number, true/false or a string (got {val!r})")
        entries.append(FilteredValue(filter=filt, value=val))
    return entries


ParamValue = Annotated[Any, BeforeValidator(_filtered_values)]


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
    model: str = Field(min_length=1)
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
    max_shard_size: Union[int, str] = "5GB"
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

    @field_validator("alpha", mode="before")
    @classmethod
    def _alpha(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            return ALPHA.check(value)
        except InputError:
            raise ValueError(f"alpha must be {ALPHA.valid_values()} or 'auto' (got {value!r})") from None

    @field_validator("alpha_grid", mode="before")
    @classmethod
    def _alpha_grid(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, list) or not value:
            raise ValueError(f"alpha_grid must be a non-empty list of {ALPHA_GRID_POINT.valid_values()}")
        return [ALPHA_GRID_POINT.check(point) for point in value]

    @field_validator("max_shard_size")
    @classmethod
    def _shard_size(cls, value: Union[int, str]) -> Union[int, str]:
        parse_bytes(value, "max_shard_size")  # refuse it now, before any tensor is read
        return value

    @field_validator("embedding_pattern")
    @classmethod
    def _valid_regex(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"embedding_pattern is not a regular expression: {exc}") from None
        return pattern

    @model_validator(mode="wrap")
    @classmethod
    def _report_everything(cls, data: Any, handler: Any) -> "MergeConfig":
        """A bad field stops pydantic before `_consistent`, which would hide every bad method
        parameter (or repeated model) until the field is fixed; run those checks on the raw data as
        well, so one run reports every invalid key."""
        try:
            return handler(_typed_parameters(data))
        except ValidationError as exc:
            errors = exc.errors()
            if all(e["type"] == _PROBLEM for e in errors):
                raise  # `_consistent` ran: it already checked everything
            problems = _Problems()
            for error in errors:
                problems.add(tuple(error["loc"]), error["msg"])
            _raw_problems(data, problems, frozenset(tuple(e["loc"]) for e in errors))
            problems.raise_if_any()
            raise

    @model_validator(mode="after")
    def _consistent(self) -> "MergeConfig":
        from mlxkit.engines.merge.methods import registry

        problems = _Problems()
        method = registry.get(self.merge_method)
        n = len(self.models)
        _check_models(method, [entry.model for entry in self.models], problems)
        _check_parameters(method, self.parameters, [entry.parameters for entry in self.models], problems)
        if self.alpha == "auto":
            if not method.uses_deltas:
                problems.add(("alpha",), f"alpha: auto needs a task-vector method, not '{method.name}'")
            if len(self.eval_data) != n:
                problems.add(("eval_data",), f"alpha: auto needs eval_data with one text file per model "
                                             f"({n} models, {len(self.eval_data)} files)")
        elif self.eval_data:
            problems.add(("eval_data",), "eval_data is only used with alpha: auto")
        problems.raise_if_any()
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_defaults=False), sort_keys=False)


_PROBLEM = "merge_config"  # the pydantic error type of every problem found by the checks below


class _Problems:
    """Collects (path, message) pairs and raises them as one pydantic error, so the caller reports
    every invalid key with its own path rather than the first one under '(top level)'."""

    def __init__(self) -> None:
        self.items: list[InitErrorDetails] = []

    def add(self, loc: tuple, message: str) -> None:
        # the message goes in through the context: a literal template would choke on braces in it
        self.items.append(InitErrorDetails(type=PydanticCustomError(_PROBLEM, "{message}", {"message": message}),
                                           loc=loc, input=None))

    def raise_if_any(self) -> None:
        if self.items:
            raise ValidationError.from_exception_data("MergeConfig", self.items)


def _check_models(method, specs: list[Any], problems: _Problems, skip: frozenset[tuple] = frozenset()) -> None:
    """As many models as the method takes, each listed once."""
    n = len(specs)
    if ("models",) not in skip and (n < method.min_models or (method.max_models is not None and n > method.max_models)):
        want = str(method.min_models) if method.min_models == method.max_models else f"at least {method.min_models}"
        problems.add(("models",), f"method '{method.name}' takes {want} models (got {n})")
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if not isinstance(spec, str) or not spec or ("models", i, "model") in skip:
            continue
        key = _input_key(spec)
        if key in seen:
            # twice the same task vector is not a merge of two tasks; a weight says "count it twice"
            problems.add(("models", i, "model"), f"'{spec}' is the same model as models.{seen[key]}; "
                                                 "list each input once (use weights to count one more)")
        seen.setdefault(key, i)


def _check_parameters(method, parameters: dict[str, Any], model_parameters: list[Any], problems: _Problems,
                      skip: frozenset[tuple] = frozenset()) -> None:
    """Every parameter is known to the method, given where it may be, and valid for its `ParamDef`.

    Works on validated values and on raw ones (see `MergeConfig._report_everything`); `skip` holds
    the paths pydantic has already reported.
    """
    known = method.all_parameters()
    per_model = {name for name, p in known.items() if p.per_model}

    def check_value(pdef: ParamDef, value: Any, loc: tuple) -> None:
        if loc in skip:
            return
        try:
            value = _filtered_values(value)
        except ValueError:
            return  # malformed structure: reported by pydantic under the same path
        entries = [(loc, value)] if not isinstance(value, list) else \
            [((*loc, i, "value"), e.value) for i, e in enumerate(value)]
        for where, v in entries:
            try:
                pdef.check(v)
            except InputError as exc:
                problems.add(where, str(exc))

    for name, value in parameters.items():
        if name not in known:
            problems.add(("parameters", name), f"method '{method.name}' has no parameter '{name}' "
                                               f"(it takes: {', '.join(known) or 'none'})")
        else:
            check_value(known[name], value, ("parameters", name))
    for i, entry_params in enumerate(model_parameters):
        for name, value in entry_params.items():
            if name not in per_model:
                problems.add(("models", i, "parameters", name),
                             f"'{name}' is not a per-model parameter of '{method.name}' "
                             f"(per-model: {', '.join(sorted(per_model)) or 'none'})")
            else:
                check_value(known[name], value, ("models", i, "parameters", name))
    for name, pdef in known.items():
        if not pdef.required or name in parameters:
            continue
        if not pdef.per_model:
            problems.add(("parameters", name), f"method '{method.name}' needs '{name}' ({pdef.help})")
            continue
        for i, entry_params in enumerate(model_parameters):
            if name not in entry_params:
                problems.add(("models", i, "parameters", name),
                             f"method '{method.name}' needs '{name}' for every model ({pdef.help})")


def _typed_parameters(data: Any) -> Any:
    """A copy of raw `data` with each valid parameter value in its declared type (`"0.3"` -> 0.3), so
    the saved merge.yaml and manifest hold typed values; invalid ones are left for the checks."""
    from mlxkit.engines.merge.methods import registry

    if not isinstance(data, dict):
        return data
    try:
        known = registry.get(str(data.get("merge_method", "iso-cts"))).all_parameters()
    except InputError:
        return data

    def typed(params: Any) -> Any:
        if not isinstance(params, dict):
            return params
        out = {}
        for name, value in params.items():
            pdef = known.get(name)
            if pdef is not None and isinstance(value, list):
                value = [{**e, "value": _checked_or_same(pdef, e["value"])} if isinstance(e, dict) and "value" in e
                         else e for e in value]
            elif pdef is not None:
                value = _checked_or_same(pdef, value)
            out[name] = value
        return out

    data = dict(data, parameters=typed(data.get("parameters"))) if "parameters" in data else dict(data)
    if isinstance(data.get("models"), list):
        data["models"] = [dict(m, parameters=typed(m["parameters"])) if isinstance(m, dict) and "parameters" in m
                          else m for m in data["models"]]
    return data


def _checked_or_same(pdef: ParamDef, value: Any) -> Any:
    try:
        return pdef.check(value)
    except InputError:
        return value


def _raw_problems(data: Any, problems: _Problems, skip: frozenset[tuple]) -> None:
    """The model and parameter checks on unvalidated data, as far as its shape allows."""
    from mlxkit.engines.merge.methods import registry

    if not isinstance(data, dict):
        return
    try:
        method = registry.get(str(data.get("merge_method", "iso-cts")))
    except InputError:
        return  # an unknown method: pydantic reported it, and there is nothing to check against
    parameters = data.get("parameters")
    models = data.get("models") if isinstance(data.get("models"), list) else []
    entries = [entry if isinstance(entry, dict) else {} for entry in models]
    model_parameters = [e.get("parameters") if isinstance(e.get("parameters"), dict) else {} for e in entries]
    _check_models(method, [e.get("model") for e in entries], problems, skip)
    _check_parameters(method, parameters if isinstance(parameters, dict) else {}, model_parameters, problems, skip)


def _input_key(spec: str) -> str:
    """What makes two inputs the same model: the resolved directory for local paths (so `./a` and
    `a/` match), the spec itself for hub ids. Resolving a path reads no weights."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec.strip()


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a YAML recipe: a file, or a bundled name under mlxkit.recipes/merge."""
    p = Path(path)
    if not p.exists():
        bundled = packaged_yaml("mlxkit.recipes.merge", str(path))
        if bundled is None:
            raise RecipeError(f"recipe '{path}' is neither a file nor a bundled merge recipe")
        p = bundled
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read recipe '{p}': {exc}") from None
    return read_yaml_mapping(text, f"recipe '{p}'", RecipeError)


def validate_config(data: dict[str, Any], origin: str = "options") -> MergeConfig:
    """A checked `MergeConfig`; one `RecipeError` lists every invalid key by its path."""
    return validate_model(MergeConfig, data, f"merge settings ({origin})", RecipeError)


def config_from_options(*, models: list[str], recipe: Optional[str], base: Optional[str], method: Optional[str],
                        isotropic: bool, alpha: Optional[str], eval_data: list[str],
                        common_frac: Optional[str | float],
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
        parameters[key.strip().replace("-", "_")] = _param_text(raw)
    if common_frac is not None:
        parameters["common_frac"] = common_frac  # text from the CLI: checked (and typed) like any parameter
    data["parameters"] = parameters
    if alpha is not None:
        data["alpha"] = alpha  # a number or 'auto'; checked with the config like every other value
    if eval_data:
        data["eval_data"] = list(eval_data)
    for key, value in (("base_model", base), ("average_embeddings", average_embeddings), ("out_dtype", dtype),
                       ("max_shard_size", max_shard_size), ("seed", seed)):
        if value is not None:
            data[key] = value
    return validate_config(data, origin=f"recipe '{recipe}' with the command-line flags" if recipe
                           else "command line")


def _param_text(raw: str) -> Any:
    """`--param` values are YAML scalars (`0.3`, `true`, `[{filter: mlp, value: 0.5}]`); text YAML cannot
    parse stays a string, and the parameter's own check then says what it should be."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
