"""`mlx distill --gkd` / `--kd`: whole-model distillation of a student against a teacher."""

from __future__ import annotations

from pathlib import Path

from mlxkit.cli._errors import fail
from mlxkit.cli._options import Output, console, flags_and_overrides


def run_global_distillation(*, mode: str, teacher: str | None, student: str | None, out: Path, data: Path | None,
                            text_field: str, recipe: str | None, tokens: int | None, overrides: list[str],
                            seed: int, overwrite: bool, allow_pickle: bool, device: str, dtype: str,
                            save_dtype: str | None, sharding: str, output: Output) -> None:
    from mlxkit.engines.distill.recipe import load_distill_recipe
    from mlxkit.engines.distill.trainer import DistillationOptions, run_distillation

    if teacher is None or student is None:
        raise fail(f"--{mode} needs --teacher and --student")
    if tokens is not None and tokens < 1:
        raise fail(f"--tokens must be positive (got {tokens})")
    # --tokens reaches the trainer as its own option; checked here only so that it never silently beats --set.
    flags_and_overrides({"schedule.tokens": ("--tokens", tokens)}, overrides)
    loaded = load_distill_recipe(recipe or mode).with_overrides(flags_and_overrides({}, overrides))
    options = DistillationOptions(mode=mode, teacher=teacher, student=student, out=out, recipe=loaded, data=data,  # type: ignore[arg-type]
                                  text_field=text_field, tokens=tokens, seed=seed, overwrite=overwrite,
                                  allow_pickle=allow_pickle, device=device, dtype=dtype, save_dtype=save_dtype,
                                  sharding=sharding)
    summary = run_distillation(options, output.reporter)
    if not summary:  # a non-zero rank of a distributed run: rank 0 reports
        return
    output.emit(summary, lambda s: _render(mode, s))


def _render(mode: str, summary: dict) -> None:
    before, after = summary["before"], summary["after"]
    console.print(f"[green]{mode.upper()}[/green] {summary['out']}: {summary['tokens']} tokens in {summary['steps']} "
                  f"steps; held-out KL {before['kl_div']:.4f} → {after['kl_div']:.4f}, top-1 agreement "
                  f"{before['top1_agreement']:.3f} → {after['top1_agreement']:.3f}, perplexity "
                  f"{before['perplexity']:.2f} → {after['perplexity']:.2f} ({summary['wall_time_s']} s)")
