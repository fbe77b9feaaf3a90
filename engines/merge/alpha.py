"""Pick the scale α of θ_base + α·M by a sweep on per-task validation text (as the paper does).

M is computed once and stored in float32; each α then costs one pass of in-place weight updates
and one evaluation per task. The score is the mean next-token loss over the tasks (lower is
better). The sweep stops after `patience` points without improvement, like the official code.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.io.lazy_loader import LazyTensorLoader
from mlxkit.engines.merge.executor import NonFiniteTensorError

DEFAULT_GRID = [round(0.2 * i, 2) for i in range(1, 16)]  # 0.2 … 3.0


def sweep_alpha(base_dir: Path, delta_dir: Path, eval_files: list[str], *, grid: list[float] | None,
                seq_len: int, max_tokens: int, seed: int, reporter: Reporter, patience: int = 3
                ) -> tuple[float, list[dict[str, Any]]]:
    from mlxkit.engines.data.text import load_blocks
    from mlxkit.engines.eval.language_model import evaluate
    from mlxkit.engines.models.loading import load_model

    loaded = load_model(str(base_dir), reporter=reporter)
    model, tok = loaded.model, loaded.tokenizer
    blocks = []
    for path in eval_files:
        tb = load_blocks(path, tok, seq_len=seq_len, max_tokens=max_tokens, val_fraction=0.0, seed=seed)
        blocks.append(tb.train)
    params = dict(model.named_parameters())
    deltas = LazyTensorLoader.from_path(delta_dir)
    names = [n for n in deltas.keys() if n in params]
    original = {n: params[n].detach().clone() for n in names}
    curve: list[dict[str, Any]] = []
    best, best_score, since_best = None, math.inf, 0
    for alpha in sorted(grid or DEFAULT_GRID):
        with torch.no_grad():
            for n in names:
                params[n].copy_(original[n] + alpha * deltas.get_tensor(n).float())
        losses = [evaluate(model, b).nll for b in blocks]
        score = sum(losses) / len(losses)
        if not math.isfinite(score):
            # the scaled weights overflowed: record the point (JSON has no NaN) and count it as no gain
            curve.append({"alpha": alpha, "losses": [_rounded(x) for x in losses], "mean_loss": None})
            reporter.notice(f"alpha {alpha:g}: the validation loss is not finite")
        else:
            curve.append({"alpha": alpha, "losses": [round(x, 5) for x in losses], "mean_loss": round(score, 5)})
            reporter.notice(f"alpha {alpha:g}: mean loss {score:.4f} ({', '.join(f'{x:.3f}' for x in losses)})")
        if score < best_score - 1e-6:
            best, best_score, since_best = alpha, score, 0
        else:
            since_best += 1
            if since_best >= patience:
                break
    deltas.close()
    if best is None:
        raise NonFiniteTensorError("every alpha of the sweep gave a non-finite validation loss; "
                                   "pass a grid of smaller values (alpha_grid)")
    return float(best), curve


def _rounded(x: float) -> float | None:
    return round(x, 5) if math.isfinite(x) else None
