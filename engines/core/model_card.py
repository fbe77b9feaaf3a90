"""The model card (README.md with Hugging Face front matter) beside every model that mlxkit writes.

It is generated from the manifest alone, at the moment the manifest is written into the output
(which is still the staging directory that replaces the output whole), so the card and the
manifest can never disagree and neither appears without the other.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxkit.engines.core.figures import FigureSet

CARD_NAME = "README.md"
# Input roles that name the model an output was made from, in the order a card prefers them.
BASE_ROLES = ("parent", "teacher", "model", "base")
METHODS = {"search": "puzzle", "distill": "distillation", "merge": "merge", "finetune": "fine-tuning"}
# The evaluation figures a card tabulates, as they are named in a manifest's results.
EVAL_FIELDS = (("perplexity", "held-out perplexity"), ("kl_div", "KL(parent ‖ model)"),
               ("top1_agreement", "top-1 agreement with the parent"))


def holds_model(directory: Path) -> bool:
    """Whether `directory` holds a transformers model or a peft adapter (a CRT classifier's config.json
    names no model_type: it is not a model the Hub's card fields describe)."""
    import json

    if (directory / "adapter_config.json").is_file():
        return True
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config


def base_models(manifest: dict[str, Any]) -> list[str]:
    """The specs of the models an output was made from: its parent, teacher or base, and a merge's inputs."""
    inputs = manifest.get("inputs") or {}
    found = [inputs[r]["spec"] for r in BASE_ROLES if r in inputs and "spec" in inputs[r]]
    found += [v["spec"] for k, v in sorted(inputs.items()) if re.fullmatch(r"model_\d+", k) and "spec" in v]
    return list(dict.fromkeys(found))


def parent_license(manifest: dict[str, Any]) -> str | None:
    """The `license:` of the first base model's own card, where it has one on disk."""
    inputs = manifest.get("inputs") or {}
    for role in BASE_ROLES:
        path = (inputs.get(role) or {}).get("path")
        card = Path(path) / CARD_NAME if path else None
        if card is not None and card.is_file():
            front = _front_matter(card.read_text(errors="replace"))
            if isinstance(front.get("license"), str):
                return front["license"]
    return None


def search_record(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """What the search decided (target, engine, scenario, predicted figures), or None for other outputs.

    A distilled child keeps it under `settings.search`; a plain `mlx search` child has it spread over
    its settings and results.
    """
    settings = manifest.get("settings") or {}
    if isinstance(settings.get("search"), dict):
        return settings["search"]
    if manifest.get("verb") == "search":
        return {**settings, "predicted": (manifest.get("results") or {}).get("predicted") or {}}
    return None


def evaluation_rows(manifest: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(stage, figure, value) of every evaluation in the manifest's results: before/after training, or
    the searched child's own (`evaluation`)."""
    results = manifest.get("results") or {}
    rows = []
    for stage in ("before", "after", "evaluation"):
        figures = results.get(stage)
        if isinstance(figures, dict):
            for key, label in EVAL_FIELDS:
                if isinstance(figures.get(key), (int, float)):
                    rows.append(("child" if stage == "evaluation" else stage, label, float(figures[key])))
    return rows


def card_text(manifest: dict[str, Any], directory: Path, figures: FigureSet | None = None) -> str:
    """The card of the output in `directory`; `figures` are the pictures drawn beside it (or why none were)."""
    import yaml

    from mlxkit.engines.core.atomic import published_name

    name = published_name(directory)
    verb = manifest.get("verb", "")
    search = search_record(manifest)
    method = "puzzle" if search else METHODS.get(verb, verb)
    front: dict[str, Any] = {"library_name": "transformers", "tags": ["mlxkit", method],
                             "pipeline_tag": "text-generation"}
    bases = base_models(manifest)
    if bases:
        front["base_model"] = bases if len(bases) > 1 else bases[0]
    license_name = parent_license(manifest)
    if license_name:
        front["license"] = license_name
    lines = ["---", yaml.safe_dump(front, sort_keys=True).strip(), "---", "", f"# {name}", ""]
    made = {"puzzle": "a Puzzle architecture search (per-layer attention and FFN variants chosen by a MIP) "
                      "followed by global distillation against the parent",
            "distillation": "distillation against a teacher", "merge": "a merge of the models below",
            "fine-tuning": "fine-tuning"}.get(method, verb)
    lines += [f"Made by mlxkit {manifest.get('version', '')} with {made}"
              + (f", from {', '.join(f'`{b}`' for b in bases)}" if bases else "") + ".", "",
              "```bash", str(manifest.get("command", "")), "```", ""]
    rows = evaluation_rows(manifest)
    if rows:
        lines += ["## Measured", "", "| stage | figure | value |", "|---|---|---|"]
        lines += [f"| {stage} | {label} | {value:.6g} |" for stage, label, value in rows]
        results = manifest.get("results") or {}
        if results.get("tokens"):
            lines += ["", f"After {results['tokens']} training tokens ({results.get('steps')} steps); "
                          "the evaluation is on held-out text."]
        lines.append("")
    if search:
        predicted = search.get("predicted") or {}
        scenario = search.get("scenario") or {}
        lines += ["## Predicted on the target", "",
                  f"Target `{search.get('target')}`, serving engine `{search.get('engine')}`, scenario "
                  + ", ".join(f"{k}={v}" for k, v in scenario.items()) + ".", "",
                  "| figure | child | parent |", "|---|---|---|"]
        for label, key in (("throughput (tokens/s)", "tokens_per_s"), ("runtime (ms)", "runtime_ms"),
                           ("memory (MiB)", "memory_mib"), ("parameters", "num_params")):
            if isinstance(predicted.get(key), (int, float)):
                lines.append(f"| {label} | {predicted[key]:.6g} | {predicted.get('parent_' + key, float('nan')):.6g} |")
        if isinstance(predicted.get("speedup"), (int, float)):
            lines += ["", f"Predicted speedup: {predicted['speedup']:.3f}x."]
        lines.append("")
    if figures is not None and (figures.drawn or figures.skipped):
        lines += ["## Pictures", ""]
        for figure in figures.drawn:
            lines += [f"![{figure.title}]({figure.file})", ""]
        if figures.skipped:
            lines += [f"Pictures skipped: {figures.skipped}; `mlx report {name}` draws them afterwards.", ""]
    lines += ["## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
              f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)',
              f'tokenizer = AutoTokenizer.from_pretrained("{name}")', "```", ""]
    if search:
        lines += [f"Serve it in vLLM: `mlx export {name} --format nemotron-nas --out nas`, then "
                  "`vllm serve nas --trust-remote-code` (vLLM builds no-op and GQA attention and SwiGLU FFNs). "
                  f"For llama.cpp: `mlx export {name} --format gguf` where the child has no linear "
                  "FFN (the search says which formats hold it).", ""]
    lines += ["Provenance (inputs with their content hashes, seeds and settings): `mlxkit.json`.", ""]
    return "\n".join(lines)


def write_model_card(directory: Path, manifest: dict[str, Any]) -> FigureSet | None:
    """Draw the pictures, then write README.md, into `directory` when it holds a model (an output directory
    mlxkit made whole, or one `mlx report` redraws); the pictures the card shows (None: no card)."""
    from mlxkit.engines.core.atomic import atomic_write_text
    from mlxkit.engines.core.figures import draw_output_figures

    directory = Path(directory)
    if not holds_model(directory):
        return None
    figures = draw_output_figures(directory, manifest)
    atomic_write_text(directory / CARD_NAME, card_text(manifest, directory, figures))
    return figures


def _front_matter(text: str) -> dict[str, Any]:
    import yaml

    match = re.match(r"---\n(.*?)\n---", text, re.S)
    if not match:
        return {}
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}
