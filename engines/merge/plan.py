"""Plan a merge: one task per output tensor, built from headers only (no tensor data is read).

Planning is also where inputs are checked against each other, so a vocabulary or shape mismatch
fails in seconds with the tensor and the models named, before any arithmetic starts. Under a
tokenizer policy whose vocabularies differ, embedding tensors may differ in rows: their tasks
are re-indexed by token as they are read (`vocab.py`).
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
from mlxkit.engines.merge.vocab import VocabAlignment

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
    # (input index, tensor name in that input), aligned with model_params; empty: every input, same name
    sources: list[tuple[int, str]] = []
    base_name: Optional[str] = None         # the base's tensor (differs from `name` under slices)
    vocab_rows: Optional[int] = None        # rows re-indexed by token to the output vocabulary (plan.vocab)

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        what = "copy" if self.action == "copy" else ("matrix" if self.matrix else "mean/elementwise")
        extra = {k: v for k, v in self.params.items()}
        per_model = [p for p in self.model_params if p]
        rows = " rows by token" if self.vocab_rows is not None else ""
        return f"{self.name} [{shape} {self.out_dtype}] {what}{rows} {extra or ''} {per_model or ''}".rstrip()


class MergePlan(BaseModel):
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    method: str
    uses_deltas: bool
    alpha: Any
    base: Optional[str]
    models: list[str]
    tasks: list[TensorTask]
    largest_tensor_bytes: int
    reference_config: Optional[dict[str, Any]] = None  # config.json of the base (else first model), parsed
    vocab: Optional[VocabAlignment] = None  # where re-indexed embedding rows come from, under a tokenizer policy

    def summary(self) -> dict[str, Any]:
        return {"method": self.method, "alpha": self.alpha, "base": self.base, "models": self.models,
                "tensors": len(self.tasks), "matrices": sum(t.matrix for t in self.tasks),
                "copied": sum(t.action == "copy" for t in self.tasks),
                "estimated_peak_bytes": (len(self.models) + 3) * self.largest_tensor_bytes,
                **({"tokenizer": self.vocab.summary()} if self.vocab is not None else {})}


def _dims(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


# The decoder-layer index in a tensor name: model.layers.3., transformer.h.3., ...blocks.3.
_LAYER = re.compile(r"(^|\.)(layers|h|blocks|block|layer)\.(\d+)\.")
# Tensors that come before the first layer (mergekit's "pre weights"); other non-layer tensors come after it.
_PRE = re.compile(r"(^|\.)(embed_tokens|wte|wpe|word_embeddings|embed_in|embeddings)(\.|$)")


def layer_of(name: str) -> Optional[int]:
    match = _LAYER.search(name)
    return int(match.group(3)) if match else None


def _with_layer(name: str, layer: int) -> str:
    match = _LAYER.search(name)
    assert match is not None
    return f"{name[:match.start(3)]}{layer}{name[match.end(3):]}"


def layer_count(config: Optional[dict[str, Any]], names: list[str]) -> int:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if config and isinstance(config.get(key), int):
            return config[key]
    layers = [i for i in map(layer_of, names) if i is not None]
    return max(layers) + 1 if layers else 0


def depth(name: str, num_layers: int) -> float:
    """Where a tensor sits for gradient parameters, as mergekit 0.1 places it: layer i of a block
    of N layers at i/(N-1) (at 1 when N = 1), and every tensor outside the layers (embeddings,
    final norm, LM head) at 0."""
    layer = layer_of(name)
    if layer is None:
        return 0.0
    return layer / (num_layers - 1) if num_layers > 1 else 1.0


def _params_at(method, config: MergeConfig, per_model: list[dict[str, Any]], name: str, t: float
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Global and per-model parameter values for one tensor (`per_model`: each input's settings)."""
    params = {}
    for key, pdef in method.all_parameters().items():
        if pdef.per_model:
            continue
        value = resolve_param(config.parameters[key], name, t) if key in config.parameters else None
        params[key] = pdef.default if value is None else pdef.check(value)  # checked already: coerces
    model_params = []
    for settings in per_model:
        mp = {}
        for key, pdef in method.all_parameters().items():
            if not pdef.per_model:
                continue
            raw = settings.get(key, config.parameters.get(key))
            value = resolve_param(raw, name, t) if raw is not None else None
            mp[key] = pdef.default if value is None else pdef.check(value)
        model_params.append(mp)
    return params, model_params


def plan_merge(config: MergeConfig, inputs: list[MergeInput], base: Optional[MergeInput],
               vocab: Optional[VocabAlignment] = None) -> MergePlan:
    """Check the inputs against the reference (base, else the first model) and list the tensors;
    with `vocab`, embedding tensors are re-indexed to its rows."""
    method = registry.get(config.merge_method)
    if base is None and (method.needs_base or any(i.kind == "lora" for i in inputs)):
        raise InputError(f"method '{method.name}' needs a base model: pass --base (or base_model in the recipe), "
                         "or use inputs that name it (adapter_config.json base_model_name_or_path, "
                         "README front matter base_model:)")
    if vocab is not None and config.alpha == "auto":
        raise InputError("alpha: auto evaluates the base with the merged task vector, so it needs inputs that "
                         "share the base's vocabulary; give alpha a number")
    if config.slices:
        return _with_vocabulary(_plan_slices(config, method, inputs, base, vocab), vocab)
    reference = base if base is not None else inputs[0]
    if reference.kind == "lora":
        raise InputError(f"the base model '{reference.spec}' is a LoRA adapter; pass the full model it adapts")
    reference_config = reference.read_config()  # written with the output: a malformed one fails now, not last
    ref_tensors = reference.tensors
    embed_re = re.compile(config.embedding_pattern)
    _check_compatible(reference, inputs, embed_re, realign=vocab is not None)
    num_layers = layer_count(reference_config, list(ref_tensors))
    settings = [entry.parameters for entry in config.input_entries()]

    tasks: list[TensorTask] = []
    largest = 0
    for name, info in ref_tensors.items():
        largest = max(largest, info.numel * 4)
        params, model_params = _params_at(method, config, settings, name, depth(name, num_layers))
        tasks.append(_task(config, name, name, info, params, model_params,
                           [(i, name) for i in range(len(inputs))], base is not None, embed_re, vocab))
    return _with_vocabulary(MergePlan(method=method.name, uses_deltas=method.uses_deltas, alpha=config.alpha,
                                      base=base.spec if base else None, models=[i.spec for i in inputs], tasks=tasks,
                                      largest_tensor_bytes=largest, reference_config=reference_config), vocab)


def _with_vocabulary(plan: MergePlan, vocab: Optional[VocabAlignment]) -> MergePlan:
    """The plan carrying `vocab`, its config.json saying the re-indexed row count."""
    if vocab is None:
        return plan
    config = dict(plan.reference_config) if plan.reference_config is not None else None
    if config is not None:
        config["vocab_size"] = vocab.rows
    return plan.model_copy(update={"vocab": vocab, "reference_config": config})


def _reindexed(name: str, embed_re: re.Pattern, vocab: Optional[VocabAlignment]) -> bool:
    return vocab is not None and bool(embed_re.search(name))


def _task(config: MergeConfig, name: str, base_name: Optional[str], info, params: dict[str, Any],
          model_params: list[dict[str, Any]], sources: list[tuple[int, str]], has_base: bool,
          embed_re: re.Pattern, vocab: Optional[VocabAlignment] = None) -> TensorTask:
    vocab_rows = vocab.rows if vocab is not None and _reindexed(name, embed_re, vocab) and info.shape else None
    shape = (vocab_rows, *info.shape[1:]) if vocab_rows is not None else info.shape
    is_float = info.dtype in _FLOAT_DTYPES
    out_dtype = config.out_dtype if (config.out_dtype and is_float) else info.dtype
    embedding = bool(embed_re.search(name))
    matrix = len(info.shape) == 2 and not (embedding and config.average_embeddings)
    # keyed by the tensor's name, not its position, so the order tensors are merged in does not matter
    seed = derive_seed(config.seed, "merge", name)
    return TensorTask(name=name, shape=shape, out_dtype=out_dtype, action="merge" if is_float else "copy",
                      matrix=matrix, params=params, model_params=model_params, seed=seed, sources=sources,
                      base_name=base_name if has_base else None, vocab_rows=vocab_rows)


def _plan_slices(config: MergeConfig, method, inputs: list[MergeInput], base: Optional[MergeInput],
                 vocab: Optional[VocabAlignment] = None) -> MergePlan:
    """Output layers block by block: layer j of a slice merges layer start+j of each source.

    Tensors before the first layer are merged from the first slice's models, those after the last
    layer from the last slice's, as mergekit does; the base (when given) supplies the same layer
    from its own range in the slice, or the same index as the first source when it is not listed.
    """
    from mlxkit.engines.merge.config import input_key

    by_key = {input_key(inp.spec): i for i, inp in enumerate(inputs)}
    base_key = input_key(base.spec) if base is not None else None
    embed_re = re.compile(config.embedding_pattern)
    slices = config.slices or []
    total = sum(sl.sources[0].length for sl in slices)
    drop_base = method.base_role == "base"

    def members(sl) -> list[tuple[int, Any]]:
        mem = [(by_key[input_key(s.model)], s) for s in sl.sources
               if not (drop_base and input_key(s.model) == base_key)]
        if method.base_role == "input":  # SLERP: the base first, whatever the order of the sources
            mem.sort(key=lambda m: input_key(m[1].model) != base_key)
        return mem

    def base_source(sl):
        return next((s for s in sl.sources if input_key(s.model) == base_key), None)

    first_ref = base if base is not None else inputs[members(slices[0])[0][0]]
    reference_config = first_ref.read_config()
    tasks: list[TensorTask] = []
    largest = 0

    def add(name: str, sources: list[tuple[int, str, Any]], base_name: Optional[str], t: float) -> None:
        nonlocal largest
        for i, src_name, _ in sources:
            if src_name not in inputs[i].tensors:
                raise InputError(f"tensor '{src_name}' is not in '{inputs[i].spec}' (needed for output '{name}')")
        info = inputs[sources[0][0]].tensors[sources[0][1]]
        # re-indexed by token, an embedding may have other rows in each input
        same = (lambda shape: shape[1:] == info.shape[1:]) if _reindexed(name, embed_re, vocab) else \
            (lambda shape: shape == info.shape)
        for i, src_name, _ in sources[1:]:
            if not same(inputs[i].tensors[src_name].shape):
                raise InputError(f"shape mismatch: '{src_name}' is {_dims(inputs[i].tensors[src_name].shape)} in "
                                 f"'{inputs[i].spec}' but {_dims(info.shape)} in '{inputs[sources[0][0]].spec}'")
        if base is not None and base_name is not None:
            if base_name not in base.tensors or not same(base.tensors[base_name].shape):
                raise InputError(f"the base '{base.spec}' has no tensor '{base_name}' of shape {_dims(info.shape)}")
        largest = max(largest, info.numel * 4)
        params, model_params = _params_at(method, config, [p for _, _, p in sources], name, t)
        tasks.append(_task(config, name, base_name, info, params, model_params,
                           [(i, n) for i, n, _ in sources], base is not None, embed_re, vocab))

    def outer(sl, pre: bool) -> None:
        mem = members(sl)
        ref = inputs[mem[0][0]]
        for name in ref.tensors:
            if layer_of(name) is None and bool(_PRE.search(name)) == pre:
                add(name, [(i, name, s.parameters) for i, s in mem], name, 0.0)

    outer(slices[0], pre=True)
    out_layer = 0
    for sl in slices:
        mem = members(sl)
        ref_src = base_source(sl) or mem[0][1]
        ref_input = base if base_source(sl) is not None and base is not None else inputs[mem[0][0]]
        start = ref_src.layer_range[0]
        for j in range(sl.sources[0].length):
            layer_names = [n for n in ref_input.tensors if layer_of(n) == start + j]
            if not layer_names:
                raise InputError(f"'{ref_input.spec}' has no layer {start + j} (slice layer_range "
                                 f"{list(ref_src.layer_range)})")
            length = sl.sources[0].length
            t = j / (length - 1) if length > 1 else 1.0  # mergekit restarts gradients in every slice
            for name in layer_names:
                sources = [(i, _with_layer(name, s.layer_range[0] + j), s.parameters) for i, s in mem]
                bsrc = base_source(sl)
                base_name = _with_layer(name, (bsrc or mem[0][1]).layer_range[0] + j) if base is not None else None
                add(_with_layer(name, out_layer), sources, base_name, t)
            out_layer += 1
    outer(slices[-1], pre=False)
    if reference_config is not None:
        reference_config = dict(reference_config)
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(reference_config.get(key), int):
                reference_config[key] = total
    return MergePlan(method=method.name, uses_deltas=method.uses_deltas, alpha=config.alpha,
                     base=base.spec if base else None, models=[i.spec for i in inputs], tasks=tasks,
                     largest_tensor_bytes=largest, reference_config=reference_config)


def _check_compatible(reference: MergeInput, inputs: list[MergeInput], embed_re: re.Pattern,
                      realign: bool = False) -> None:
    """Same tensors, same shapes; with `realign`, embedding tensors only in their trailing dims."""
    ref = reference.tensors

    def differs(name: str, shape: tuple[int, ...]) -> bool:
        want = ref[name].shape
        return shape[1:] != want[1:] if realign and embed_re.search(name) else shape != want

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
            shapes = [(n, inp.tensors[n].shape) for n in ref if differs(n, inp.tensors[n].shape)]
        else:
            unknown = [n for n in inp.targets() if n not in ref]
            if unknown:
                raise InputError(f"LoRA adapter '{inp.spec}' targets '{unknown[0]}', which the base "
                                 f"'{reference.spec}' does not have")
            shapes = [(n, inp.tensors[k].shape) for n, k in inp.replaced.items() if differs(n, inp.tensors[k].shape)]
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
                                 f"{_dims(shape)} in '{inp.spec}'; set tokenizer_source (or --tokenizer) to base, "
                                 "union or a tokenizer directory to align the rows by token")
            raise InputError(f"shape mismatch: '{name}' is {_dims(ref_shape)} in '{reference.spec}' but "
                             f"{_dims(shape)} in '{inp.spec}'")
