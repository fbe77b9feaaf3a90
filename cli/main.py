"""The `mlx` command: registers each verb from its own module."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from mlxkit import __version__

app = typer.Typer(
    name="mlx",
    help="mlxkit: compress and deploy language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mlxkit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """mlxkit: compress and deploy language models."""
    _quiet_third_party_output()


def _quiet_third_party_output() -> None:
    """mlx draws its own progress; silence the per-library bars and info logs of transformers/hub."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def _register() -> None:
    from mlxkit.cli import calibrate
    from mlxkit.cli import distill
    from mlxkit.cli import eval as eval_cmd
    from mlxkit.cli import fetch
    from mlxkit.cli import merge, recipes
    from mlxkit.cli import search
    from mlxkit.cli import solve

    app.command("calibrate", help=calibrate.__doc__)(calibrate.calibrate_command)
    app.command("distill", help=distill.__doc__)(distill.distill_command)
    app.command("eval", help=eval_cmd.__doc__)(eval_cmd.eval_command)
    app.command("fetch", help=fetch.__doc__)(fetch.fetch_command)
    app.command("merge", help=merge.__doc__)(merge.merge_command)
    app.command("recipes", help=recipes.__doc__)(recipes.recipes_command)
    app.command("search", help=search.__doc__)(search.search_command)
    app.command("solve", help=solve.__doc__)(solve.solve_command)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
