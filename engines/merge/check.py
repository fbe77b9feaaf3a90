"""The output check of `mlx merge`: the merged model's perplexity on a small text beside each input's.

A merge that came out broken (mismatched rows, a wrong sign, an overflowed scale) shows at once as
a perplexity many times the inputs'. Each model reads the text with its own tokenizer, so a model
is compared with the others only where they share a tokenizer; the report says which did. Models
are loaded one at a time, in the compute dtype of the device, and freed before the next.

The default text is a few paragraphs of plain English written for this check; `--check PATH`
gives the user's own (a file or a folder, as `--data` elsewhere).
"""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import MlxkitError

# A merged model this many times the best input's perplexity is reported as likely broken.
BROKEN_RATIO = 2.0
CHECK_TOKENS = 512
CHECK_SEQ_LEN = 128

DEFAULT_TEXT = """\
The river rose during the night, and by morning the lower road was under water. Farmers moved
their animals to the hill pastures, and the children watched from the school windows as boats
drifted past the post office. By noon the rain had stopped, and the town began to count the cost.

Bread is one of the oldest prepared foods. Flour, water and salt are mixed into a dough, which is
left to rise when yeast is added. The dough is then shaped, proofed again and baked in a hot oven
until the crust turns brown and the loaf sounds hollow when it is tapped underneath.

A computer program is a list of instructions that a machine follows in order. Programs read input,
keep values in memory, make decisions by comparing those values, and repeat steps in loops until a
condition is met. Errors in a program are called bugs, and finding them is called debugging.

The committee met on Tuesday to review the budget for the coming year. Most members agreed that
the library needed a new roof, but they could not decide whether the money should come from the
road fund or from a small increase in the local tax. The vote was postponed until the spring.

Light travels faster than sound, which is why lightning is seen before thunder is heard. Counting
the seconds between the flash and the rumble, and dividing by three, gives a rough distance to the
storm in kilometres. Most storms pass within an hour, moving with the wind that carries them.
"""


def check_merge(merged: Path, inputs: list[str], text: Path | None = None, *, device: str = "auto",
                reporter: Reporter | None = None, label: str | None = None) -> dict[str, Any]:
    """Perplexity of the merged model in `merged` (reported as `label`, its final path) and of each
    input on the check text. The merge runs it on its temporary output, before that is published,
    so the report lands in the manifest with everything else."""
    import torch

    from mlxkit.engines.data.text import pack, read_texts, tokenize
    from mlxkit.engines.eval.language_model import evaluate
    from mlxkit.engines.models.loading import load_model
    from mlxkit.engines.training.device import Placement

    reporter = reporter or Reporter()
    placement = Placement.resolve(device, "auto")
    skipped = _too_large(Path(merged), placement)
    if skipped:
        reporter.notice(f"check skipped: {skipped}")
        return {"skipped": skipped}
    texts = read_texts(text) if text is not None else [DEFAULT_TEXT]
    rows: list[dict[str, Any]] = []
    for role, spec in [("merged", str(merged)), *(("input", s) for s in inputs)]:
        with reporter.task(f"check: perplexity of {'the merged model' if role == 'merged' else spec}"):
            try:
                loaded = load_model(spec, dtype=placement.dtype, device=placement.device, reporter=reporter)
            except MlxkitError as exc:  # a LoRA adapter, say: the check reports it instead of failing the merge
                rows.append({"role": role, "model": spec, "perplexity": None, "error": str(exc).splitlines()[0]})
                continue
            ids = tokenize(loaded.tokenizer, texts, CHECK_TOKENS)
            positions = getattr(loaded.model.config, "max_position_embeddings", None) or CHECK_SEQ_LEN
            seq_len = min(CHECK_SEQ_LEN, positions, max(2, ids.numel()))
            blocks = pack(ids, seq_len).to(placement.device)
            with torch.no_grad():
                result = evaluate(loaded.model, blocks)
            rows.append({"role": role, "model": label or spec if role == "merged" else spec,
                         "perplexity": _finite(result.perplexity),
                         "tokens": result.tokens, "vocab": len(loaded.tokenizer)})
            del loaded
            gc.collect()
    merged, others = rows[0], rows[1:]
    comparable = [r for r in others if r.get("vocab") == merged.get("vocab") and r["perplexity"] is not None]
    best = min((r["perplexity"] for r in comparable), default=None)
    ratio = merged["perplexity"] / best if merged["perplexity"] is not None and best else None
    broken = merged["perplexity"] is None or (ratio is not None and ratio > BROKEN_RATIO)
    report = {"text": str(text) if text is not None else "built-in", "models": rows,
              "ratio_to_best_input": ratio, "looks_broken": broken}
    if broken:
        reporter.notice(f"check: the merged model's perplexity ({_shown(merged['perplexity'])}) is "
                        f"{'not finite' if ratio is None else f'{ratio:.1f}x the best input'}'s "
                        f"({_shown(best)}): the merge may be broken")
    return report


def _too_large(merged: Path, placement) -> str | None:
    """Why the check cannot run here (one model in the compute dtype would take over half the device's
    memory), or None. Models are loaded whole, one at a time."""
    import torch

    from mlxkit.engines.io.safetensors_header import read_safetensors_header
    from mlxkit.engines.training.budget import device_memory_bytes

    elements = sum(math.prod(entry.shape) for f in merged.glob("*.safetensors")
                   for entry in read_safetensors_header(f).tensors.values())
    need = elements * torch.finfo(placement.dtype).bits // 8
    have = device_memory_bytes(placement.device)
    if have is not None and need > have // 2:
        return (f"one model takes about {need / 2**30:.1f} GiB in {str(placement.dtype).removeprefix('torch.')} "
                f"and {placement.device} has {have / 2**30:.1f} GiB; run `mlx eval` on the output instead")
    return None


def _finite(x: float) -> float | None:
    return round(x, 4) if math.isfinite(x) else None


def _shown(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
