"""`export_model`: plan (every check, nothing written), then write atomically with the manifest."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mlxkit.engines.core.atomic import atomic_file, atomic_output_dir, atomic_write_json
from mlxkit.engines.core.manifest import Manifest
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.export.plan import ExportPlan, plan_export

# A GGUF is one file; its manifest sits beside it under this suffix (`child.gguf.mlxkit.json`).
GGUF_MANIFEST_SUFFIX = ".mlxkit.json"


def gguf_manifest_path(out: str | os.PathLike) -> Path:
    out = Path(out)
    return out.with_name(out.name + GGUF_MANIFEST_SUFFIX)


def _manifest(plan: ExportPlan) -> Manifest:
    manifest = Manifest(verb="export")
    manifest.add_input("model", plan.model.spec, plan.model.directory)
    manifest.settings = {"format": plan.format, "dtype": plan.encoding}
    return manifest


def describe_plan(plan: ExportPlan) -> dict[str, Any]:
    """What an export would write (for --dry-run): read from config and headers only."""
    return {"format": plan.format, "dtype": plan.encoding, "out": str(plan.out), "dry_run": True,
            **_summary(plan), "notes": list(plan.notes)}


def _summary(plan: ExportPlan) -> dict[str, Any]:
    layers = plan.model.layers
    summary: dict[str, Any] = {
        "model_type": plan.model.source_config.get("model_type"),
        "layers": len(layers),
        "attention": [l.attention.name for l in layers],
        "ffn": [l.ffn.name for l in layers],
        "rope": {"type": plan.model.rope.rope_type, "theta": plan.model.rope.theta},
    }
    if plan.gguf_layers:
        summary["gguf"] = {"head_count": [g.n_head for g in plan.gguf_layers],
                           "head_count_kv": [g.n_head_kv for g in plan.gguf_layers],
                           "feed_forward_length": [g.n_ff for g in plan.gguf_layers]}
    return summary


def run_export(plan: ExportPlan, *, overwrite: bool = False, reporter: Reporter | None = None) -> dict[str, Any]:
    """Write what `plan` describes. The output appears whole or not at all."""
    reporter = reporter or Reporter()
    manifest = _manifest(plan)
    notes = list(plan.notes)
    for note in notes:
        reporter.notice(note)
    if plan.format == "gguf":
        from mlxkit.engines.export.gguf_export import write_gguf

        with atomic_file(plan.out, overwrite=overwrite) as tmp:
            written = write_gguf(plan, tmp, plan.out.stem, reporter)
        for note in written.pop("notes"):  # known once the tensors are typed (q8_0 fallbacks)
            reporter.notice(note)
            notes.append(note)
        files = [plan.out.name]
    else:
        from mlxkit.engines.export.hf_export import write_hf_dir

        with atomic_output_dir(plan.out, overwrite=overwrite) as tmp:
            written = write_hf_dir(plan, tmp, reporter)
            files = written.pop("files")
            manifest.results = {**_summary(plan), **written, "notes": notes}
            manifest.write(tmp)
    result = {"format": plan.format, "dtype": plan.encoding, "out": str(plan.out), "files": files, **written,
              **_summary(plan), "notes": notes}
    if plan.format == "gguf":
        manifest.results = {k: v for k, v in result.items() if k not in ("out", "files")}
        manifest_path = gguf_manifest_path(plan.out)
        atomic_write_json(manifest_path, manifest.to_dict(), indent=2)
        result["manifest"] = str(manifest_path)
    else:
        result["manifest"] = str(plan.out / "mlxkit.json")
    return result


def export_model(model_dir: str | os.PathLike, format: str, out: str | os.PathLike, encoding: str = "f32", *,
                 overwrite: bool = False, reporter: Reporter | None = None) -> dict[str, Any]:
    """Export a child (or a Llama-family parent) for serving.

    Parameters
    ----------
    model_dir : a local HF directory (a `mlx search` child, or a parent), or the alias `smollm2-135m`.
    format : "gguf" (one llama.cpp file, `deci` architecture), "nemotron-nas" (an HF directory in
        NVIDIA's public layout) or "hf" (an HF directory with its modeling code, loadable without mlxkit).
    out : the .gguf file, or the output directory.
    encoding : how the weights are written: "f32", "f16", or (GGUF only) "q8_0".

    Everything the format cannot express is refused with an `InputError` before anything is
    written. Returns a summary (also stored in the manifest).
    """
    reporter = reporter or Reporter()
    plan = plan_export(str(model_dir), format, out, encoding, overwrite=overwrite, reporter=reporter)
    return run_export(plan, overwrite=overwrite, reporter=reporter)
