"""The child stage: the chosen blocks assembled into a child, evaluated against the parent on held-out
tokens and saved; with GKD, staged under its stage key and distilled against the parent; then exported."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mlxkit.engines.core.manifest import Manifest, content_hash
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.core.stage_key import StageKey, StageWork
from mlxkit.engines.hardware.profile import HardwareProfile
from mlxkit.engines.puzzle.library.schema import BlockLibrary
from mlxkit.engines.puzzle.search.options import SearchOptions
from mlxkit.engines.puzzle.search.parent import SearchParent
from mlxkit.engines.puzzle.search.solution import SolvedSearch, held_out_tokens, library_root
from mlxkit.engines.training.device import Placement
from mlxkit.engines.training.distributed import Distributed

@dataclass(frozen=True)
class StagedChild:
    """The assemble stage's outcome: the saved child, its size, and its evaluation against the parent."""

    out: Path
    num_params: int
    evaluation: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"out": str(self.out), "num_params": self.num_params, "evaluation": self.evaluation}


def search_work_dir(out: Path) -> Path:
    """Where `--gkd-tokens` keeps the assembled child until its distilled version is saved."""
    out = Path(out).expanduser().resolve()
    return out.parent / f".{out.name}.search-work"


def build_and_distil(options: SearchOptions, library_path: Path, library: BlockLibrary, solved: SolvedSearch,
                      profile: HardwareProfile, started: float, reporter: Reporter, dist: Distributed,
                      placement: Placement, parent: SearchParent) -> dict[str, Any]:
    """Assemble the child (or reuse the one an earlier run staged under the same stage key), then GKD it.

    Rank 0 assembles and stages the child while the other ranks wait; then every rank takes part in GKD,
    which resumes its own work only while the staged child it trains is the same.
    """
    import shutil

    from mlxkit.engines.distill.recipe import load_distill_recipe
    from mlxkit.engines.distill.trainer import DistillationOptions, run_distillation

    assert library.parent is not None and options.out is not None
    recipe = load_distill_recipe(options.gkd_recipe).with_overrides(options.gkd_overrides)  # fail before work
    staged_dir = search_work_dir(options.out) / "child-before-gkd"
    staged: StagedChild | None = None
    if dist.is_main:
        key = child_stage_key(library_path, solved, options, placement)
        stage = StageWork(staged_dir, staged_dir.with_name(staged_dir.name + ".key.json"),
                          what="the child staged for another solution")
        staged = _staged_child(staged_dir) if stage.open(key, reporter) == "same" else None
        if staged is not None:
            reporter.notice(f"reusing the child assembled by an earlier run at {staged_dir}")
        else:
            staged = build_child(replace(options, out=staged_dir, overwrite=True), library_path, library, solved,
                                  profile, started, reporter, placement, parent, stage_key=key)
        parent.release()  # GKD reads the parent again, as its teacher
    staged = dist.broadcast_object(staged)
    assert staged is not None
    search_stages = {"library": str(library_path), "target": profile.name, "engine": options.engine,
                     "scenario": solved.scenario.to_dict(),
                     "budgets": solved.budgets, "caps": solved.caps, "mip": {
                         "objective": solved.best.objective, "status": solved.best.status,
                         "metric": options.metric, "solve_time_s": solved.solve_time_s},
                     "predicted": solved.predicted, "choices": solved.choice_names,
                     "child_before_gkd": {"num_params": staged.num_params, "evaluation": staged.evaluation}}
    reporter.notice(f"global distillation of the child on {options.gkd_tokens} tokens "
                    f"({'--data ' + str(options.data) if options.data else 'text sampled from the parent'})")
    summary = run_distillation(DistillationOptions(
        mode="gkd", teacher=library.parent.spec, student=str(staged.out), out=options.out, recipe=recipe,
        data=options.data, tokens=options.gkd_tokens, seed=options.seed, overwrite=options.overwrite,
        allow_pickle=options.allow_pickle, device=options.device, dtype=options.dtype, save_dtype=options.save_dtype,
        sharding=options.sharding, manifest_extra={"search": search_stages}), reporter)
    if not dist.is_main:
        return {}
    after = _evaluate_saved_child(Path(summary["out"]), library_path, library, options, placement, reporter)
    shutil.rmtree(search_work_dir(options.out), ignore_errors=True)
    return {"out": summary["out"], "num_params": staged.num_params, "evaluation": staged.evaluation,
            "evaluation_after_gkd": after, "gkd": {k: v for k, v in summary.items() if k != "out"}}


def child_stage_key(library_path: Path, solved: SolvedSearch, options: SearchOptions,
                    placement: Placement) -> StageKey:
    """What the assembled child depends on: the library's index (its blocks and scores), the choices, the
    held-out evaluation and the dtypes it is computed and saved in."""
    return StageKey.of({"library": content_hash(library_root(library_path).index_file),
                        "choices": solved.choice_names, "eval_sequences": options.eval_sequences,
                        "compute_dtype": str(placement.dtype), "save_dtype": options.save_dtype})


def _staged_child(staged_dir: Path) -> StagedChild | None:
    """The child staged in `staged_dir` when it was saved whole (its manifest is written last), else None."""
    try:
        recorded = json.loads((staged_dir / "mlxkit.json").read_text())["results"]
        return StagedChild(staged_dir, int(recorded["num_params"]), recorded.get("evaluation") or {})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _evaluate_saved_child(child_dir: Path, library_path: Path, library: BlockLibrary, options: SearchOptions,
                          placement: Placement, reporter: Reporter) -> dict[str, Any]:
    """The saved child against the parent on the held-out tokens the undistilled child was evaluated on."""
    from mlxkit.engines.models.loading import load_model

    assert library.parent is not None
    val = held_out_tokens(library_path, options.eval_sequences)
    if val is None:
        return {}
    parent = load_model(library.parent.spec, dtype=placement.dtype, device=placement.device,
                        allow_pickle=options.allow_pickle, with_tokenizer=False, reporter=reporter).model
    child = load_model(str(child_dir), dtype=placement.dtype, device=placement.device, with_tokenizer=False,
                       reporter=reporter).model
    return _held_out_evaluation(child, parent, val.to(placement.device), reporter)


def _held_out_evaluation(child, parent, val: torch.Tensor, reporter: Reporter) -> dict[str, Any]:
    from mlxkit.engines.eval.language_model import evaluate

    with reporter.task("evaluating child against parent on held-out tokens"):
        child_eval = evaluate(child, val, reference=parent)
        parent_eval = evaluate(parent, val)
    return {"perplexity": child_eval.perplexity, "parent_perplexity": parent_eval.perplexity,
            "kl_div": child_eval.kl_div, "top1_agreement": child_eval.top1_agreement, "tokens": child_eval.tokens}


def build_child(options: SearchOptions, library_path: Path, library: BlockLibrary, solved: SolvedSearch,
                 profile: HardwareProfile, started: float, reporter: Reporter, placement: Placement,
                 parent: SearchParent, stage_key: StageKey | None = None) -> StagedChild:
    from mlxkit.engines.models.loading import source_dtype
    from mlxkit.engines.models.saving import save_model
    from mlxkit.engines.puzzle.search.assemble import assemble_child

    assert library.parent is not None  # has_trained_blocks
    root = library_root(library_path)
    # Assembly and evaluation only run forwards: the parent is held in the compute dtype on the device.
    loaded, converted = parent.loaded, parent.converted
    save_dtype = placement.save_dtype(source_dtype(loaded.source), options.save_dtype)
    child = assemble_child(converted, root, solved.choices)
    n_params = sum(p.numel() for p in child.parameters())

    val = held_out_tokens(library_path, options.eval_sequences)
    evaluation = {} if val is None else _held_out_evaluation(child, converted, val.to(placement.device), reporter)

    manifest = Manifest(verb="search", started=started)
    manifest.add_input("parent", parent.spec, loaded.source.path)
    manifest.add_input("library", str(library_path), root.index_file)
    manifest.seeds = {"seed": options.seed}
    manifest.settings = {"target": profile.name, "engine": options.engine, "scenario": solved.scenario.to_dict(),
                         "budgets": solved.budgets, "caps": solved.caps, "metric": options.metric,
                         "costs": options.costs,
                         "recipe": None if options.library is not None else options.recipe or "quick"}
    manifest.results = {"objective": solved.best.objective, "predicted": solved.predicted,
                        "choices": solved.choice_names, "evaluation": evaluation, "num_params": n_params,
                        **({"stage_key": stage_key.record} if stage_key is not None else {})}
    child.generation_config = loaded.model.generation_config
    out = save_model(child, loaded.tokenizer, options.out, manifest, overwrite=options.overwrite, dtype=save_dtype)
    return StagedChild(Path(out), n_params, evaluation)


def export_path(out: Path, fmt: str, encoding: str) -> Path:
    """Where `--export` writes inside the child directory: `model-<encoding>.gguf`, or `export-<format>/`."""
    return out / (f"model-{encoding}.gguf" if fmt == "gguf" else f"export-{fmt}")


def export_child(out: Path, options: SearchOptions, reporter: Reporter) -> dict[str, Any]:
    from mlxkit.engines.export import export_model

    assert options.export is not None
    with reporter.task(f"exporting the child to {options.export} ({options.export_encoding})"):
        written = export_model(out, options.export, export_path(out, options.export, options.export_encoding),
                               options.export_encoding, overwrite=True, reporter=reporter)
    return {"format": written["format"], "dtype": written["dtype"], "out": written["out"],
            "manifest": written["manifest"], "notes": written["notes"]}
