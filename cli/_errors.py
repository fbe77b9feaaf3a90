"""Turn errors into one line on stderr and an exit code (no tracebacks).

With `--json` the same error is also printed on stdout as one JSON object,
`{"error": {"type": ..., "message": ..., "exit_code": ...}}`, so a CI job that parses
stdout gets a parseable answer on failure too (`cli/main.py` prints it).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Callable, TypeVar

import typer
from rich.console import Console

from mlxkit.engines.errors import MlxkitError

F = TypeVar("F", bound=Callable)
stderr_console = Console(stderr=True)  # error and notice lines of every command

# OSErrors that mean "bad input" (exit 2); any other OSError (a full disk, an I/O error) exits 1.
_FOREIGN_INPUT_ERRORS: tuple[type[BaseException], ...] = (FileNotFoundError, IsADirectoryError, NotADirectoryError,
                                                          FileExistsError, PermissionError)

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """Raised by the CLI's SIGTERM handler (`cli/main.py`).

    A subclass of KeyboardInterrupt so a SIGTERM unwinds exactly like Ctrl-C: `with`
    blocks exit (atomic writes remove their temporaries) and `except Exception` in the
    engines does not swallow it. Only the exit code differs.
    """


class Failure(typer.Exit):
    """The Exit raised for an error; it keeps the message so `--json` can repeat it on stdout."""

    def __init__(self, message: str, code: int, error_type: str) -> None:
        super().__init__(code)
        self.message = message
        self.error_type = error_type


def fail(message: str, code: int = 2, error_type: str = "UsageError") -> Failure:
    """Print one error line and return the Exit to raise (flag conflicts and the like)."""
    stderr_console.print(f"[bold red]error:[/bold red] {message}", highlight=False, soft_wrap=True)
    return Failure(message, code, error_type)


def print_json_error(error_type: str, message: str, exit_code: int) -> None:
    """The `--json` form of an error: one object on stdout."""
    payload = {"error": {"type": error_type, "message": message, "exit_code": exit_code}}
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


def os_error_message(exc: OSError) -> str:
    """`reason: path` for an OSError, naming the path the user asked for rather than our hidden temporary."""
    from mlxkit.engines.core.atomic import user_path

    paths = [user_path(os.fsdecode(p) if isinstance(p, (str, bytes, os.PathLike)) else str(p))
             for p in (exc.filename, exc.filename2) if p not in (None, "")]
    reason = exc.strerror or str(exc) or type(exc).__name__
    if not paths:
        return reason
    return f"{reason}: {' -> '.join(paths) if len(paths) == 2 and paths[0] != paths[1] else paths[0]}"


def guarded(func: F) -> F:
    """Run a CLI command; errors become `error: ...` and a non-zero exit code.

    Set MLXKIT_DEBUG=1 to see the full traceback instead.
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if os.environ.get("MLXKIT_DEBUG"):
            return func(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        except MlxkitError as exc:
            raise fail(str(exc), exc.exit_code, type(exc).__name__) from None
        except OSError as exc:
            code = 2 if isinstance(exc, _FOREIGN_INPUT_ERRORS) else 1
            raise fail(os_error_message(exc), code, type(exc).__name__) from None
        except Terminated:
            raise fail("terminated (SIGTERM); nothing partial was written (rerun to resume where supported)",
                       EXIT_TERMINATED, "Terminated") from None
        except KeyboardInterrupt:
            raise fail("interrupted; nothing partial was written (rerun to resume where supported)",
                       EXIT_INTERRUPTED, "Interrupted") from None
        except MemoryError:
            raise fail("out of memory; try a smaller --batch or --seq-len", 7, "MemoryError") from None

    return wrapper  # type: ignore[return-value]
