"""`mlx distill --bld`: build, train and score a Puzzle block library, resumably.

Stages (each skips what a previous, killed run already finished):
  1. calibration tokens (the user's --data, or text sampled from the parent);
  2. the parent's activations at every subblock boundary (cached once, by rank 0);
  3. BLD: initialise and train every non-trivial (layer, variant) subblock; ranks share the work;
  4. replace-1-block scoring of every variant on held-out tokens; ranks share the work;
  5. `library.json` with provenance, training curves, metrics and (optionally) cost stats.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mlxkit.engines.core.distributed import Distributed
from mlxkit.engines.core.manifest import Manifest, content_hash
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError
from mlxkit.engines.models.decilm.convert import from_parent
from mlxkit.engines.models.loading import load_model
from mlxkit.engines.puzzle import activations
from mlxkit.engines.puzzle.block_init import initialise
from mlxkit.engines.puzzle.bld import train_subblock
from mlxkit.engines.puzzle.library import LIBRARY_FORMAT, LIBRARY_VERSION, LibraryDir, read_library
from mlxkit.engines.puzzle.recipe import PuzzleRecipe
from mlxkit.engines.puzzle.scoring import ParentTail, parent_metrics, score_subblock
from mlxkit.engines.puzzle.search_space import SearchSpace, build_search_space
from mlxkit.engines.puzzle.subblocks import parent_subblock
from mlxkit.engines.puzzle.variants import ParentShape, parent_attention, parent_ffn


@dataclass(frozen=True)
class DistillOptions:
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


@dataclass(frozen=True)
class Unit:
    layer: int
    kind: str
    variant: Any

    @property
    def label(self) -> str:
        return f"layer {self.layer} {self.kind} {self.variant.name}"


def run_distill(options: DistillOptions, reporter: Reporter | None = None) -> dict[str, Any]:
    """Build (unless score-only) and score the library at `options.out`; returns a summary."""
    reporter = reporter or Reporter()
    started = time.time()
    dist = Distributed.from_env()
    try:
        library = LibraryDir(options.out)
        if options.score_only:
            read_library(options.out)  # must exist
        parent, tokenizer, source = _load_parent(options, reporter)
        space = build_search_space(ParentShape.from_config(parent.config), options.recipe.search_space)
        _check_or_write_state(library, options, parent, dist)
        train_ids, val_ids = _calibration_tokens(options, parent, tokenizer, library, dist, reporter)
        states_dir = library.work / "activations"
        if dist.is_main:
            activations.cache_states(parent, train_ids, val_ids, states_dir, reporter)
        dist.barrier()
        if not options.score_only:
            _build_blocks(parent, space, library, options, dist, reporter)
        dist.barrier()
        if options.score or options.score_only:
            _score(parent, space, library, val_ids, options, dist, reporter)
        dist.barrier()
        summary: dict[str, Any] = {}
        if dist.is_main:
            index = _write_index(parent, space, library, options, source, started)
            summary = summarise(index)
            summary["library"] = str(library.root / "library.json")
            summary["wall_time_s"] = round(time.time() - started, 1)
        return summary
    finally:
        dist.close()


def _load_parent(options: DistillOptions, reporter: Reporter):
    loaded = load_model(options.model, allow_pickle=options.allow_pickle, reporter=reporter)
    loaded.model.config._attn_implementation = "sdpa"
    parent = from_parent(loaded.model)
    parent.config._attn_implementation = "sdpa"
    for p in parent.parameters():
        p.requires_grad_(False)
    return parent, loaded.tokenizer, loaded.source


def _run_key(options: DistillOptions, parent) -> dict[str, Any]:
    from mlxkit.engines.data.sampled import _model_fingerprint

    data = {"spec": str(options.data), "hash": content_hash(options.data)} if options.data else "sampled"
    return {"parent": _model_fingerprint(parent), "data": data, "seed": options.seed,
            "data_settings": options.recipe.data.model_dump(), "train": options.train,
            "bld": options.recipe.bld.model_dump(), "search_space": options.recipe.search_space.model_dump()}


def _check_or_write_state(library: LibraryDir, options: DistillOptions, parent, dist: Distributed) -> None:
    """A library directory holds one run: resuming with other inputs would mix blocks silently."""
    state_file = library.work / "run.json"
    key = _run_key(options, parent)
    if state_file.exists():
        previous = json.loads(state_file.read_text())
        changed = sorted(k for k in key if previous.get(k) != key[k] and not (options.score_only and k in ("train",)))
        if changed:
            raise InputError(f"'{library.root}' holds a library built with other settings ({', '.join(changed)}); "
                             "use another --out, or delete it to start over")
    elif options.score_only:
        raise InputError(f"'{library.root}' has no record of how it was built; rebuild it without --score-only")
    elif dist.is_main:
        if (library.root / "library.json").exists() or (library.root.exists() and any(library.root.iterdir())
                                                         and not library.work.exists()):
            raise InputError(f"'{library.root}' exists and is not an unfinished mlxkit library; use another --out")
        library.work.mkdir(parents=True, exist_ok=True)
        (library.work / "run.json").write_text(json.dumps(key, indent=1))
    dist.barrier()


def _calibration_tokens(options: DistillOptions, parent, tokenizer, library: LibraryDir, dist: Distributed,
                        reporter: Reporter) -> tuple[torch.Tensor, torch.Tensor]:
    path = library.work / "tokens.pt"
    spec = options.recipe.data
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

            blocks = sample_tokens(parent, tokenizer, n_sequences=n_total, seq_len=spec.seq_len, seed=options.seed,
                                   reporter=reporter)
            train, val = blocks[spec.score_sequences:], blocks[:spec.score_sequences]
        torch.save({"train": train, "val": val}, str(path) + ".partial")
        Path(str(path) + ".partial").replace(path)
    dist.barrier()
    tokens = torch.load(path, weights_only=True)
    return tokens["train"], tokens["val"]


def _trainable_units(space: SearchSpace) -> list[Unit]:
    shape = space.parent
    units = []
    for layer in range(shape.num_layers):
        units += [Unit(layer, "attention", v) for v in space.attention
                  if v != parent_attention(shape) and v.kind != "no_op"]
        units += [Unit(layer, "ffn", v) for v in space.ffn if v != parent_ffn(shape) and v.kind != "no_op"]
    return units


def _build_blocks(parent, space: SearchSpace, library: LibraryDir, options: DistillOptions, dist: Distributed,
                  reporter: Reporter) -> None:
    todo = [u for u in dist.share(_trainable_units(space)) if not library.has_block(u.layer, u.kind, u.variant.name)]
    if not todo:
        return
    spec = options.recipe.bld
    pos = activations.position_embeddings(parent, options.recipe.data.seq_len)
    cached_layer, states = -1, None
    with reporter.task(f"BLD: training {len(todo)} subblocks" + (f" (rank {dist.rank})" if dist.world_size > 1
                                                                   else ""), total=len(todo)) as task:
        for unit in todo:
            if unit.layer != cached_layer:
                states = activations.load_layer(library.work / "activations", unit.layer, space.parent.num_layers)
                cached_layer = unit.layer
            assert states is not None
            if unit.kind == "attention":
                x, y, vx, vy = states.train_in, states.train_mid - states.train_in, states.val_in, \
                    states.val_mid - states.val_in
            else:
                x, y, vx, vy = states.train_mid, states.train_out - states.train_mid, states.val_mid, \
                    states.val_out - states.val_mid
            source = parent_subblock(parent, unit.layer, unit.kind)
            block = initialise(source, unit.variant, parent.config, unit.layer, x, y)
            train = options.train and (unit.variant.kind != "linear" or spec.train_linear)
            seed = options.seed * 1_000_003 + unit.layer * 101 + int(_digest(unit.kind + unit.variant.name), 16) % 997
            torch.manual_seed(seed)
            record = train_subblock(block, x, y, vx, vy, pos, spec if train else spec.model_copy(
                update={"tokens_per_block": 0}), seed=seed)
            library.save_block(block, {"variant": asdict(unit.variant), "layer": unit.layer, "kind": unit.kind,
                                       "init": _init_name(unit), "trained": record.steps > 0,
                                       "training": record.to_dict()})
            task.advance()
            task.update(last=unit.label, nmse=record.val_nmse_after)


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


def _score(parent, space: SearchSpace, library: LibraryDir, val_ids: torch.Tensor, options: DistillOptions,
           dist: Distributed, reporter: Reporter) -> None:
    todo = [u for u in dist.share(_scoring_units(space)) if library.read_score(u.layer, u.kind, u.variant.name)
            is None]
    todo_parent = dist.is_main and library.read_score(-1, "parent", "parent") is None
    if not todo and not todo_parent:
        return
    pos = activations.position_embeddings(parent, val_ids.shape[1])
    final = activations.load_final(library.work / "activations")["val_out"]
    tail = ParentTail(parent, val_ids, final, pos)
    if todo_parent:
        library.save_score(-1, "parent", "parent", parent_metrics(tail))
    cached_layer, states = -1, None
    with reporter.task(f"scoring {len(todo)} variants (replace-1-block KL)", total=len(todo)) as task:
        for unit in todo:
            if unit.layer != cached_layer:
                states = activations.load_layer(library.work / "activations", unit.layer, space.parent.num_layers)
                cached_layer = unit.layer
            assert states is not None
            block = library.load_block(parent.config, unit.layer, unit.kind, unit.variant)  # type: ignore[arg-type]
            metrics = score_subblock(tail, block, unit.layer, states.val_in, states.val_mid)
            library.save_score(unit.layer, unit.kind, unit.variant.name, metrics)
            task.advance()
            task.update(last=unit.label, kl=metrics["kl_div"])


def _write_index(parent, space: SearchSpace, library: LibraryDir, options: DistillOptions, source,
                 started: float) -> dict[str, Any]:
    shape = space.parent
    parent_scores = library.read_score(-1, "parent", "parent")
    layers = []
    for layer in range(shape.num_layers):
        entry: dict[str, Any] = {"layer": layer, "attention": {}, "ffn": {}}
        for kind, variants, parent_variant in (("attention", space.attention, parent_attention(shape)),
                                                ("ffn", space.ffn, parent_ffn(shape))):
            for variant in variants:
                name = variant.name
                item: dict[str, Any] = {"variant": asdict(variant)}
                if variant == parent_variant:
                    item.update(file=None, source="parent",
                                metrics={**(parent_scores or {}), "kl_div": 0.0, "top1_agreement": 1.0})
                elif variant.kind == "no_op":
                    item.update(file=None, source="no_op")
                else:
                    record = library.read_record(layer, kind, name) if library.has_block(layer, kind, name) else None
                    item.update(file=str(library.block_file(layer, kind, name).relative_to(library.root)),
                                source="bld" if record and record.get("trained") else "init",
                                init=record and record.get("init"), training=record and record.get("training"))
                if variant != parent_variant:
                    metrics = library.read_score(layer, kind, name)
                    if metrics is not None:
                        item["metrics"] = metrics
                entry[kind][name] = item
        layers.append(entry)
    manifest = Manifest(verb="distill", started=started)
    manifest.add_input("parent", options.model, source.path)
    if options.data:
        manifest.add_input("data", str(options.data), options.data)
    manifest.seeds = {"seed": options.seed}
    manifest.settings = {"recipe": options.recipe.model_dump(), "train": options.train}
    index = {
        "format": LIBRARY_FORMAT, "version": LIBRARY_VERSION,
        "parent": {"spec": options.model, "shape": asdict(shape),
                   "config": parent.config.to_dict() if hasattr(parent.config, "to_dict") else None},
        "recipe": options.recipe.model_dump(),
        "calibration": "sampled from the parent" if options.data is None else str(options.data),
        "seed": options.seed,
        "layers": layers,
    }
    _price_for_default_target(index)
    summary = summarise(index)
    manifest.results = {k: v for k, v in summary.items() if k != "per_layer"}
    library.write_index(index)
    manifest.write(library.root)
    return index


def _price_for_default_target(index: dict[str, Any]) -> None:
    """Predicted stats of every variant (NVlabs/puzzle vocabulary) on the default target and scenario.

    `mlx search` re-prices for its own target; these make the library comparable as written.
    """
    from mlxkit.engines.puzzle.hw_profile import load_profile
    from mlxkit.engines.puzzle.library_pricing import price_library
    from mlxkit.engines.puzzle.search import default_scenario

    profile = load_profile("h100")
    price_library(index, profile, default_scenario(profile, None))


def summarise(index: dict[str, Any]) -> dict[str, Any]:
    """Per-layer best scores and the library-wide median KL of non-trivial variants."""
    per_layer, kls, trained = [], [], 0
    for entry in index["layers"]:
        row: dict[str, Any] = {"layer": entry["layer"]}
        for kind in ("attention", "ffn"):
            row[kind] = {name: item.get("metrics", {}).get("kl_div") for name, item in entry[kind].items()}
            for item in entry[kind].values():
                if item.get("source") in ("bld", "init") and "metrics" in item:
                    kls.append(item["metrics"]["kl_div"])
                trained += item.get("source") == "bld"
        per_layer.append(row)
    return {"layers": len(per_layer), "variants_scored": len(kls), "subblocks_trained": trained,
            "median_kl_nontrivial": statistics.median(kls) if kls else None, "per_layer": per_layer}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_library_dir(model: str, recipe: str) -> Path:
    from mlxkit.engines.core.paths import cache_dir

    model_key = os.path.abspath(model) if os.path.exists(model) else model
    if recipe.endswith((".yaml", ".yml")):  # a user's recipe file: keyed by its path, named by its stem
        return cache_dir() / "libraries" / f"{_digest(model_key + '|' + os.path.abspath(recipe))}-{Path(recipe).stem}"
    return cache_dir() / "libraries" / f"{_digest(model_key)}-{recipe}"
