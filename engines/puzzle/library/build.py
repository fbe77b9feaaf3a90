"""`mlx library build`: build, train and score a Puzzle block library, resumably.

Stages (each skips what a previous, killed run already finished):
  1. calibration tokens (the user's --data, or text sampled from the parent);
  2. the parent's activations at every subblock boundary (cached once, by rank 0);
  3. BLD: initialise and train every non-trivial (layer, variant) subblock; ranks share the work;
  4. replace-1-block scoring of every variant on held-out tokens; ranks share the work;
  5. `library.json` (a `BlockLibrary`) with provenance, training curves and metrics.

The library stores no costs: they depend on the target and the deployment scenario, and
`mlx search` prices every variant for the one it is asked about.

Precision (the rule of `engines/training/device.py`): `--dtype auto` is bfloat16 on a GPU
that supports it and float32 on a CPU. The parent is inference-only, so it is held in that
compute dtype, and its activations are cached in it. BLD keeps each block's master weights
and AdamW state in float32 and runs the forward under autocast, with the loss in float32;
scoring takes log-softmax and KL in float32. Block files are written in the parent's
dtype, or in an explicit --dtype, or in --save-dtype when given. The run key records the
compute and save dtypes, so a directory is never resumed in another precision.

Memory: the parent is streamed from its safetensors files. Each rank holds the embedding, the
final norm and the head, plus the one decoder layer in use (caching the activations runs the
layers in turn; BLD initialises a layer's variants from that parent layer alone; scoring walks
the tail once per pass, one layer at a time), and the cached activations of one layer. Two
cases hold the whole parent: sampling calibration text (no --data), which runs `generate` on
the full model, loads it only for the sampling and frees it before anything else; and a parent
that is not a directory of safetensors in the Llama layout (a .gguf file, a hub id, pickle
weights), which is converted in memory as a whole (`LibraryBuildOptions(stream=False)` asks for
that path too; it is the reference the streamed one is tested against).

`ensure_library` is the build-if-missing entry `mlx search` uses: one cached library per
(parent weights, recipe contents, data, seed, dtypes) under `MLXKIT_CACHE/libraries/`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import statistics
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from mlxkit.engines.core.atomic import atomic_file
from mlxkit.engines.models.attention import prefer_sdpa
from mlxkit.engines.training.distributed import Distributed
from mlxkit.engines.core.manifest import Manifest, content_hash
from mlxkit.engines.core.paths import cache_dir
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.core.seeds import derive_seed
from mlxkit.engines.core.stage_key import StageKey, StageWork, digest_of, read_key_record
from mlxkit.engines.data.sampled import model_fingerprint
from mlxkit.engines.data.text import check_data_path
from mlxkit.engines.errors import InputError
from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant, ParentShape, parent_attention, parent_ffn
from mlxkit.engines.models.decilm.convert import ResidentParent, StreamedParent, from_parent
from mlxkit.engines.models.loading import (check_finite_files, check_finite_weights, check_local_weights, load_config,
                                           load_model, load_tokenizer, resolve_spec, source_dtype)
from mlxkit.engines.puzzle.library import activations
from mlxkit.engines.puzzle.library.block_init import initialise
from mlxkit.engines.puzzle.library.bld import train_subblock
from mlxkit.engines.puzzle.library.store import LibraryDir, read_library, write_library
from mlxkit.engines.puzzle.library.schema import BlockLibrary, BlockRecord, LayerEntry, ParentInfo, RunKey
from mlxkit.engines.puzzle.recipe import PuzzleRecipe, load_recipe
from mlxkit.engines.puzzle.library.scoring import ParentTail, Replacement, parent_metrics, score_streamed, score_subblock
from mlxkit.engines.puzzle.search_space import SearchSpace, VariantFilter, build_search_space
from mlxkit.engines.puzzle.subblocks import SubblockKind, parent_subblock
from mlxkit.engines.training.device import Placement, dtype_name, training_placement

# How each block's training seed is derived from the run seed; part of the run key, so a
# directory started under another rule is never resumed with this one.
BLOCK_SEED_RULE = "derive_seed(seed, layer, kind, variant)"


@dataclass(frozen=True)
class LibraryBuildOptions:
    model: str
    out: Path
    recipe: PuzzleRecipe
    data: Path | None = None
    text_field: str = "text"
    seed: int = 0
    train: bool = True           # False: initialisation only (the BLD ablation)
    score: bool = True
    score_only: bool = False
    allow_pickle: bool = False
    device: str = "auto"                 # see engines/training/device.py for the device and dtype rule
    dtype: str = "auto"
    save_dtype: str | None = None
    stream: bool = True                  # False: hold the whole parent in memory (the reference path)
    keep_activations: bool = False       # False: a finished library drops its activation cache
    variants: VariantFilter | None = None  # None: every variant of the recipe's search space


@dataclass(frozen=True)
class Precision:
    """Where a run computes, and the dtype its block files are written in."""

    placement: Placement
    save_dtype: torch.dtype


@dataclass(frozen=True)
class Unit:
    layer: int
    kind: SubblockKind
    variant: AttentionVariant | FFNVariant

    @property
    def label(self) -> str:
        return f"layer {self.layer} {self.kind} {self.variant.name}"


def run_library_build(options: LibraryBuildOptions, reporter: Reporter | None = None) -> dict[str, Any]:
    """Build (unless score-only) and score the library at `options.out`; returns a summary."""
    reporter = reporter or Reporter()
    started = time.time()
    # Scoring alone trains nothing, so it may run in float16; building trains every block.
    resolve = Placement.resolve if options.score_only else training_placement
    placement = resolve(options.device, options.dtype)
    dist = Distributed.from_env(placement.device)
    stack = contextlib.ExitStack()
    try:
        if options.out.exists() and not options.out.is_dir():
            raise InputError(f"--out '{options.out}' is a file; a block library is a directory")
        if options.data is not None:  # before the run key is written: a typo leaves no half-started library
            check_data_path(options.data)
        library = LibraryDir(options.out)
        if options.score_only:
            read_library(options.out)  # must exist and validate
        parent, layers, tokenizer, source = _open_parent(options, placement, reporter)
        stack.callback(layers.close)
        _check_memory(parent, options, placement)
        precision = Precision(placement, placement.save_dtype(source_dtype(source), options.save_dtype))
        recipe_space = build_search_space(ParentShape.from_config(parent.config), options.recipe.search_space)
        space = recipe_space if options.variants is None else recipe_space.only(options.variants)
        key = _check_or_write_state(library, options, layers, precision, dist, reporter)
        train_ids, val_ids = _calibration_tokens(options, layers, tokenizer, library, placement, dist, reporter)
        states_dir = library.work / "activations"
        if dist.is_main:
            activations.cache_states(parent, train_ids, val_ids, states_dir, reporter, layers=layers)
        dist.barrier()
        if not options.score_only:
            _build_blocks(parent, layers, space, library, options, precision, dist, reporter)
        dist.barrier()
        if options.score or options.score_only:
            _score(parent, layers, space, library, val_ids, placement, dist, reporter)
        dist.barrier()
        summary: dict[str, Any] = {}
        if dist.is_main:
            index = _write_index(parent, recipe_space, space, library, options, source, started, key)
            if not options.keep_activations:
                # Only building and scoring read the cache; the held-out tokens and the run key stay in .work/.
                shutil.rmtree(states_dir, ignore_errors=True)
            summary = summarise(index)
            summary["library"] = str(library.index_file)
            summary["built_for"] = _scope(options.variants)
            summary["wall_time_s"] = round(time.time() - started, 1)
        return summary
    finally:
        stack.close()
        dist.close()


def _open_parent(options: LibraryBuildOptions, placement: Placement, reporter: Reporter):
    """(converted parent, its layers, tokenizer, source): streamed from its safetensors files when it has
    them in the Llama layout, else loaded whole (see the module docstring)."""
    if options.stream:
        source = resolve_spec(options.model, reporter)
        if source.kind in ("directory", "alias") and source.path is not None and any(source.path.glob("*.safetensors")):
            check_local_weights(source, options.allow_pickle)
            check_finite_files(source.path, options.model)  # before anything is written
            config = load_config(str(source.path))
            prefer_sdpa(config)
            streamed = StreamedParent.open(source.path, config, dtype=placement.dtype, device=placement.device,
                                           spec=options.model)
            if streamed is not None:
                return streamed.model, streamed, load_tokenizer(source), source
            reason = "its safetensors files are not in the Llama layout"
        else:
            reason = {"gguf": "a GGUF file", "hub": "a hub id"}.get(source.kind, "stored without safetensors")
        reporter.notice(f"the parent '{options.model}' is {reason}: holding it whole in memory")
    parent, tokenizer, source = _load_parent(options, placement, reporter)
    return parent, ResidentParent(parent), tokenizer, source


def _check_memory(parent, options: LibraryBuildOptions, placement: Placement) -> None:
    """Refuse, before anything is written, a build whose lower-bound memory exceeds the device's.

    Counted: the parent's resident weights (a streamed parent's layers stay on the meta device),
    one layer at the widest FFN training in float32 with its gradients and AdamW moments, one
    batch of that layer's activations, and scoring's float32 log-probabilities over the held-out
    sequences: the parent's log-probabilities and probabilities, one variant's logits and log-probabilities,
    and their KL terms, each sequences × positions × vocabulary (`scoring.ParentTail`).
    """
    from mlxkit.engines.training.budget import activation_bytes, check_fits, optimiser_bytes

    config, recipe = parent.config, options.recipe
    resident = sum(p.numel() * p.element_size() for p in parent.parameters() if p.device.type != "meta")
    hidden, inner = int(config.hidden_size), int(getattr(config, "intermediate_size", 0) or 0)
    block = 3 * hidden * inner
    element = torch.finfo(placement.dtype).bits // 8
    one_layer = activation_bytes(config, recipe.bld.batch_sequences, recipe.data.seq_len, element)
    one_layer //= max(1, int(getattr(config, "num_hidden_layers", 1) or 1))
    training = (4 * block + optimiser_bytes(block) + one_layer) if not options.score_only else 0
    positions = recipe.data.score_sequences * (recipe.data.seq_len - 1)
    scoring = 5 * positions * int(config.vocab_size) * 4 if (options.score or options.score_only) else 0
    check_fits(resident + training + scoring, placement.device,
               f"the block library of '{options.model}' (recipe '{recipe.name}')")


def _load_parent(options: LibraryBuildOptions, placement: Placement, reporter: Reporter):
    """The parent, converted, on the run's device in the compute dtype (it is only ever run, never trained)."""
    loaded = load_model(options.model, dtype=placement.dtype, device=placement.device,
                        allow_pickle=options.allow_pickle, reporter=reporter)
    check_finite_weights(loaded.model, options.model)
    prefer_sdpa(loaded.model.config)
    parent = from_parent(loaded.model)
    prefer_sdpa(parent.config)
    for p in parent.parameters():
        p.requires_grad_(False)
    return parent, loaded.tokenizer, loaded.source


def _parent_fingerprint(layers: StreamedParent | ResidentParent) -> str:
    """`model_fingerprint` of the parent, from its files when it is streamed.

    The same digest as `engines/data/sampled.py`'s `model_fingerprint` (a test keeps the two
    equal): the config, then each tensor's name, shape and 64 strided values as float32.
    """
    if not layers.streamed:
        return model_fingerprint(layers.model)
    model = layers.model
    digest = hashlib.sha256()
    digest.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(layers.sampled_values(name, max(1, tensor.numel() // 64), 64).numpy().tobytes())
    return digest.hexdigest()[:16]


def _run_key(options: LibraryBuildOptions, layers: StreamedParent | ResidentParent, precision: Precision) -> RunKey:
    data = {"spec": str(options.data), "hash": content_hash(options.data)} if options.data else "sampled"
    return RunKey(parent=_parent_fingerprint(layers), data=data, seed=options.seed, data_settings=options.recipe.data,
                  train=options.train, bld=options.recipe.bld, search_space=options.recipe.search_space,
                  block_seed=BLOCK_SEED_RULE, compute_dtype=dtype_name(precision.placement.dtype),
                  save_dtype=dtype_name(precision.save_dtype))


def _check_or_write_state(library: LibraryDir, options: LibraryBuildOptions, layers: StreamedParent | ResidentParent,
                          precision: Precision, dist: Distributed, reporter: Reporter) -> RunKey | None:
    """Apply the stage-key rule to the library directory: an unfinished library built under the same key
    resumes, one under another key is discarded with a notice. A finished library under another key is an
    output, not stale work, and is refused; so is a directory that is no mlxkit library.

    Returns the key the directory's blocks were built under (None when an older mlxkit wrote
    it in another layout), which is what `library.json` records.
    """
    key = StageKey.of(_run_key(options, layers, precision))
    # A key written before a field existed holds that field's default (float32 dtypes).
    previous = read_key_record(library.run_key_file, RunKey.defaults())
    # Rescoring reads the blocks as they are: how they were trained, seeded or written does not matter.
    exempt = ("train", "block_seed", "save_dtype") if options.score_only else ()
    if previous is None:
        if options.score_only:
            raise InputError(f"'{library.root}' has no record of how it was built; rebuild it without --score-only")
        if dist.is_main and (library.index_file.exists() or (library.root.exists() and any(library.root.iterdir())
                                                              and not library.work.exists())):
            raise InputError(f"'{library.root}' exists and is not an unfinished mlxkit library; use another --out")
    elif library.index_file.exists() or options.score_only:
        changed = key.changed_from(previous, exempt)
        if changed:
            raise InputError(f"'{library.root}' holds a library built with other settings ({', '.join(changed)}); "
                             "use another --out, or delete it to start over")
        dist.barrier()
        # The stored key, not this run's: --score-only does not know how the blocks were trained.
        return _stored_run_key(previous)
    stage = StageWork(library.root, library.run_key_file, what="an unfinished block library", is_main=dist.is_main,
                      barrier=dist.barrier)
    if stage.open(key, reporter, defaults=RunKey.defaults()) == "same":
        return _stored_run_key(previous)
    return RunKey.model_validate(key.record)


def _stored_run_key(record: Any) -> RunKey | None:
    """The key a library directory records, or None when an older mlxkit wrote it in another layout."""
    try:
        return RunKey.model_validate(record)
    except ValidationError:
        return None


def _calibration_tokens(options: LibraryBuildOptions, layers: StreamedParent | ResidentParent, tokenizer,
                        library: LibraryDir, placement: Placement, dist: Distributed,
                        reporter: Reporter) -> tuple[torch.Tensor, torch.Tensor]:
    path = library.work / "tokens.pt"
    spec = options.recipe.data
    if dist.is_main and path.exists() and _read_tokens(path, spec.seq_len) is None:
        # made from --data and the seed alone, so made again the same; the run key guards the settings
        reporter.notice(f"the cached calibration tokens at {path} are unreadable; making them again")
        path.unlink()
    if dist.is_main and not path.exists():
        n_total = spec.train_sequences + spec.score_sequences
        if options.data is not None:
            from mlxkit.engines.data.text import pack, read_texts, split, tokenize

            ids = tokenize(tokenizer, read_texts(options.data, options.text_field), n_total * spec.seq_len)
            blocks = pack(ids, spec.seq_len)
            if blocks.shape[0] < 2:
                raise InputError(f"--data gives {blocks.shape[0]} sequence(s) of {spec.seq_len} tokens; "
                                 "need at least 2 (one to train, one to score)")
            train, val = split(blocks, spec.score_sequences / blocks.shape[0], options.seed)
            reporter.notice(f"calibration data: {options.data} ({train.shape[0]} training and {val.shape[0]} "
                            f"held-out sequences of {spec.seq_len} tokens)")
        else:
            from mlxkit.engines.data.sampled import sample_tokens

            # generate() runs the whole model: a streamed parent is loaded whole for the sampling
            # alone, and freed before the activations are cached.
            whole = layers.model if not layers.streamed else _load_parent(options, placement, reporter)[0]
            blocks = sample_tokens(whole, tokenizer, n_sequences=n_total, seq_len=spec.seq_len, seed=options.seed,
                                   reporter=reporter)
            if layers.streamed:
                del whole
                _release_memory(placement)
            train, val = blocks[spec.score_sequences:], blocks[:spec.score_sequences]
        with atomic_file(path) as tmp:
            torch.save({"train": train, "val": val}, tmp)
    dist.barrier()
    tokens = _read_tokens(path, spec.seq_len)
    if tokens is None:
        raise InputError(f"the calibration tokens at {path} are unreadable; delete {library.work} to start over")
    return tokens


def _read_tokens(path: Path, seq_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(train, val) token ids from `path`, or None when the file is damaged or not what BLD wrote."""
    try:
        tokens = torch.load(path, weights_only=True)
    except Exception:  # torch.load fails in many types on a damaged file; all mean "unreadable"
        return None
    if not isinstance(tokens, dict):
        return None
    parts = (tokens.get("train"), tokens.get("val"))
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.long and t.ndim == 2 and t.shape[1] == seq_len
               and t.shape[0] > 0 for t in parts):
        return None
    return parts


def _trainable_units(space: SearchSpace) -> list[Unit]:
    shape = space.parent
    units = []
    for layer in range(shape.num_layers):
        units += [Unit(layer, "attention", v) for v in space.attention
                  if v != parent_attention(shape) and v.kind != "no_op"]
        units += [Unit(layer, "ffn", v) for v in space.ffn if v != parent_ffn(shape) and v.kind != "no_op"]
    return units


def _build_blocks(parent, layers: StreamedParent | ResidentParent, space: SearchSpace, library: LibraryDir,
                  options: LibraryBuildOptions, precision: Precision, dist: Distributed, reporter: Reporter) -> None:
    """Initialise and train this rank's unfinished blocks, a layer at a time: each layer's cached
    states and its parent layer are held while that layer's variants train, then let go."""
    todo = [u for u in dist.share(_trainable_units(space)) if not library.has_block(u.layer, u.kind, u.variant.name)]
    if not todo:
        return
    spec = options.recipe.bld
    placement = precision.placement
    pos = activations.position_embeddings(parent, options.recipe.data.seq_len)
    held = contextlib.ExitStack()
    cached_layer, states = -1, None
    with held, reporter.task(f"BLD: training {len(todo)} subblocks" + (f" (rank {dist.rank})" if dist.world_size > 1
                                                                         else ""), total=len(todo)) as task:
        for unit in todo:
            if unit.layer != cached_layer:
                held.close()
                states = None
                states = activations.load_layer(library.work / "activations", unit.layer, space.parent.num_layers,
                                                device=placement.device)
                held.enter_context(layers.hold(unit.layer))
                cached_layer = unit.layer
            assert states is not None
            x, y, vx, vy = _block_data(states, unit.kind)
            source = parent_subblock(parent, unit.layer, unit.kind)
            # float32 master weights, whatever the parent's (compute) dtype
            block = initialise(source, unit.variant, parent.config, unit.layer, x, y, dtype=torch.float32)
            train = options.train and (unit.variant.kind != "linear" or spec.train_linear)
            # A hash of every part, so no two blocks share a seed and each block's seed is the
            # same whichever rank trains it, in whatever order.
            seed = derive_seed(options.seed, unit.layer, unit.kind, unit.variant.name)
            torch.manual_seed(seed)
            record = train_subblock(block, x, y, vx, vy, pos, spec if train else spec.model_copy(
                update={"tokens_per_block": 0}), seed=seed, placement=placement)
            library.save_block(block, BlockRecord(layer=unit.layer, kind=unit.kind, variant=asdict(unit.variant),
                                                  init=_init_name(unit), trained=record.steps > 0,
                                                  training=record.to_info()), dtype=precision.save_dtype)
            task.advance()
            task.update(last=unit.label, nmse=record.val_nmse_after)


def _block_data(states: activations.LayerStates, kind: SubblockKind) -> tuple[torch.Tensor, ...]:
    """(inputs, targets, held-out inputs, held-out targets) of a subblock: the states entering it and what
    the parent's subblock adds to them.

    The targets are differences of cached states taken in float32, so the subtraction adds
    no rounding of its own to what a bfloat16 cache holds (in float32 nothing changes).
    """
    if kind == "attention":
        before, after, val_before, val_after = states.train_in, states.train_mid, states.val_in, states.val_mid
    else:
        before, after, val_before, val_after = states.train_mid, states.train_out, states.val_mid, states.val_out
    return before, after.float() - before.float(), val_before, val_after.float() - val_before.float()


def _init_name(unit: Unit) -> str:
    if unit.variant.kind == "linear":
        return "least_squares"
    return "mean_pooled_kv_heads" if unit.kind == "attention" else "channel_contribution_pruning"


def _scoring_units(space: SearchSpace) -> list[Unit]:
    shape = space.parent
    units = []
    for layer in range(shape.num_layers):
        units += [Unit(layer, "attention", v) for v in space.attention if v != parent_attention(shape)]
        units += [Unit(layer, "ffn", v) for v in space.ffn if v != parent_ffn(shape)]
    return units


def _score(parent, layers: StreamedParent | ResidentParent, space: SearchSpace, library: LibraryDir,
           val_ids: torch.Tensor, placement: Placement, dist: Distributed, reporter: Reporter) -> None:
    """Replace-1-block scores: the parent and each block held in the compute dtype, the metrics in float32.

    A resident parent runs its tail once per variant; a streamed one takes the variants through
    the tail in passes (`score_streamed`), reading each layer once per pass. The scores are the same.
    """
    todo = [u for u in dist.share(_scoring_units(space)) if library.read_score(u.layer, u.kind, u.variant.name)
            is None]
    todo_parent = dist.is_main and library.read_score(-1, "parent", "parent") is None
    if not todo and not todo_parent:
        return
    pos = activations.position_embeddings(parent, val_ids.shape[1])
    final = activations.load_final(library.work / "activations", device=placement.device)["val_out"]
    tail = ParentTail(parent, val_ids, final, pos)
    if todo_parent:
        library.save_score(-1, "parent", "parent", parent_metrics(tail))
    if layers.streamed:
        return _score_streamed(parent, layers, tail, todo, library, val_ids, placement, reporter)
    cached_layer, states = -1, None
    with reporter.task(f"scoring {len(todo)} variants (replace-1-block KL)", total=len(todo)) as task:
        for unit in todo:
            if unit.layer != cached_layer:
                states = activations.load_layer(library.work / "activations", unit.layer, space.parent.num_layers,
                                                device=placement.device)
                cached_layer = unit.layer
            assert states is not None
            block = library.load_block(parent.config, unit.layer, unit.kind, unit.variant,  # type: ignore[arg-type]
                                       device=placement.device, dtype=placement.dtype)
            metrics = score_subblock(tail, block, unit.layer, states.val_in, states.val_mid)
            library.save_score(unit.layer, unit.kind, unit.variant.name, metrics)
            task.advance()
            task.update(last=unit.label, kl=metrics["kl_div"])


def _score_streamed(parent, layers: StreamedParent, tail: ParentTail, todo: list[Unit], library: LibraryDir,
                    val_ids: torch.Tensor, placement: Placement, reporter: Reporter) -> None:
    root = library.work / "activations"

    def load(unit: Unit):
        block = library.load_block(parent.config, unit.layer, unit.kind, unit.variant,  # type: ignore[arg-type]
                                   device=placement.device, dtype=placement.dtype)
        return (block, *activations.load_val_states(root, unit.layer, device=placement.device))

    replacements = [Replacement(u.layer, u.kind, functools.partial(load, u)) for u in todo]
    state_bytes = val_ids.numel() * parent.config.hidden_size * placement.dtype.itemsize
    with reporter.task(f"scoring {len(todo)} variants (replace-1-block KL)", total=len(todo)) as task:
        for index, metrics in score_streamed(tail, layers, replacements, state_bytes=state_bytes,
                                             progress=task.advance):
            unit = todo[index]
            library.save_score(unit.layer, unit.kind, unit.variant.name, metrics)
            task.update(last=unit.label, kl=metrics["kl_div"])


def _release_memory(placement: Placement) -> None:
    """Give freed tensors back: Python's cycles first, then CUDA's cached blocks."""
    gc.collect()
    if placement.is_cuda:
        torch.cuda.empty_cache()


def _write_index(parent, recipe_space: SearchSpace, space: SearchSpace, library: LibraryDir,
                 options: LibraryBuildOptions, source, started: float, key: RunKey | None) -> BlockLibrary:
    """`library.json` over the variants of `space` (this run's) and those an earlier run of the same key
    finished in this directory, in the recipe's order."""
    shape = space.parent
    # The parent's own variants carry the parent's metrics against itself, as scored (KL 0,
    # agreement 1, and its own LM loss); None when scoring was skipped.
    parent_scores = library.read_score(-1, "parent", "parent")
    layers = []
    for layer in range(shape.num_layers):
        entry: dict[str, dict[str, Any]] = {"attention": {}, "ffn": {}}
        for kind, variants, wanted, parent_variant in (
                ("attention", recipe_space.attention, space.attention, parent_attention(shape)),
                ("ffn", recipe_space.ffn, space.ffn, parent_ffn(shape))):
            for variant in variants:
                name = variant.name
                if variant not in wanted and not _finished_earlier(library, layer, kind, variant):
                    continue
                item: dict[str, Any] = {"variant": variant}
                if variant == parent_variant:
                    item.update(source="parent", metrics=parent_scores)
                    entry[kind][name] = item
                    continue
                if variant.kind == "no_op":
                    item.update(source="no_op")
                elif library.has_block(layer, kind, name):
                    record = library.read_record(layer, kind, name)
                    item.update(file=str(library.block_file(layer, kind, name).relative_to(library.root)),
                                source="bld" if record.trained else "init", init=record.init,
                                training=record.training)
                item.update(metrics=library.read_score(layer, kind, name))
                entry[kind][name] = item
        layers.append(LayerEntry(layer=layer, **entry))
    config = parent.config.to_dict() if hasattr(parent.config, "to_dict") else None
    index = BlockLibrary(
        parent=ParentInfo(spec=options.model, shape=shape,
                          config=json.loads(json.dumps(config, default=str)) if config is not None else None),
        recipe=options.recipe, run_key=key,
        calibration="sampled from the parent" if options.data is None else str(options.data),
        seed=options.seed, layers=layers)
    manifest = Manifest(verb="library build", started=started)
    manifest.add_input("parent", options.model, source.path)
    if options.data:
        manifest.add_input("data", str(options.data), options.data)
    manifest.seeds = {"seed": options.seed}
    manifest.settings = {"recipe": options.recipe.model_dump(), "train": options.train,
                         "built_for": _scope(options.variants)}
    manifest.results = {k: v for k, v in summarise(index).items() if k != "per_layer"}
    write_library(library.root, index)
    manifest.write(library.root)
    return index


def _scope(variants: VariantFilter | None) -> str:
    """What this run built, in words: the whole search space or the variants a serving engine builds."""
    return "every variant of the search space" if variants is None else f"the variants {variants.why}"


def _finished_earlier(library: LibraryDir, layer: int, kind: SubblockKind,
                      variant: AttentionVariant | FFNVariant) -> bool:
    """Whether an earlier run in this directory built (where it trains) and scored this variant."""
    if library.read_score(layer, kind, variant.name) is None:
        return False
    return variant.kind == "no_op" or library.has_block(layer, kind, variant.name)


def summarise(library: BlockLibrary) -> dict[str, Any]:
    """Per-layer scores and the library-wide median KL of non-trivial (trained or initialised) variants."""
    per_layer, kls, trained = [], [], 0
    for layer in library.layers:
        row: dict[str, Any] = {"layer": layer.layer}
        for kind in ("attention", "ffn"):
            entries = layer.entries(kind)
            row[kind] = {name: (item.metrics or {}).get("kl_div") for name, item in entries.items()}
            for item in entries.values():
                if item.source in ("bld", "init") and item.metrics and "kl_div" in item.metrics:
                    kls.append(item.metrics["kl_div"])
                trained += item.source == "bld"
        per_layer.append(row)
    return {"layers": len(per_layer), "variants_scored": len(kls), "subblocks_trained": trained,
            "median_kl_nontrivial": statistics.median(kls) if kls else None, "per_layer": per_layer}


# The layout of block files and scores a cached library holds; a new layout gets a new number,
# so `mlx search` never reuses a library whose blocks it would read differently.
BLOCK_FORMAT_VERSION = 1


def library_cache_key(model: str, recipe: str, *, data: Path | None = None, seed: int = 0, device: str = "auto",
                      dtype: str = "auto", save_dtype: str | None = None,
                      reporter: Reporter | None = None) -> dict[str, Any]:
    """Everything a cached library depends on: the parent's weights, the recipe's contents, the data,
    the seed, the compute and save dtypes and the block format.

    The parent is its files' content hash (a directory, a .gguf file, or the directory an alias
    resolves to); a hub id, which has no local files, is its spec. The recipe is its validated
    contents, so a YAML file edited in place is another recipe.
    """
    source = resolve_spec(model, reporter)
    placement = Placement.resolve(device, dtype)
    if data is not None:
        data = check_data_path(data)
    return {
        "parent": content_hash(source.path) if source.path is not None else f"hub:{source.hub_id}",
        "recipe": load_recipe(recipe).model_dump(mode="json"),
        "data": content_hash(data) if data is not None else "sampled",
        "seed": seed,
        "compute_dtype": dtype_name(placement.dtype),
        "save_dtype": dtype_name(placement.save_dtype(source_dtype(source), save_dtype)),
        "block_format": BLOCK_FORMAT_VERSION,
    }


def default_library_dir(model: str, recipe: str, *, data: Path | None = None, seed: int = 0, device: str = "auto",
                        dtype: str = "auto", save_dtype: str | None = None, reporter: Reporter | None = None) -> Path:
    """Where `mlx search` caches the library of these inputs: named by a digest of `library_cache_key`
    and the recipe (a recipe file by its stem)."""
    key = library_cache_key(model, recipe, data=data, seed=seed, device=device, dtype=dtype, save_dtype=save_dtype,
                            reporter=reporter)
    name = Path(recipe).stem if recipe.endswith((".yaml", ".yml")) else recipe
    return cache_dir() / "libraries" / f"{digest_of(key, 12)}-{name}"


def ensure_library(model: str, recipe: str, *, data: Path | None = None, seed: int = 0, allow_pickle: bool = False,
                   device: str = "auto", dtype: str = "auto", save_dtype: str | None = None,
                   variants: VariantFilter | None = None, reporter: Reporter | None = None) -> Path:
    """The cached library of (model weights, recipe contents, data, seed, dtypes), built and scored
    first if it has no index yet; a reused one is announced with the data and seed that built it.

    `variants` limits the build to what the caller will use (None: the whole search space). A cached
    library that lacks some of them is extended in place: its blocks and scores are kept, and only
    the missing variants are trained and scored. `device`, `dtype` and `save_dtype` follow
    `LibraryBuildOptions`.
    """
    reporter = reporter or Reporter()
    path = default_library_dir(model, recipe, data=data, seed=seed, device=device, dtype=dtype,
                               save_dtype=save_dtype, reporter=reporter)
    scope = "" if variants is None else f", {_scope(variants)}"
    if LibraryDir(path).index_file.exists():
        built = read_library(path)
        missing = missing_variants(built, variants)
        if not missing:
            reporter.notice(f"reusing the '{recipe}' block library of {model} at {path} "
                            f"(built from {built.calibration or 'unknown data'}, seed {built.seed})")
            return path
        reporter.notice(f"extending the '{recipe}' block library of {model} at {path} with {', '.join(missing)}"
                        f"{scope} (its {len(built.layers)} layers' other blocks and scores are kept)")
    else:
        reporter.notice(f"building the '{recipe}' block library for {model}{scope} at {path} "
                        "(resumable; reused by later searches with the same inputs)")
    run_library_build(LibraryBuildOptions(model=model, out=path, recipe=load_recipe(recipe), data=data, seed=seed,
                                          allow_pickle=allow_pickle, device=device, dtype=dtype,
                                          save_dtype=save_dtype, variants=variants),
                      reporter)
    return path


def missing_variants(library: BlockLibrary, variants: VariantFilter | None) -> list[str]:
    """The names of the variants `variants` asks for that some layer of `library` lacks, attention first."""
    if library.parent is None or library.recipe is None:
        return []
    space = build_search_space(library.parent.shape, library.recipe.search_space)
    if variants is not None:
        space = space.only(variants)
    missing = []
    for kind, wanted in (("attention", space.attention), ("ffn", space.ffn)):
        for variant in wanted:
            if any(variant.name not in layer.entries(kind) for layer in library.layers):  # type: ignore[arg-type]
                missing.append(f"{'FFN' if kind == 'ffn' else kind} {variant.name}")
    return missing
