"""Rich tables for `mlx search` results and `--costs-only` price lists."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _num(value, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and abs(value) >= 1e4:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def render_search(result: dict, console: Console, quiet: bool = False) -> None:
    predicted = result["predicted"]
    if not quiet:
        table = Table(title=f"Puzzle child for {result['target']}  ({_scenario(result['scenario'])})")
        table.add_column("layer", justify="right")
        table.add_column("attention")
        table.add_column("ffn")
        for row in result["choices"]:
            table.add_row(str(row["layer"]), row["attention"], row["ffn"])
        console.print(table)
        summary = Table(show_header=False, title="prediction and held-out evaluation")
        engine = result.get("engine")
        if engine:
            dropped = [f"{kind} {name}" for kind, names in engine["excluded"].items() for name in names]
            summary.add_row("serving engine", engine["name"] + (f" (without {', '.join(dropped)})" if dropped else ""))
        label = "predicted score (corrected in context)" if result.get("corrected") else "summed score"
        summary.add_row(label, f"{result['metric']} {_num(result['objective'])} ({result['status']}, "
                               f"solved in {result['solve_time_s']} s)")
        if result.get("estimate_corrected") is not None and not result.get("refinement"):
            summary.add_row("in-context estimate", f"{result['metric']} {_num(result['estimate_corrected'])} "
                                                   "(this target's last refinement's corrections)")
        refinement = result.get("refinement")
        if refinement:
            for index, entry in enumerate(refinement["rounds"]):
                kept = " (kept)" if index == refinement["best_round"] else ""
                summary.add_row(f"refinement round {index + 1}{kept}",
                                f"predicted {_num(entry['predicted_isolated'])} isolated, "
                                f"{_num(entry['predicted_corrected'])} corrected; measured {_num(entry['measured'])}")
        if predicted.get("speedup"):
            summary.add_row("predicted speed-up", f"{predicted['speedup']:.2f}x  ({_num(predicted['tokens_per_s'])} vs "
                                                  f"{_num(predicted['parent_tokens_per_s'])} tok/s)")
        summary.add_row("predicted memory", f"{_num(predicted['memory_mib'])} MiB of "
                                            f"{_num(predicted['memory_capacity_mib'])} (parent "
                                            f"{_num(predicted['parent_memory_mib'])})")
        if predicted.get("num_params"):
            summary.add_row("parameters", f"{_num(predicted['num_params'])} (parent {_num(predicted['parent_num_params'])})")
        evaluation = result.get("evaluation") or {}
        after = result.get("evaluation_after_gkd") or {}
        if evaluation and after:
            # One pair, on the same held-out tokens: the assembled child, then the distilled one.
            summary.add_row("held-out perplexity", f"{evaluation['perplexity']:.2f} → {after['perplexity']:.2f} "
                                                   f"after GKD; parent {evaluation['parent_perplexity']:.2f} "
                                                   f"({evaluation['tokens']} tokens)")
            summary.add_row("KL / top-1 agreement", f"{evaluation['kl_div']:.4f} → {after['kl_div']:.4f} / "
                                                    f"{evaluation['top1_agreement']:.3f} → {after['top1_agreement']:.3f}")
        elif evaluation:
            summary.add_row("held-out perplexity", f"{evaluation['perplexity']:.3f} child vs "
                                                   f"{evaluation['parent_perplexity']:.3f} parent "
                                                   f"({evaluation['tokens']} tokens)")
            summary.add_row("KL / top-1 agreement", f"{evaluation['kl_div']:.4f} / {evaluation['top1_agreement']:.3f}")
        gkd = result.get("gkd")
        if gkd:
            summary.add_row("global distillation", f"{gkd['tokens']} tokens in {gkd['steps']} steps")
        for alt in result.get("alternatives", []):
            summary.add_row("alternative", f"{result['metric']} {_num(alt['objective'])}, differs in "
                                           f"{alt['distance_from_best']} layers")
        console.print(summary)
    for key, label in (("costs_file", "priced variants"), ("lp_file", "MIP (LP format)")):
        if result.get(key):
            console.print(f"[green]{label}[/green] {result[key]}")
    if result.get("out"):
        console.print(f"[green]child[/green] {result['out']}")
    if result.get("export"):
        console.print(f"[green]{result['export']['format']} ({result['export']['dtype']})[/green] "
                      f"{result['export']['out']}")
    engine = result.get("engine")
    if engine and result.get("out") and not quiet:
        exported = (result.get("export") or {}).get("out")
        if exported is None and engine["export_format"] != "hf":
            suffix = ".gguf" if engine["export_format"] == "gguf" else f"-{engine['export_format']}"
            exported = f"{result['out']}{suffix}"
            console.print(f"[green]serve[/green] mlx export {result['out']} --format {engine['export_format']} "
                          f"--out {exported}")
        console.print(f"[green]serve[/green] {engine['serve'].replace('EXPORT', exported or result['out'])}")


def render_frontier(result: dict, console: Console) -> None:
    from collections import Counter

    corrected = any(row.get("estimate_corrected") is not None for row in result["frontier"])
    estimate = "in-context corrected estimate" if corrected else "summed replace-1-block score"
    table = Table(title=f"Puzzle frontier on {result['target']} (predicted; {estimate})")
    for column in ("target", "speedup", "memory MiB", "params (M)", "estimate" if corrected else "Σ score",
                   "attention", "ffn"):
        table.add_column(column)
    for row in result["frontier"]:
        if "infeasible" in row:
            table.add_row(row["throughput"], "infeasible", "", "", "", row["infeasible"][:60], "")
            continue
        mix = {kind: " ".join(f"{name}×{n}" for name, n in Counter(c[kind] for c in row["choices"]).most_common())
               for kind in ("attention", "ffn")}
        table.add_row(row["throughput"], f"{row['speedup']:.3f}x", _num(row["memory_mib"], 1),
                      _num((row["num_params"] or 0) / 1e6, 1),
                      _num(row["estimate_corrected"] if corrected else row["objective"]), mix["attention"], mix["ffn"])
    console.print(table)
    report = result.get("report")
    if report:
        drawn = ", ".join(report["drawn"]) or f"no picture ({report['skipped']})"
        console.print(f"[green]report[/green] {report['out']}: frontier.json, {drawn}")


def render_costs(report: dict, console: Console) -> None:
    table = Table(title=f"{report['model']} on {report['target']}  ({_scenario(report['scenario'])})")
    for column in ("subblock", "variant", "params", "memory MiB", "runtime ms", "prefill ms", "decode step ms"):
        table.add_column(column, justify="right" if column not in ("subblock", "variant") else "left")
    for kind in ("attention", "ffn"):
        for name, stats in report[kind].items():
            table.add_row(kind, name, _num(stats.get("num_params")), _num(stats.get("memory_mib")),
                          _num(stats.get("runtime_ms")), _num(stats.get("prefill_runtime_ms")),
                          _num(stats.get("decode_step_ms")))
    console.print(table)
    parent = report["parent_model"]
    console.print(f"parent model: {_num(parent.get('memory_mib'))} MiB "
                  f"(capacity {_num(report['memory_capacity_mib'])} MiB), "
                  f"{_num(parent.get('tokens_per_s'))} tok/s")


def _scenario(s: dict) -> str:
    return f"batch {s['batch']}, in {s['input_len']}, out {s['output_len']}, {s['weight_dtype']} weights, " \
           f"{s['kv_dtype']} KV"
