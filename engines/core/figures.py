"""The pictures beside a model card: a child's architecture per layer against its parent, the training
curves of a distillation or fine-tuning run, and a search's quality-against-throughput frontier.

Everything drawn comes from files already in the output (`config.json`, the training log the manifest
names, the manifest's results), so `mlx report DIR` redraws the same pictures later. matplotlib is the
optional `plots` extra; without it the pictures are skipped and the card says so. It runs on its
file-only backend (Agg), so no display is needed and none is touched.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ARCHITECTURE_PNG = "architecture.png"
TRAINING_PNG = "training.png"
FRONTIER_PNG = "frontier.png"
PLOTS_HINT = "pip install 'mlxkit[plots]'"

# One colour per subblock kind, the same in every picture.
KIND_COLOURS = {"gqa": "#3b75af", "mlp": "#3b75af", "linear": "#ef8636", "no_op": "#b0b0b0"}


@dataclass(frozen=True)
class Figure:
    title: str
    file: str


@dataclass
class FigureSet:
    """The pictures drawn into an output, or why there are none although the output has data for some."""

    drawn: list[Figure] = field(default_factory=list)
    skipped: str | None = None


@dataclass(frozen=True)
class LayerBlocks:
    """One layer of a child as its picture shows it: each subblock's kind and its size as a fraction of the
    parent's (KV heads for attention, intermediate width for the FFN; 0 for no-op, 1 for a linear map)."""

    layer: int
    attention: str
    kv_heads: int
    attention_fraction: float
    ffn: str
    intermediate_size: int
    ffn_fraction: float


def plotting_missing() -> str | None:
    """Why pictures cannot be drawn here (None when matplotlib imports)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"matplotlib is not installed ({PLOTS_HINT})"
    return None


def architecture_layers(config: dict[str, Any]) -> list[LayerBlocks] | None:
    """The per-layer blocks of a heterogeneous child's `config.json`, ours or a Nemotron-NAS export's (None for
    a model with no `block_configs`, or one that does not say the parent's sizes)."""
    from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant

    blocks = config.get("block_configs")
    parent_kv = config.get("parent_num_key_value_heads") or config.get("num_key_value_heads")
    parent_width = config.get("parent_intermediate_size") or config.get("intermediate_size")
    if not isinstance(blocks, list) or not blocks or not parent_kv or not parent_width:
        return None
    try:
        variants = [(AttentionVariant.from_block_config(b["attention"], int(config["num_attention_heads"])),
                     FFNVariant.from_block_config(b["ffn"], int(config["hidden_size"]))) for b in blocks]
    except (KeyError, TypeError, ValueError):
        return None
    layers = []
    for index, (attention, ffn) in enumerate(variants):
        kv, width = attention.n_kv_heads or 0, ffn.intermediate_size or 0
        layers.append(LayerBlocks(index, attention.kind, kv,
                                  kv / parent_kv if attention.kind == "gqa" else float(attention.kind == "linear"),
                                  ffn.kind, width,
                                  width / parent_width if ffn.kind == "mlp" else float(ffn.kind == "linear")))
    return layers


def training_series(records: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """(tokens or steps, value) series of a training log: the training loss, and each held-out figure."""
    unit = "tokens" if any("tokens" in r for r in records) else "step"
    series: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        x = float(record.get(unit, record.get("step", 0)))
        if isinstance(record.get("loss"), (int, float)):
            series.setdefault("loss", []).append((x, float(record["loss"])))
        for key, value in (record.get("eval") or {}).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                series.setdefault(f"eval.{key}", []).append((x, float(value)))
    return series


def draw_output_figures(directory: Path, manifest: dict[str, Any]) -> FigureSet:
    """Draw every picture the output in `directory` has data for; each file replaces its old copy whole."""
    directory = Path(directory)
    plans = _plans(directory, manifest)
    if not plans:
        return FigureSet()
    missing = plotting_missing()
    if missing is not None:
        return FigureSet(skipped=missing)
    drawn = []
    for figure, draw in plans:
        _save(draw, directory / figure.file)
        drawn.append(figure)
    return FigureSet(drawn=drawn)


def _plans(directory: Path, manifest: dict[str, Any]) -> list[tuple[Figure, Any]]:
    from mlxkit.engines.core.atomic import published_name

    name = published_name(directory)
    results = manifest.get("results") or {}
    plans = []
    config = _read_json(directory / "config.json")
    layers = architecture_layers(config) if isinstance(config, dict) else None
    if layers:
        plans.append((Figure("Architecture per layer against the parent", ARCHITECTURE_PNG),
                      lambda fig: _draw_architecture(fig, layers, config, name)))
    log = results.get("log")
    records = _read_log(directory / log) if isinstance(log, str) else []
    series = training_series(records)
    if "loss" in series:
        plans.append((Figure("Training loss and held-out figures", TRAINING_PNG),
                      lambda fig: _draw_training(fig, series, name)))
    if isinstance(results.get("frontier"), list):
        plans.append((Figure("Predicted quality against throughput", FRONTIER_PNG),
                      lambda fig: _draw_frontier(fig, results)))
    return plans


def _save(draw, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure as MplFigure

    from mlxkit.engines.core.atomic import atomic_file

    # A Figure made directly (not through pyplot) belongs to no global state and needs no closing.
    fig = MplFigure(figsize=(8, 5), dpi=100, layout="constrained")
    draw(fig)
    with atomic_file(path) as tmp:
        # No creation-time metadata, so the same data draws the same bytes.
        fig.savefig(tmp, format="png", metadata={"Software": None})


def _draw_architecture(fig, layers: list[LayerBlocks], config: dict[str, Any], name: str) -> None:
    from matplotlib.patches import Patch

    attention_ax, ffn_ax = fig.subplots(2, 1, sharex=True)
    x = [layer.layer for layer in layers]
    parent_kv = int(config.get("parent_num_key_value_heads") or config["num_key_value_heads"])
    parent_width = int(config.get("parent_intermediate_size") or config["intermediate_size"])
    for ax, kinds, fractions, labels, title in (
            (attention_ax, [l.attention for l in layers], [l.attention_fraction for l in layers],
             [str(l.kv_heads) if l.attention == "gqa" else "" for l in layers],
             f"attention: KV heads / parent's {parent_kv}"),
            (ffn_ax, [l.ffn for l in layers], [l.ffn_fraction for l in layers],
             [str(l.intermediate_size) if l.ffn == "mlp" else "" for l in layers],
             f"FFN: width / parent's {parent_width}")):
        colours = [KIND_COLOURS[k] for k in kinds]
        bars = ax.bar(x, [f if k != "no_op" else 0.04 for k, f in zip(kinds, fractions)], color=colours,
                      hatch=None, edgecolor="white", linewidth=0.5)
        for bar, kind in zip(bars, kinds):
            if kind == "linear":
                bar.set_hatch("//")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="parent")
        # Sizes are written on the narrowed blocks only; a kept one is at the parent's line.
        for xi, fraction, label in zip(x, fractions, labels):
            if label and fraction < 1.0:
                ax.text(xi, fraction + 0.02, label, ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, 1.25)
        ax.set_ylabel("fraction of parent")
        ax.set_title(title, fontsize=10, loc="left")
    ffn_ax.set_xlabel("layer")
    ffn_ax.set_xticks(x if len(x) <= 40 else x[::max(1, len(x) // 20)])
    legend = [Patch(color=KIND_COLOURS["gqa"], label="kept / narrowed"),
              Patch(facecolor=KIND_COLOURS["linear"], hatch="//", label="linear map"),
              Patch(color=KIND_COLOURS["no_op"], label="removed (no-op)")]
    attention_ax.legend(handles=legend + [attention_ax.get_lines()[0]], loc="upper right", fontsize=8, ncol=4)
    fig.suptitle(f"{name}: {len(layers)} layers against the parent")


def _draw_training(fig, series: dict[str, list[tuple[float, float]]], name: str) -> None:
    held_out = [k for k in ("eval.kl_div", "eval.perplexity", "eval.loss") if k in series]
    axes = fig.subplots(1, 1 + len(held_out[:1]))
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    loss = series["loss"]
    axes[0].plot([p[0] for p in loss], [p[1] for p in loss], marker="." if len(loss) < 50 else None)
    axes[0].set_title("training loss", fontsize=10, loc="left")
    if held_out:
        key = held_out[0]
        points = series[key]
        axes[1].plot([p[0] for p in points], [p[1] for p in points], marker="o", color="#ef8636")
        label = {"eval.kl_div": "held-out KL(parent ‖ model)", "eval.perplexity": "held-out perplexity",
                 "eval.loss": "held-out loss"}[key]
        axes[1].set_title(label, fontsize=10, loc="left")
    from matplotlib.ticker import EngFormatter, MaxNLocator

    for ax in axes:
        ax.set_xlabel("tokens")
        ax.xaxis.set_major_locator(MaxNLocator(5, integer=True))
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 16k, not 16000
        ax.grid(alpha=0.3)
    fig.suptitle(name)


def _draw_frontier(fig, results: dict[str, Any]) -> None:
    ax = fig.subplots()
    rows = results["frontier"]
    solved = sorted((r for r in rows if "infeasible" not in r), key=lambda r: r["speedup"])
    corrected = any(r.get("estimate_corrected") is not None for r in solved)
    quality = [(r["estimate_corrected"] if corrected else r["objective"]) for r in solved]
    ax.plot([1.0] + [r["speedup"] for r in solved], [0.0] + quality, color="#3b75af", zorder=1)
    ax.scatter([r["speedup"] for r in solved], quality, color="#3b75af", zorder=2, label="chosen child")
    ax.scatter([1.0], [0.0], marker="*", s=150, color="black", zorder=3, label="parent")
    for row, q in zip(solved, quality):
        ax.annotate(f"target {row['throughput']}", (row["speedup"], q), textcoords="offset points", xytext=(5, 5),
                    fontsize=8)
    for row in rows:
        if "infeasible" in row and str(row["throughput"]).lower().endswith("x"):
            try:
                wanted = float(str(row["throughput"])[:-1])
            except ValueError:
                continue
            ax.axvline(wanted, color="#b0b0b0", linestyle=":")
            ax.annotate(f"{row['throughput']}: infeasible", (wanted, 0), rotation=90, fontsize=8, va="bottom")
    metric = solved[0].get("metric", "score") if solved else "score"
    ax.set_xlabel("predicted throughput / parent's")
    ax.set_ylabel(f"predicted {metric}" + (" (in-context corrected)" if corrected else " (summed block scores)"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Puzzle frontier on {results.get('target')}", fontsize=11)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_log(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
