"""Calibration statistics for the data-aware merge methods (RegMean, Fisher), one model at a time.

The `--data` text is tokenised by each input's tokenizer (the same ids for all when they share
one), cut at `calibration_tokens` and packed into `calibration_seq_len`-token sequences. Every
input model then makes one pass over its tokens, in float32 on the merge device, and only one
model is in memory at a time:

* "gram" (RegMean): for every `nn.Linear`, the sum XᵀX over its input rows (float32, [in, in])
  and the number of rows, under the layer's weight name. Memory: Σ in² floats over the linear
  layers, accumulated during the pass.
* "fisher": the diagonal empirical Fisher, the squared gradient of one sequence's mean
  next-token loss with the data's own next tokens as labels, averaged over the sequences, under
  each parameter's name. Memory: the model, its gradients and the Fisher values (3× the model).

Each model's statistics are one safetensors file under `$MLXKIT_CACHE/merge-statistics/`, named
by a digest of the model's weight files (resolved path, size and modification time of each), the
calibration token ids, the sequence length and the kind: a rerun with the same models and data
reads the files instead of running the models. The merge reads one tensor's statistics at a time
(`ModelStatistics.get`), as it reads the weights.
"""

from __future__ import annotations

import gc
import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional

import torch

from mlxkit.engines.core.atomic import atomic_file
from mlxkit.engines.core.paths import cache_dir
from mlxkit.engines.core.progress import Reporter, TaskHandle
from mlxkit.engines.data.text import pack, read_texts, tokenize
from mlxkit.engines.errors import InputError, MlxkitError, NonFiniteError
from mlxkit.engines.io.lazy_loader import LazyTensorLoader
from mlxkit.engines.merge.sources import MergeInput

if TYPE_CHECKING:
    from mlxkit.engines.merge.config import MergeConfig

StatisticsKind = Literal["gram", "fisher"]
STATISTICS_FORMAT = 1
# Sequences per forward in the Gram pass: it keeps no activations, so a few at once cost little.
GRAM_BATCH = 4


@torch.no_grad()
def collect_grams(model: torch.nn.Module, blocks: torch.Tensor, device: torch.device,
                  task: Optional[TaskHandle] = None) -> dict[str, tuple[torch.Tensor, int]]:
    """(XᵀX summed over the input rows, number of rows) of every `nn.Linear` of `model` on `blocks`,
    by the layer's weight name; the Grams are float32 on `device`."""
    grams: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook_for(name: str):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            rows = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            if name in grams:
                grams[name].addmm_(rows.T, rows)
            else:
                grams[name] = rows.T @ rows
            counts[name] = counts.get(name, 0) + rows.shape[0]
        return hook

    handles = [module.register_forward_hook(hook_for(f"{name}.weight"))
               for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    try:
        for start in range(0, blocks.shape[0], GRAM_BATCH):
            batch = blocks[start:start + GRAM_BATCH].to(device)
            model(input_ids=batch, use_cache=False)
            if task is not None:
                task.advance(batch.numel())
    finally:
        for handle in handles:
            handle.remove()
    return {name: (grams[name], counts[name]) for name in grams}


def collect_fisher(model: torch.nn.Module, blocks: torch.Tensor, device: torch.device,
                   task: Optional[TaskHandle] = None) -> dict[str, torch.Tensor]:
    """The diagonal empirical Fisher of every floating-point parameter, by name: the mean over the
    rows of `blocks` of (∂L/∂θ)², L the mean next-token loss of one row (float32, on `device`).

    Raises `NonFiniteError` when a row's loss is NaN or infinite.
    """
    params = {name: p for name, p in model.named_parameters() if p.is_floating_point()}
    fisher = {name: torch.zeros(p.shape, dtype=torch.float32, device=p.device) for name, p in params.items()}
    saved = {name: p.requires_grad for name, p in params.items()}
    try:
        for p in params.values():
            p.requires_grad_(True)
        with torch.enable_grad():
            for row in blocks:
                ids = row.unsqueeze(0).to(device)
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                if not bool(torch.isfinite(loss)):
                    raise NonFiniteError("the calibration loss is not finite; the model's weights or the data "
                                         "make it overflow")
                loss.backward()
                for name, p in params.items():
                    if p.grad is not None:
                        fisher[name].add_(p.grad.float().square())
                if task is not None:
                    task.advance(ids.numel())
    finally:
        model.zero_grad(set_to_none=True)
        for name, p in params.items():
            p.requires_grad_(saved[name])
    return {name: values.div_(blocks.shape[0]) for name, values in fisher.items()}


class ModelStatistics:
    """One model's stored calibration statistics, read one tensor at a time."""

    def __init__(self, path: Path, kind: StatisticsKind, skip: Optional[re.Pattern] = None) -> None:
        self.path, self.kind, self.skip = Path(path), kind, skip
        self._loader = LazyTensorLoader.from_path(self.path)
        self._names = set(self._loader.keys())

    def get(self, name: str) -> Optional[torch.Tensor]:
        """For tensor `name` (float32, CPU): with "gram", the mean input Gram XᵀX / n of the linear
        layer whose weight it is; with "fisher", its diagonal Fisher. None when none is stored, or
        when `skip` matches the name."""
        key = f"{self.kind}/{name}"
        if key not in self._names or (self.skip is not None and self.skip.search(name)):
            return None
        value = self._loader.get_tensor(key).float()
        if self.kind == "gram":
            value /= float(self._loader.get_tensor(f"count/{name}").item())
        return value

    def close(self) -> None:
        self._loader.close()


def calibration_statistics(config: "MergeConfig", kind: StatisticsKind, inputs: list[MergeInput],
                           tokenizer_source: MergeInput, device: torch.device, reporter: Optional[Reporter] = None,
                           context_length: Optional[int] = None) -> list[ModelStatistics]:
    """Every input's statistics on the text of `config.data`.

    Each model reads the text through its own tokenizer (the one of `tokenizer_source`, the
    tokenizer the output carries, when a model has none), so a tokenizer policy that merges
    models with differing vocabularies still gives every model ids it knows. The embedding and
    LM-head rows of such models are re-indexed by token before merging, so their Fisher values,
    indexed by each model's own ids, are left out: those tensors get the weighted average.
    Sequences are `calibration_seq_len` tokens, or fewer when `calibration_tokens` or the models'
    `context_length` is smaller.
    """
    from mlxkit.engines.errors import ModelLoadError
    from mlxkit.engines.models.loading import load_tokenizer, resolve_spec

    reporter = reporter or Reporter()
    if config.data is None:
        raise InputError(f"{_method_name(kind)} needs calibration text: pass --data (data: in a recipe)")
    _require_full_models(kind, inputs)
    seq_len, cut = min(config.calibration_seq_len, config.calibration_tokens), ""
    if context_length is not None and 2 <= context_length < seq_len:
        seq_len, cut = context_length, ", the models' context length"
    def tokenizer_of(model: MergeInput) -> Any:
        try:
            return load_tokenizer(resolve_spec(str(model.path)))
        except ModelLoadError:
            return None

    own = [tokenizer_of(inp) for inp in inputs]
    reference = tokenizer_of(tokenizer_source)
    for inp, tok in zip(inputs, own):
        if tok is None:
            if reference is None:
                raise InputError(f"'{inp.spec}' has no tokenizer to read the calibration text with, nor has "
                                 f"'{tokenizer_source.spec}'")
            reporter.notice(f"'{inp.spec}' has no tokenizer of its own: it reads the calibration text through "
                            f"the one of '{tokenizer_source.spec}'")
    tokenizers = [tok if tok is not None else reference for tok in own]
    # the output's vocabulary counts too: rows are re-indexed whenever an input's differs from it
    vocabularies = [tok.get_vocab() for tok in {id(t): t for t in [*tokenizers, reference] if t is not None}.values()]
    same_vocabulary = all(vocab == vocabularies[0] for vocab in vocabularies[1:])
    texts = read_texts(config.data, config.text_field)
    blocks = [pack(tokenize(tok, texts, max_tokens=config.calibration_tokens), seq_len) for tok in tokenizers]
    reporter.notice(f"calibration data: {config.data} ({blocks[0].numel()} tokens in {blocks[0].shape[0]} sequences "
                    f"of {seq_len}{cut}" + ("" if same_vocabulary else ", each model through its own tokenizer") + ")")
    if kind == "fisher" and not same_vocabulary:
        reporter.notice("fisher: the inputs' vocabularies differ, so the rows of the embeddings and LM head are "
                        "realigned by token; those tensors get the weighted average, not Fisher weights")
    skip = None if same_vocabulary or kind == "gram" else re.compile(config.embedding_pattern)
    return gather_statistics(kind, inputs, blocks, device, reporter, skip=skip)


def _path_for(key: dict[str, Any]) -> Path:
    """Where the statistics of one model, kind and token ids (`_cache_key`) are, or will be, stored."""
    return cache_dir() / "merge-statistics" / f"{_digest(key)}-{key['kind']}.safetensors"


def gather_statistics(kind: StatisticsKind, inputs: list[MergeInput], blocks: list[torch.Tensor],
                      device: torch.device, reporter: Optional[Reporter] = None,
                      skip: Optional[re.Pattern] = None) -> list[ModelStatistics]:
    """Each input's statistics on its token ids (`blocks`, aligned with `inputs`), from the cache or
    from one pass over its model; tensors whose name `skip` matches are read as having none."""
    from mlxkit.engines.models.loading import load_model

    reporter = reporter or Reporter()
    _require_full_models(kind, inputs)
    stored = []
    for inp, ids in zip(inputs, blocks, strict=True):
        key = _cache_key(inp, kind, ids)
        path = _path_for(key)
        cached = _cached(path, kind, skip, reporter)
        if cached is not None:
            reporter.notice(f"calibration statistics ({kind}) of {inp.spec}: reusing {path}")
            stored.append(cached)
            continue
        model = load_model(str(inp.path), device=device, with_tokenizer=False, reporter=reporter).model
        try:
            with reporter.task(f"{kind} statistics of {inp.spec}", total=ids.numel()) as task:
                tensors = _compute(kind, model, ids, device, task)
        except NonFiniteError as exc:
            raise NonFiniteError(f"model '{inp.spec}': {exc}") from None
        finally:
            del model
            gc.collect()
        _write(path, tensors, key, inp.spec)
        reporter.notice(f"calibration statistics ({kind}) of {inp.spec}: {ids.numel()} tokens, "
                        f"stored at {path}")
        stored.append(ModelStatistics(path, kind, skip))
    return stored


def _cached(path: Path, kind: StatisticsKind, skip: Optional[re.Pattern],
            reporter: Reporter) -> Optional[ModelStatistics]:
    """The statistics cached at `path`, or None when there are none or they cannot be read.

    They are derived data: a damaged file (cut short, a broken header, no tensors of this kind) is
    removed with a notice and computed again.
    """
    if not path.exists():
        return None
    try:
        stored = ModelStatistics(path, kind, skip)
        if not any(name.startswith(f"{kind}/") for name in stored._names):
            stored.close()
            raise InputError(f"it holds no {kind} statistics")
        return stored
    except MlxkitError as exc:
        reporter.notice(f"the cached calibration statistics at {path} are unreadable ({exc}); computing them again")
    path.unlink(missing_ok=True)
    return None


def _method_name(kind: StatisticsKind) -> str:
    return "RegMean" if kind == "gram" else "Fisher merging"


def _require_full_models(kind: StatisticsKind, inputs: list[MergeInput]) -> None:
    for inp in inputs:
        if inp.kind != "model":
            raise InputError(f"{_method_name(kind)} runs each input model on the calibration data; '{inp.spec}' "
                             "is a LoRA adapter: merge it into its base first")


def _compute(kind: StatisticsKind, model: torch.nn.Module, blocks: torch.Tensor, device: torch.device,
             task: TaskHandle) -> dict[str, torch.Tensor]:
    """The tensors of one statistics file: `gram/<weight>` with `count/<weight>`, or `fisher/<parameter>`."""
    if kind == "fisher":
        return {f"fisher/{name}": values for name, values in collect_fisher(model, blocks, device, task).items()}
    tensors: dict[str, torch.Tensor] = {}
    for name, (gram, count) in collect_grams(model, blocks, device, task).items():
        tensors[f"gram/{name}"] = gram
        tensors[f"count/{name}"] = torch.tensor([count], dtype=torch.int64)
    return tensors


def _write(path: Path, tensors: dict[str, torch.Tensor], key: dict[str, Any], spec: str) -> None:
    from safetensors.torch import save_file

    for name, value in tensors.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise NonFiniteError(f"model '{spec}': the calibration statistics of '{name.split('/', 1)[1]}' "
                                 "are not finite")
    metadata = {"format": str(STATISTICS_FORMAT), "key": json.dumps(key, sort_keys=True), "model": spec}
    with atomic_file(path) as tmp:
        save_file({name: value.detach().to("cpu").contiguous() for name, value in tensors.items()}, str(tmp),
                  metadata=metadata)


def _cache_key(model: MergeInput, kind: StatisticsKind, blocks: torch.Tensor) -> dict[str, Any]:
    # The weight files' sizes and modification times stand in for their contents: hashing a large
    # checkpoint in full would cost more than many reruns save, and rewriting a file changes them.
    root = Path(model.path).resolve()
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    tokens = hashlib.sha256(blocks.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
    return {"format": STATISTICS_FORMAT, "kind": kind, "model": str(root),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
            "tokens": tokens, "shape": list(blocks.shape)}


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
