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

The schema is mergekit's (`mergekit-yaml` configs run unchanged) plus our own keys (`alpha`,
`eval_data`, `average_embeddings`, `data` for regmean and fisher, ...). A parameter value is, as in mergekit:

* a scalar;
* a gradient, a list of numbers interpolated linearly over the layers: layer i of N takes the
  value at position i/(N-1) of the list (with slices, N and i count within each slice), and
  every tensor outside the layers (embeddings, final norm, LM head) the first value, as
  mergekit 0.1.5 does;
* a list of `{filter, value}` whose first entry matching the tensor name wins: a filter matches
  when it is a substring of the name (`*` or no filter matches everything); a filter starting
  with `re:` is a regular expression searched in the name. A value may itself be a gradient.

`slices` (mergekit's layer ranges: frankenmerges, depth up-scaling) replace `models`; the base
model listed among `models` is taken out of the inputs of task-vector methods, as mergekit does.

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
from mlxkit.engines.core.yaml_config import (looks_like_file, packaged_yaml,
                                             read_yaml_mapping, read_yaml_text, validate_model)
from mlxkit.engines.errors import InputError, RecipeError
from mlxkit.engines.merge.params import ALPHA, ALPHA_GRID_POINT, ParamDef
from mlxkit.engines.merge.tokenizers import has_tokenizer_files

Scalar = Union[bool, int, float, str]

# Token embeddings and LM heads of common architectures (Llama/Mistral/Qwen, GPT-2, BLOOM, NeoX).
DEFAULT_EMBEDDING_PATTERN = r"(^|\.)(embed_tokens|lm_head|wte|word_embeddings|embed_out)(\.|$)"

class FilteredValue(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    filter: Optional[str] = None
    value: Union[Scalar, list[Scalar]]


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str))


def _gradient(value: list, what: str) -> list:
    if not value:
        raise ValueError(f"{what} is an empty list (a gradient needs at least one value)")
    return list(value)


def _filtered_values(value: Any) -> Any:
    """A scalar stays as it is, a list of scalars is a gradient, and a list of mappings becomes
    `FilteredValue`s; each problem is told in one line.

    Done by hand rather than through pydantic's union so that a bad entry gives one readable
    message instead of one per union member.
    """
    if _is_scalar(value) or isinstance(value, FilteredValue):
        return value
    if not isinstance(value, list):
        raise ValueError(f"a parameter is a number, true/false, a list of numbers (a gradient over the layers) "
                         f"or a list of {{filter, value}} entries (got {value!r})")
    if all(_is_scalar(e) for e in value):
        return _gradient(value, "the parameter")
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
        if isinstance(val, list) and all(_is_scalar(v) for v in val):
            val = _gradient(val, f"entry {i}: value")
        elif not _is_scalar(val):
            raise ValueError(f"entry {i}: value must be a number, true/false, a string or a list of numbers "
                             f"(got {val!r})")
        entries.append(FilteredValue(filter=filt, value=val))
    return entries


ParamValue = Annotated[Any, BeforeValidator(_filtered_values)]


def filter_matches(pattern: Optional[str], tensor: str) -> bool:
    """mergekit's rule (no filter, `*`, or a substring of the name), plus `re:` expressions."""
    if pattern is None or pattern == "*":
        return True
    if pattern.startswith("re:"):
        return re.search(pattern[3:], tensor) is not None
    return pattern in tensor


def at_position(setting: Any, t: float) -> Any:
    """A scalar as is; a gradient at `t` in [0, 1]: numbers are interpolated between their two
    neighbours, any other list (true/false, text) takes the entry at or below `t`, as mergekit."""
    if not isinstance(setting, list):
        return setting
    if len(setting) == 1:
        return setting[0]
    scaled = max(0.0, min(1.0, t)) * (len(setting) - 1)
    low = int(scaled)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in setting):
        high = min(len(setting) - 1, low + 1)
        frac = scaled - low
        return (1 - frac) * setting[low] + frac * setting[high]
    return setting[low]


def resolve_param(value: ParamValue, tensor: str, t: float = 0.0) -> Any:
    """The value a parameter takes for one tensor at depth `t` (0 = first layer, 1 = last);
    None when no filter matches."""
    if isinstance(value, list) and value and all(isinstance(e, FilteredValue) for e in value):
        for entry in value:
            if filter_matches(entry.filter, tensor):
                return at_position(entry.value, t)
        return None
    return at_position(value, t)


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = Field(min_length=1)
    parameters: dict[str, ParamValue] = Field(default_factory=dict)


class SliceSource(BaseModel):
    """Layers [start, end) of one model, as mergekit's `layer_range`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = Field(min_length=1)
    layer_range: tuple[int, int]
    parameters: dict[str, ParamValue] = Field(default_factory=dict)

    @field_validator("layer_range")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if value[0] < 0 or value[1] <= value[0]:
            raise ValueError(f"layer_range must be [start, end) with 0 <= start < end (got {list(value)})")
        return value

    @property
    def length(self) -> int:
        return self.layer_range[1] - self.layer_range[0]


class SliceDef(BaseModel):
    """One block of output layers, each merged from the same offset of every source's range."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    sources: list[SliceSource] = Field(min_length=1)

    @model_validator(mode="after")
    def _same_length(self) -> "SliceDef":
        lengths = {s.length for s in self.sources}
        if len(lengths) > 1:
            raise ValueError(f"every source of a slice must span the same number of layers "
                             f"(got {sorted(lengths)})")
        return self


# mergekit's chat templates that we carry by name; any other name is refused, a Jinja text is used as is.
CHAT_TEMPLATES = {
    "chatml": ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
               "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
               "{% endif %}"),
}


class TokenizerDef(BaseModel):
    """mergekit's `tokenizer:` section: `source` and `pad_to_multiple_of` (per-token `tokens` are not supported)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str = Field(min_length=1)
    pad_to_multiple_of: Optional[int] = Field(None, ge=1)  # re-indexed embeddings get rows up to a multiple of it


class MergeConfig(BaseModel):
    """One merge: which models, which method, which settings. Saved with the output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: list[ModelEntry] = Field(default_factory=list)
    slices: Optional[list[SliceDef]] = None
    base_model: Optional[str] = None
    merge_method: str = "iso-cts"
    parameters: dict[str, ParamValue] = Field(default_factory=dict)
    alpha: Union[float, Literal["auto"]] = 1.0
    alpha_grid: Optional[list[float]] = None
    eval_data: list[str] = Field(default_factory=list)
    eval_tokens: int = Field(8192, ge=16)
    eval_seq_len: int = Field(256, ge=2)
    data: Optional[str] = None                # calibration text of the data-aware methods (regmean, fisher)
    text_field: str = Field("text", min_length=1)  # the field holding the text in a .jsonl data file
    calibration_tokens: int = Field(8192, ge=2)
    calibration_seq_len: int = Field(512, ge=2)
    out_dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    max_shard_size: Union[int, str] = "5GB"
    average_embeddings: bool = True
    embedding_pattern: str = DEFAULT_EMBEDDING_PATTERN
    seed: int = 0
    tokenizer_source: Optional[str] = None    # "base", "union", a merged model or a tokenizer directory
    tokenizer: Optional[TokenizerDef] = None  # mergekit's newer spelling of tokenizer_source
    chat_template: Optional[str] = None       # "auto", a name in CHAT_TEMPLATES, or a Jinja template

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "dtype" in data:
            # mergekit's `dtype` is its compute/output dtype; we compute in float32, so it names the output.
            dtype = data.pop("dtype")
            data.setdefault("out_dtype", dtype)
        method = str(data.get("merge_method", "")).strip().lower().replace("_", "-")
        if method in ("dare-ties", "dare-linear"):
            data = _density_as_drop_rate(data)
        return data

    @field_validator("tokenizer_source")
    @classmethod
    def _tokenizer_source(cls, value: Optional[str]) -> Optional[str]:
        return _check_tokenizer_source(value, "tokenizer_source")

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, value: Optional[TokenizerDef]) -> Optional[TokenizerDef]:
        if value is not None:
            value = value.model_copy(update={"source": _check_tokenizer_source(value.source, "tokenizer.source")})
        return value

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: Optional[str]) -> Optional[str]:
        if value is None or value == "auto" or value in CHAT_TEMPLATES or "{{" in value or "{%" in value:
            return value
        raise ValueError(f"chat_template '{value}' is not supported: use auto, "
                         f"{', '.join(CHAT_TEMPLATES)} or a Jinja template")

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
                message = error["msg"]
                if error["type"] == "extra_forbidden":
                    # mergekit keys we do not implement land here too: name the key, never a pydantic phrase
                    message = f"'{error['loc'][-1]}' is not a key mlx merge supports"
                problems.add(tuple(error["loc"]), message)
            _raw_problems(data, problems, frozenset(tuple(e["loc"]) for e in errors))
            problems.raise_if_any()
            raise

    @model_validator(mode="after")
    def _consistent(self) -> "MergeConfig":
        from mlxkit.engines.merge.methods import registry

        problems = _Problems()
        method = registry.get(self.merge_method)
        if bool(self.models) == bool(self.slices):
            problems.add(("models",), "give either models or slices (exactly one of them)")
            problems.raise_if_any()
        if self.tokenizer_source is not None and self.tokenizer is not None:
            problems.add(("tokenizer",), "give tokenizer_source or tokenizer, not both")
        entries = self.input_entries()
        n = len(entries)
        if self.slices:
            _check_slices(method, self, problems)
        else:
            _check_models(method, [entry.model for entry in entries], problems)
        _check_parameters(method, self.parameters, [entry.parameters for entry in entries], problems)
        source = self.tokenizer_policy()
        if source not in (None, "base"):
            known = {input_key(m) for m in [*(e.model for e in entries), *([self.base_model] if self.base_model
                                                                            else [])]}
            if source != "union" and input_key(source) not in known and not has_tokenizer_files(Path(source)):
                problems.add(("tokenizer_source",), f"tokenizer source '{source}' is not one of the merged models "
                                                    "or the base, nor a directory with tokenizer files")
        if self.alpha == "auto":
            if not method.uses_deltas:
                problems.add(("alpha",), f"alpha: auto needs a task-vector method, not '{method.name}'")
            if len(self.eval_data) != n:
                problems.add(("eval_data",), f"alpha: auto needs eval_data with one text file per model "
                                             f"({n} models, {len(self.eval_data)} files)")
        elif self.eval_data:
            problems.add(("eval_data",), "eval_data is only used with alpha: auto")
        if method.statistics is not None and self.data is None:
            problems.add(("data",), f"method '{method.name}' needs calibration text: pass --data "
                                    "(data: in a recipe)")
        elif method.statistics is None and self.data is not None:
            data_aware = ", ".join(name for name, m in registry.METHODS.items() if m.statistics is not None)
            problems.add(("data",), f"data is calibration text for the data-aware methods ({data_aware}), "
                                    f"not '{method.name}'")
        if self.data is None:
            # the settings of calibration without its text: a merge that would run without reading them. A
            # default is let through, as the merge.yaml saved with every output spells each one out.
            for key in ("calibration_tokens", "calibration_seq_len", "text_field"):
                if getattr(self, key) != type(self).model_fields[key].default:
                    problems.add((key,), f"{key} sets how the calibration text (data) is read; this merge has none")
        problems.raise_if_any()
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_defaults=False), sort_keys=False)

    def tokenizer_policy(self) -> Optional[str]:
        """Which vocabulary the output has: None (no policy: the inputs' tokenizers must agree), "base",
        "union", or a merged model or tokenizer directory (see `vocab.py`)."""
        return self.tokenizer.source if self.tokenizer is not None else self.tokenizer_source

    def input_entries(self) -> list[ModelEntry]:
        """The models whose tensors the method combines, in order, each with its parameters.

        As in mergekit, a base model listed among the inputs is taken out for methods that merge
        relative to it, and comes first for SLERP, whose t = 0 is the base. With slices, every
        model named by a source (parameters are then per source, see `plan.py`).
        """
        from mlxkit.engines.merge.methods import registry

        role = registry.get(self.merge_method).base_role
        if self.slices:
            seen: dict[str, ModelEntry] = {}
            for sl in self.slices:
                for src in sl.sources:
                    seen.setdefault(input_key(src.model), ModelEntry(model=src.model))
            entries = list(seen.values())
        else:
            entries = list(self.models)
        if self.base_model is None or role == "none":
            return entries
        base_key = input_key(self.base_model)
        rest = [e for e in entries if input_key(e.model) != base_key]
        if role == "base":
            return rest
        listed = [e for e in entries if input_key(e.model) == base_key]
        return [*(listed[:1] or [ModelEntry(model=self.base_model)]), *rest]


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
        key = input_key(spec)
        if key in seen:
            # twice the same task vector is not a merge of two tasks; a weight says "count it twice"
            problems.add(("models", i, "model"), f"'{spec}' is the same model as models.{seen[key]}; "
                                                 "list each input once (use weights to count one more)")
        seen.setdefault(key, i)


def _check_slices(method, config: "MergeConfig", problems: _Problems) -> None:
    """Each slice names as many models as the method takes, once each."""
    base_key = input_key(config.base_model) if config.base_model else None
    for i, sl in enumerate(config.slices or []):
        keys = [input_key(s.model) for s in sl.sources]
        if len(set(keys)) != len(keys):
            problems.add(("slices", i, "sources"), "a slice names the same model twice")
        merged = [k for k in keys if not (method.base_role == "base" and k == base_key)]
        n = len(merged)
        if n < method.min_models or (method.max_models is not None and n > method.max_models):
            want = str(method.min_models) if method.min_models == method.max_models else f"at least {method.min_models}"
            problems.add(("slices", i, "sources"), f"method '{method.name}' takes {want} models per slice (got {n})")
        for j, src in enumerate(sl.sources):
            _check_parameters(method, {}, [src.parameters], _Shifted(problems, ("slices", i, "sources", j)))


class _Shifted:
    """A `_Problems` view that files per-source parameter problems under the source's own path."""

    def __init__(self, problems: _Problems, prefix: tuple) -> None:
        self.problems, self.prefix = problems, prefix

    def add(self, loc: tuple, message: str) -> None:
        # `_check_parameters` files a source's parameters as models.0.parameters.<name>
        self.problems.add((*self.prefix, *loc[2:]) if loc[:2] == ("models", 0) else loc, message)


def _check_tokenizer_source(value: Optional[str], where: str) -> Optional[str]:
    if value is None:
        return None
    if value.strip().lower() in ("union", "base"):
        return value.strip().lower()
    if value.strip().startswith("model:"):
        value = value.strip()[len("model:"):].strip()  # mergekit's `model:<path>` form
    return value


def _density_as_drop_rate(data: dict[str, Any]) -> dict[str, Any]:
    """mergekit's DARE takes `density` (the fraction kept); we call its complement `drop_rate`."""
    def flip(value: Any) -> Any:
        if isinstance(value, list):
            return [flip(v) if not isinstance(v, dict) else {**v, "value": flip(v.get("value"))} for v in value]
        try:
            number = float(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            number = None
        return value if number is None else 1.0 - number

    def convert(params: Any) -> Any:
        if not isinstance(params, dict) or "density" not in params or "drop_rate" in params:
            return params  # both given: left for the checks to refuse `density`
        params = dict(params)
        params["drop_rate"] = flip(params.pop("density"))
        return params

    if "parameters" in data:
        data["parameters"] = convert(data["parameters"])
    for key in ("models",):
        if isinstance(data.get(key), list):
            data[key] = [dict(m, parameters=convert(m["parameters"])) if isinstance(m, dict) and "parameters" in m
                         else m for m in data[key]]
    if isinstance(data.get("slices"), list):
        data["slices"] = [dict(sl, sources=[dict(src, parameters=convert(src["parameters"]))
                                            if isinstance(src, dict) and "parameters" in src else src
                                            for src in sl["sources"]])
                          if isinstance(sl, dict) and isinstance(sl.get("sources"), list) else sl
                          for sl in data["slices"]]
    return data


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
        if not isinstance(value, list):
            entries = [(loc, value)]
        elif all(isinstance(e, FilteredValue) for e in value):
            entries = []
            for i, e in enumerate(value):
                entries += [((*loc, i, "value", j), v) for j, v in enumerate(e.value)] if isinstance(e.value, list) \
                    else [((*loc, i, "value"), e.value)]
        else:
            entries = [((*loc, i), v) for i, v in enumerate(value)]
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
                value = [{**e, "value": _typed_setting(pdef, e["value"])} if isinstance(e, dict) and "value" in e
                         else _typed_setting(pdef, e) for e in value]
            elif pdef is not None:
                value = _checked_or_same(pdef, value)
            out[name] = value
        return out

    data = dict(data, parameters=typed(data.get("parameters"))) if "parameters" in data else dict(data)
    if isinstance(data.get("models"), list):
        data["models"] = [dict(m, parameters=typed(m["parameters"])) if isinstance(m, dict) and "parameters" in m
                          else m for m in data["models"]]
    return data


def _typed_setting(pdef: ParamDef, value: Any) -> Any:
    return [_checked_or_same(pdef, v) for v in value] if isinstance(value, list) else _checked_or_same(pdef, value)


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
    if entries or not data.get("slices"):
        _check_models(method, [e.get("model") for e in entries], problems, skip)
    _check_parameters(method, parameters if isinstance(parameters, dict) else {}, model_parameters, problems, skip)


def input_key(spec: str) -> str:
    """What makes two inputs the same model: the resolved directory for local paths (so `./a` and
    `a/` match), the spec itself for hub ids. Resolving a path reads no weights."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec.strip()


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The raw mapping of a YAML recipe: a file (`.yaml`/`.yml`, or a path with a separator), or a bundled
    name under mlxkit.recipes/merge (a bare word, even when the working directory holds something of that name)."""
    p = Path(path)
    if not looks_like_file(path):
        bundled = packaged_yaml("mlxkit.recipes.merge", str(path))
        if bundled is None:
            raise RecipeError(f"recipe '{path}' is neither a file nor a bundled merge recipe")
        p = bundled
    return read_yaml_mapping(read_yaml_text(p, f"recipe '{p}'", RecipeError), f"recipe '{p}'", RecipeError)


def validate_config(data: dict[str, Any], origin: str = "options") -> MergeConfig:
    """A checked `MergeConfig`; one `RecipeError` lists every invalid key by its path."""
    return validate_model(MergeConfig, data, f"merge settings ({origin})", RecipeError)


def config_from_options(*, models: list[str], recipe: Optional[str], base: Optional[str], method: Optional[str],
                        isotropic: bool, alpha: Optional[str], eval_data: list[str],
                        parameters: dict[str, Any], average_embeddings: Optional[bool], dtype: Optional[str],
                        max_shard_size: Optional[str], seed: Optional[int], calibration_data: Optional[str] = None,
                        text_field: Optional[str] = None, calibration_tokens: Optional[int] = None,
                        tokenizer: Optional[str] = None) -> MergeConfig:
    """Merge CLI flags into a config: flags override the recipe; positional models replace its list.

    `parameters` are the method parameters the command line gives (`--set` pairs, read, and flags such
    as `--common-frac`), over the recipe's own; `common-frac` and `common_frac` name the same one.
    """
    if isotropic and method and method.replace("_", "-") not in ("iso-cts",):
        raise RecipeError(f"--isotropic means --method iso-cts; it conflicts with --method {method}")
    data: dict[str, Any] = {}
    if recipe:
        data = dict(read_recipe(recipe))
    if models:
        data["models"] = [{"model": m} for m in models]
    if not data.get("models") and not data.get("slices"):
        raise RecipeError("no models to merge: pass model paths or a --recipe with models: or slices:")
    if method or isotropic:
        data["merge_method"] = method or "iso-cts"
    recipe_parameters = data.get("parameters")
    if parameters:
        if recipe_parameters is not None and not isinstance(recipe_parameters, dict):
            raise RecipeError(f"merge settings (recipe '{recipe}') is invalid: parameters: must be a mapping of "
                              f"parameter names to values, not a {type(recipe_parameters).__name__}")
        given: dict[str, Any] = {}
        for key, value in parameters.items():
            name = key.replace("-", "_")
            if name in given:
                raise RecipeError(f"--set {name}= is given twice; give it once")
            given[name] = value
        data["parameters"] = {**(recipe_parameters or {}), **given}
    elif recipe_parameters is None:
        data.pop("parameters", None)  # mergekit writes `parameters:` with nothing under it for "none"
    # anything else (a list, a string) is left for the schema, which names `parameters` beside every other problem
    if alpha is not None:
        data["alpha"] = alpha  # a number or 'auto'; checked with the config like every other value
    if eval_data:
        data["eval_data"] = list(eval_data)
    for key, value in (("base_model", base), ("average_embeddings", average_embeddings), ("out_dtype", dtype),
                       ("max_shard_size", max_shard_size), ("seed", seed), ("data", calibration_data),
                       ("text_field", text_field), ("calibration_tokens", calibration_tokens)):
        if value is not None:
            data[key] = value
    if tokenizer is not None:
        if isinstance(data.get("tokenizer"), dict):  # keep the recipe's other tokenizer settings
            data["tokenizer"] = {**data["tokenizer"], "source": tokenizer}
        else:
            data["tokenizer_source"] = tokenizer
    return validate_config(data, origin=f"recipe '{recipe}' with the command-line flags" if recipe
                           else "command line")
