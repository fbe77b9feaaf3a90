"""Progress and notices from long-running engine work.

Engines take a `Reporter` and never print directly. The CLI passes a `RichReporter`
(progress bars with ETA on stderr) unless `--quiet` or `--json` asks for silence.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


class Reporter:
    """Silent reporter; the base every other reporter refines."""

    def track(self, iterable: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
        yield from iterable

    @contextlib.contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator["TaskHandle"]:
        yield TaskHandle()

    def notice(self, message: str) -> None:
        """A one-line message the user should see (e.g. which data is used)."""

    def debug(self, message: str) -> None:
        """Detail shown with --verbose only."""


class TaskHandle:
    def advance(self, amount: float = 1.0) -> None:
        pass

    def update(self, **fields: object) -> None:
        pass


class RichReporter(Reporter):
    """Progress bars with an ETA and notices, all on stderr."""

    def __init__(self, verbose: bool = False) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.verbose = verbose

    def _progress(self):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        return Progress(SpinnerColumn(), TextColumn("[progress.description]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                        TextColumn("{task.fields[info]}"), console=self.console, transient=False)

    def track(self, iterable: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        with self.task(description, total) as handle:
            for item in iterable:
                yield item
                handle.advance()

    @contextlib.contextmanager
    def task(self, description: str, total: int | None = None) -> Iterator[TaskHandle]:
        with self._progress() as progress:
            task_id = progress.add_task(description, total=total, info="")
            yield _RichTaskHandle(progress, task_id)

    def notice(self, message: str) -> None:
        self.console.print(f"[cyan]•[/cyan] {message}", highlight=False)

    def debug(self, message: str) -> None:
        if self.verbose:
            self.console.print(f"[dim]{message}[/dim]", highlight=False)


class _RichTaskHandle(TaskHandle):
    def __init__(self, progress, task_id) -> None:
        self.progress, self.task_id = progress, task_id

    def advance(self, amount: float = 1.0) -> None:
        self.progress.advance(self.task_id, amount)

    def update(self, **fields: object) -> None:
        info = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        self.progress.update(self.task_id, info=info)
