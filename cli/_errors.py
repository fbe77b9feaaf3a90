"""Turn engine errors into one line on stderr and an exit code (no tracebacks)."""

from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

import typer
from rich.console import Console

from mlxkit.engines.errors import MlxkitError

F = TypeVar("F", bound=Callable)
_stderr = Console(stderr=True)

# Exceptions outside our hierarchy that still mean "bad input" and deserve one line.
_FOREIGN_INPUT_ERRORS: tuple[type[BaseException], ...] = (FileNotFoundError, IsADirectoryError, PermissionError)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one error line and return the Exit to raise (flag conflicts and the like)."""
    _stderr.print(f"[bold red]error:[/bold red] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def guarded(func: F) -> F:
    """Run a CLI command; engine errors become `error: ...` and a non-zero exit code.

    Set MLXKIT_DEBUG=1 to see the full traceback instead.
    """

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if os.environ.get("MLXKIT_DEBUG"):
            return func(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        except MlxkitError as exc:
            raise fail(str(exc), exc.exit_code) from None
        except _FOREIGN_INPUT_ERRORS as exc:
            raise fail(f"{exc.strerror or exc}: {exc.filename}" if getattr(exc, "filename", None) else str(exc),
                       2) from None
        except KeyboardInterrupt:
            raise fail("interrupted; nothing partial was written (rerun to resume where supported)", 130) from None
        except MemoryError:
            raise fail("out of memory; try a smaller --batch or --seq-len", 7) from None

    return wrapper  # type: ignore[return-value]
