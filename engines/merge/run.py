"""`run_merge`: validate → resolve inputs → plan → execute → write, atomically.

The output directory appears only when everything (weights, index, config, tokenizer,
manifest) is written; any failure leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Optional

from mlxkit.engines.core.atomic import atomic_output_dir
from mlxkit.engines.core.manifest import Manifest
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.core.sizes import parse_bytes
from mlxkit.engines.data.text import check_data_path
from mlxkit.engines.errors import InputError
from mlxkit.engines.io.tensor_writer import TensorWriter
from mlxkit.engines.merge.config import MergeConfig
from mlxkit.engines.merge.executor import combine, write_merged
from mlxkit.engines.merge.methods import registry
from mlxkit.engines.merge.plan import MergePlan, plan_merge
from mlxkit.engines.merge.sources import MergeInput, infer_base, resolve_input
from mlxkit.engines.merge.statistics import ModelStatistics, calibration_statistics
from mlxkit.engines.merge.tokenizers import check_tokenizers, stored_chat_template, tokenizer_facts
from mlxkit.engines.merge.vocab import align_vocabularies, tokenizer_source_dir
from mlxkit.engines.training.device import resolve_device

# Files copied verbatim from the base (or first) model next to the merged weights.
_TAG_ALONG = ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
              "chat_template.json"]


def prepare(config: MergeConfig, reporter: Reporter) -> tuple[MergePlan, list[MergeInput], Optional[MergeInput]]:
    """Resolve every input and build the plan; reads headers only."""
    method = registry.get(config.merge_method)
    entries = config.input_entries()
    if config.base_model and len(entries) < len(config.models):
        reporter.notice("the base model is listed among the models: it is the origin of the task vectors, "
                        "not one of them")
    inputs = [resolve_input(entry.model, reporter) for entry in entries]
    base_spec = config.base_model
    if base_spec is None and (method.needs_base or any(i.kind == "lora" for i in inputs)):
        base_spec = infer_base(inputs)
        if base_spec is not None:
            reporter.notice(f"base model inferred from the inputs: {base_spec}")
    base = resolve_input(base_spec, reporter) if base_spec else None
    facts = [tokenizer_facts(i.spec, Path(i.path)) for i in [*([base] if base else []), *inputs]]
    check_tokenizers(facts, tokenizer_policy=config.tokenizer_policy(), chat_template=config.chat_template)
    vocab = align_vocabularies(config.tokenizer_policy(), config.tokenizer.pad_to_multiple_of if config.tokenizer
                               else None, inputs, base, facts, config.embedding_pattern, reporter)
    return plan_merge(config, inputs, base, vocab), inputs, base


def run_merge(config: MergeConfig, out: Optional[str | Path], *, overwrite: bool = False, dry_run: bool = False,
              device: str = "auto", reporter: Optional[Reporter] = None, check: bool = False,
              check_text: Optional[Path] = None) -> dict[str, Any]:
    """Merge, or with `dry_run` return the plan. `device` is where each tensor's arithmetic runs
    (`auto | cpu | cuda | cuda:N`, checked before any input is opened); it always runs in float32,
    and the result is written in `config.out_dtype` (default: the inputs' dtype). With `check`, the
    merged model's perplexity on `check_text` (default: built-in text) beside each input's is
    measured before the output is published (`check.py`) and recorded in its manifest."""
    reporter = reporter or Reporter()
    started = time.perf_counter()
    method = registry.get(config.merge_method)
    if not dry_run and out is None:
        raise InputError("pass an output directory (-o OUT)")
    dev = None if dry_run else resolve_device(device)
    if config.data is not None:
        check_data_path(config.data)  # a missing calibration file fails before any model is read
    plan, inputs, base = prepare(config, reporter)
    if dev is None:
        return {"dry_run": True, **plan.summary(), "plan": [t.describe() for t in plan.tasks]}
    max_shard = parse_bytes(config.max_shard_size, "max_shard_size")
    reporter.notice(f"{plan.method}: {len(inputs)} models, {len(plan.tasks)} tensors "
                    f"({sum(t.matrix for t in plan.tasks)} as matrices), device {dev}")
    manifest = Manifest(verb="merge")
    if base is not None:
        manifest.add_input("base", base.spec, base.path)
    for i, inp in enumerate(inputs):
        manifest.add_input(f"model_{i}", inp.spec, inp.path)
    if config.data is not None:
        manifest.add_input("calibration_data", config.data, config.data)
    manifest.seeds["merge"] = config.seed
    manifest.settings = config.model_dump(mode="json")
    result: dict[str, Any] = {"method": plan.method, "models": plan.models, "base": plan.base, "device": str(dev)}
    statistics: list[ModelStatistics] = []
    try:
        with atomic_output_dir(out, overwrite=overwrite) as tmp:
            if method.statistics is not None:
                context = (plan.reference_config or {}).get("max_position_embeddings")
                statistics = calibration_statistics(config, method.statistics, inputs,
                                                    _tokenizer_input(config, inputs, base), dev, reporter,
                                                    context if isinstance(context, int) else None)
                result["statistics"] = [str(stats.path) for stats in statistics]
            if config.alpha == "auto":
                alpha, curve = _auto_alpha(config, plan, method, inputs, base, tmp, dev, reporter)
                result["alpha_curve"] = curve
            else:
                alpha = float(config.alpha)
                writer = TensorWriter(tmp, max_shard)
                write_merged(plan, method, inputs, base, writer, alpha, dev, reporter, statistics or None)
                index = writer.finalize()
            if config.alpha == "auto":
                index = json.loads((tmp / "model.safetensors.index.json").read_text())
            tokenizer_dir = tokenizer_source_dir(config.tokenizer_policy(), inputs, base)
            _copy_side_files(base or inputs[0], tokenizer_dir, tmp, plan)
            if plan.vocab is not None:
                plan.vocab.write_tokenizer(tmp, tokenizer_dir)
                result["tokenizer"] = plan.vocab.summary()
            template = _chat_template(config, inputs, base, reporter)
            if template is not None:
                _write_chat_template(tmp, template)
            (tmp / "merge.yaml").write_text(config.to_yaml())
            shards = sorted(set(index["weight_map"].values()))
            result.update({"alpha": alpha, "tensors": len(plan.tasks), "shards": len(shards),
                           "total_bytes": index["metadata"]["total_size"],
                           "wall_time_s": round(time.perf_counter() - started, 3)})
            if check:
                from mlxkit.engines.merge.check import check_merge

                checked = [inp.spec for inp in [*inputs, *([base] if base else [])]]
                result["check"] = check_merge(tmp, checked, check_text, device=str(dev), reporter=reporter,
                                              label=str(Path(out).expanduser().resolve()))
            manifest.results = dict(result)
            manifest.write(tmp)
    finally:
        for inp in [*inputs, *([base] if base else [])]:
            inp.close()
        for stats in statistics:
            stats.close()
    result["output"] = str(Path(out).expanduser().resolve())
    return result


def _auto_alpha(config: MergeConfig, plan: MergePlan, method, inputs, base, tmp: Path, dev, reporter):
    """Store M once (float32), sweep α on the base + α·M, then write the chosen merge."""
    from mlxkit.engines.io.lazy_loader import LazyTensorLoader
    from mlxkit.engines.merge.alpha import sweep_alpha
    from mlxkit.engines.merge.executor import apply_alpha

    scratch = tmp / ".alpha-sweep"
    deltas = TensorWriter(scratch / "delta", "1GB")
    for task, _, result in combine(plan, method, inputs, base, dev, reporter):
        if task.action == "merge":
            deltas.save(task.name, result)
    deltas.finalize()
    # a loadable copy of the base for evaluation: its weights plus config and tokenizer
    alpha, curve = sweep_alpha(Path(base.path), scratch / "delta", config.eval_data, grid=config.alpha_grid,
                               seq_len=config.eval_seq_len, max_tokens=config.eval_tokens, seed=config.seed,
                               reporter=reporter)
    reporter.notice(f"alpha = {alpha:g} (lowest mean validation loss)")
    writer = TensorWriter(tmp, parse_bytes(config.max_shard_size, "max_shard_size"))
    with LazyTensorLoader.from_path(scratch / "delta") as stored:
        for task in reporter.track(plan.tasks, "writing"):
            if task.action == "copy":
                writer.save(task.name, (base or inputs[0]).loader.get_tensor(task.base_name or task.name))
                continue
            base_t = base.loader.get_tensor(task.base_name or task.name).float()
            writer.save(task.name, apply_alpha(task, base_t, stored.get_tensor(task.name), alpha, True))
    writer.finalize()
    shutil.rmtree(scratch)
    return alpha, curve


def _copy_side_files(source: MergeInput, tokenizer_dir: Path, tmp: Path, plan: MergePlan) -> None:
    """config.json (dtype, layer count and re-indexed vocab_size updated) and the generation config
    from the base, else the first model; the tokenizer files from `tokenizer_dir`.

    The config is the one parsed while planning, so a malformed file has already failed the run
    before any tensor was read.
    """
    if plan.reference_config is not None:
        cfg = dict(plan.reference_config)
        dtypes = {t.out_dtype for t in plan.tasks if t.action == "merge"}
        if len(dtypes) == 1:
            dtype = dtypes.pop()
            for key in ("torch_dtype", "dtype"):
                if key in cfg or key == "dtype":
                    cfg[key] = dtype
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in _TAG_ALONG:
        src = tokenizer_dir if name in _TOKENIZER_FILES else Path(source.path)
        if (src / name).exists():
            shutil.copy2(src / name, tmp / name)


_TOKENIZER_FILES = set(_TAG_ALONG) - {"generation_config.json"}


def _tokenizer_input(config: MergeConfig, inputs: list[MergeInput], base: Optional[MergeInput]) -> MergeInput:
    """The input whose tokenizer the policy names, else the reference (base, else the first model)."""
    from mlxkit.engines.merge.config import input_key

    policy = config.tokenizer_policy()
    if policy in (None, "base", "union"):
        return base or inputs[0]
    for inp in [*([base] if base else []), *inputs]:
        if input_key(inp.spec) == input_key(policy):
            return inp
    return base or inputs[0]


def _chat_template(config: MergeConfig, inputs: list[MergeInput], base: Optional[MergeInput],
                   reporter: Reporter) -> Optional[str]:
    """The template named by `chat_template`: `auto` is the one most of the inputs carry (mergekit's
    rule), a known name its text, anything else a Jinja template given inline."""
    from mlxkit.engines.merge.config import CHAT_TEMPLATES

    choice = config.chat_template
    if choice is None:
        return None
    if choice != "auto":
        return CHAT_TEMPLATES.get(choice, choice)
    found = [t for t in (stored_chat_template(Path(i.path)) for i in inputs) if t]
    if not found:
        reporter.notice("chat_template: auto found no chat template in the inputs; the output keeps its tokenizer's")
        return None
    return max(set(found), key=found.count)


def _write_chat_template(tmp: Path, template: str) -> None:
    cfg_path = tmp / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    # transformers reads chat_template.jinja before the config's key, so both must say the same
    (tmp / "chat_template.jinja").write_text(template)
