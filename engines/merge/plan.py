"""Plan a merge: one task per output tensor, built from headers only (no tensor data is read).

Planning is also where inputs are checked against each other, so a vocabulary or shape mismatch
fails in seconds with the tensor and the models named, before any arithmetic starts.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict

from mlxkit.engines.core.seeds import derive_seed
from mlxkit.engines.errors import InputError
from mlxkit.engines.merge.config import MergeConfig, resolve_param
from mlxkit.engines.merge.methods import registry
from mlxkit.engines.merge.sources import MergeInput

_FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}


class TensorTask(BaseModel):
    """How one output tensor is made."""

    model_config = ConfigDict(frozen=True)

    name: str
    shape: tuple[int, ...]
    out_dtype: str
    action: Literal["merge", "copy"]        # copy: non-float buffers, taken from the reference model
    matrix: bool                            # spectral methods treat it as a matrix
    params: dict[str, Any]
    model_params: list[dict[str, Any]]
    seed: int

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        what = "copy" if self.action == "copy" else ("matrix" if self.matrix else "mean/elementwise")
        extra = {k: v for k, v in self.params.items()}
        per_model = [p for p in self.model_params if p]
        return f"{self.name} [{shape} {self.out_dtype}] {what} {extra or ''} {per_model or ''}".rstrip()


class MergePlan(BaseModel):
    model_config = ConfigDict(frozen=True)

    method: str
    uses_deltas: bool
    alpha: Any
    base: Optional[str]
    models: list[str]
    tasks: list[TensorTask]
    largest_tensor_bytes: int
    reference_config: Optional[dict[str, Any]] = None  # config.json of the base (else first model), parsed

    def summary(self) -> dict[str, Any]:
        return {"method": self.method, "alpha": self.alpha, "base": self.base, "models": self.models,
                "tensors": len(self.tasks), "matrices": sum(t.matrix for t in self.tasks),
                "copied": sum(t.action == "copy" for t in self.tasks),
                "estimated_peak_bytes": (len(self.models) + 3) * self.largest_tensor_bytes}


def _dims(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def plan_merge(config: MergeConfig, inputs: list[MergeInput], base: Optional[MergeInput]) -> MergePlan:
    """Check the inputs against the reference (base, else the first model) and list the tensors."""
    method = registry.get(config.merge_method)
    if base is None and (method.needs_base or any(i.kind == "lora" for i in inputs)):
        raise InputError(f"method '{method.name}' needs a base model: pass --base (or base_model in the recipe), "
                         "or use inputs that name it (adapter_config.json base_model_name_or_path, "
                         "README front matter base_model:)")
    reference = base if base is not None else inputs[0]
    if reference.kind == "lora":
        raise InputError(f"the base model '{reference.spec}' is a LoRA adapter; pass the full model it adapts")
    reference_config = reference.read_config()  # written with the output: a malformed one fails now, not last
    ref_tensors = reference.tensors
    embed_re = re.compile(config.embedding_pattern)
    _check_compatible(reference, inputs, embed_re)

    tasks: list[TensorTask] = []
    largest = 0
    for name, info in ref_tensors.items():
        is_float = info.dtype in _FLOAT_DTYPES
        out_dtype = config.out_dtype if (config.out_dtype and is_float) else info.dtype
        largest = max(largest, info.numel * 4)
        params = {}
        for key, pdef in method.all_parameters().items():
            if pdef.per_model:
                continue
            value = resolve_param(config.parameters[key], name) if key in config.parameters else None
            params[key] = pdef.default if value is None else pdef.check(value)  # checked already: coerces
        model_params = []
        for entry in config.models:
            mp = {}
            for key, pdef in method.all_parameters().items():
                if not pdef.per_model:
                    continue
                raw = entry.parameters.get(key, config.parameters.get(key))
                value = resolve_param(raw, name) if raw is not None else None
                mp[key] = pdef.default if value is None else pdef.check(value)
            model_params.append(mp)
        embedding = bool(embed_re.search(name))
        matrix = len(info.shape) == 2 and not (embedding and config.average_embeddings)
        # keyed by the tensor's name, not its position, so the order tensors are merged in does not matter
        seed = derive_seed(config.seed, "merge", name)
        tasks.append(TensorTask(name=name, shape=info.shape, out_dtype=out_dtype,
                                action="merge" if is_float else "copy", matrix=matrix, params=params,
                                model_params=model_params, seed=seed))
    return MergePlan(method=method.name, uses_deltas=method.uses_deltas, alpha=config.alpha,
                     base=base.spec if base else None, models=[i.spec for i in inputs], tasks=tasks,
                     largest_tensor_bytes=largest, reference_config=reference_config)


def _check_compatible(reference: MergeInput, inputs: list[MergeInput], embed_re: re.Pattern) -> None:
    ref = reference.tensors
    for inp in inputs:
        if inp is reference:
            continue
        if inp.kind == "model":
            missing = [n for n in ref if n not in inp.tensors]
            extra = [n for n in inp.tensors if n not in ref]
            if missing or extra:
                name = (missing or extra)[0]
                where, other = (reference.spec, inp.spec) if missing else (inp.spec, reference.spec)
                more = len(missing) + len(extra) - 1
                raise InputError(f"tensor '{name}' is in '{where}' but not in '{other}'"
                                 + (f" ({more} more differ)" if more else "") + "; the models have different layouts")
            shapes = [(n, inp.tensors[n].shape) for n in ref if inp.tensors[n].shape != ref[n].shape]
        else:
            unknown = [n for n in inp.targets() if n not in ref]
            if unknown:
                raise InputError(f"LoRA adapter '{inp.spec}' targets '{unknown[0]}', which the base "
                                 f"'{reference.spec}' does not have")
            shapes = [(n, inp.tensors[k].shape) for n, k in inp.replaced.items()
                      if inp.tensors[k].shape != ref[n].shape]
            targets = []
            for n, mod in inp.modules.items():
                a, b = inp.tensors[mod.a_key].shape, inp.tensors[mod.b_key].shape
                want = ref[n].shape
                got = (b[0], a[1]) if not (mod.embedding or mod.fan_in_fan_out) else (a[1], b[0])
                if len(want) != 2 or tuple(got) != tuple(want):
                    targets.append((n, got))
            shapes += targets
        if shapes:
            name, shape = shapes[0]
            ref_shape = ref[name].shape
            if embed_re.search(name):
                raise InputError(f"vocabulary mismatch: '{name}' is {_dims(ref_shape)} in '{reference.spec}' but "
                                 f"{_dims(shape)} in '{inp.spec}'; merge models that share a tokenizer")
            raise InputError(f"shape mismatch: '{name}' is {_dims(ref_shape)} in '{reference.spec}' but "
                             f"{_dims(shape)} in '{inp.spec}'")
