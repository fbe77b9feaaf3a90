"""The `mlx` command: registers each verb from its own module."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperGroup

from mlxkit import __version__
from mlxkit.cli._errors import EXIT_TERMINATED, Failure, Terminated, fail, print_json_error

_JSON_FLAG = "mlxkit.json"  # ctx.meta key: was --json among the arguments


class _MlxGroup(TyperGroup):
    """The root group; with `--json`, every error is also printed as one JSON object on stdout.

    Errors come from two places: the verbs (`guarded` raises a `Failure`) and argument
    parsing (a usage error, raised before any verb runs). Both pass through `invoke`.
    """

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        # Read from the raw arguments: a usage error can happen before --json itself is parsed.
        ctx.meta[_JSON_FLAG] = "--json" in args
        return super().parse_args(ctx, args)

    def invoke(self, ctx: Any) -> Any:
        try:
            try:
                return super().invoke(ctx)
            except Terminated:  # outside a verb (while parsing); inside one, `guarded` reports it
                raise fail("terminated (SIGTERM)", EXIT_TERMINATED, "Terminated") from None
        except Failure as exc:
            if ctx.meta.get(_JSON_FLAG):
                print_json_error(exc.error_type, exc.message, exc.exit_code)
            raise
        except Exception as exc:
            # typer vendors click privately, so its usage errors are recognised by their interface.
            if not (isinstance(getattr(exc, "exit_code", None), int) and callable(getattr(exc, "format_message", None))):
                raise
            if ctx.meta.get(_JSON_FLAG):
                print_json_error(type(exc).__name__, exc.format_message(), exc.exit_code)
            # One `error:` line like every other error, instead of click's usage box.
            where = getattr(getattr(exc, "ctx", None), "command_path", None) or "mlx"
            raise fail(f"{exc.format_message()} (see '{where} --help')", exc.exit_code, type(exc).__name__) from None


app = typer.Typer(
    name="mlx",
    cls=_MlxGroup,
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
    # Importing mlxkit registers its model classes with transformers, so transformers and the hub have
    # read these variables already; their switches are set directly too, unless the user asked for bars.
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        if "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        if "transformers" in sys.modules:
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()


def _register() -> None:
    from mlxkit.cli import calibrate
    from mlxkit.cli import distill
    from mlxkit.cli import eval as eval_cmd
    from mlxkit.cli import export
    from mlxkit.cli import fetch, finetune
    from mlxkit.cli import library
    from mlxkit.cli import merge, recipes, report
    from mlxkit.cli import search
    from mlxkit.cli import solve

    app.command("calibrate", help=calibrate.__doc__)(calibrate.calibrate_command)
    app.command("distill", help=distill.__doc__)(distill.distill_command)
    app.command("eval", help=eval_cmd.__doc__)(eval_cmd.eval_command)
    app.command("export", help=export.__doc__)(export.export_command)
    app.command("fetch", help=fetch.__doc__)(fetch.fetch_command)
    app.command("finetune", help=finetune.__doc__)(finetune.finetune_command)
    app.add_typer(library.library_app, name="library")
    app.command("merge", help=merge.__doc__)(merge.merge_command)
    app.command("recipes", help=recipes.__doc__)(recipes.recipes_command)
    app.command("report", help=report.__doc__)(report.report_command)
    app.command("search", help=search.__doc__)(search.search_command)
    app.command("solve", help=solve.__doc__)(solve.solve_command)


_register()


def _raise_terminated(signum: int, frame: object) -> None:
    # A second SIGTERM (e.g. a supervisor losing patience during cleanup) ends the process at once.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Terminated()


def install_signal_handlers() -> None:
    """Make SIGTERM raise `Terminated` in the main thread.

    Python's default for SIGTERM kills the process without unwinding, which would leave
    the `.<name>.tmp-*` temporaries of an atomic write behind. Raised as an exception,
    it runs the same cleanup as Ctrl-C and ends in one error line and exit code 143.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def _exit_code(done: SystemExit) -> int:
    if done.code is None or isinstance(done.code, int):
        return done.code or 0
    print(done.code, file=sys.stderr)  # sys.exit("message") prints the message and exits 1
    return 1


def main() -> None:
    install_signal_handlers()
    world = os.environ.get("WORLD_SIZE", "1").strip()
    if not world.isdigit() or int(world) <= 1:
        app()
        return
    # Under torchrun or accelerate every verb has left its process group and written its outputs by
    # the time it returns. The interpreter's teardown after that can still abort a rank (gloo's C++
    # threads meet static destructors: "terminate called without an active exception", exit -6),
    # and the launcher then reports a finished run as failed. So a launched process ends here.
    try:
        app()
        code = 0
    except SystemExit as done:
        code = _exit_code(done)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
