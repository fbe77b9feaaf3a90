"""Progress and notices from long-running engine work.

Engines take a `Reporter` and never print directly. The CLI passes a `RichReporter`
(progress on stderr) unless `--quiet` asks for silence. On a terminal it draws live bars with
an ETA; in a log file or a pipe (CI, `make demo > log`), and with `--json` (whose stdout holds
only the JSON), it writes plain, flushed, timestamped lines instead: a task's start, its
progress at most every `LOG_INTERVAL_S` with count, rate and ETA, and its end.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, TypeVar

if TYPE_CHECKING:
    from rich.console import Console

T = TypeVar("T")

# How often a non-terminal log gets a progress line for a running task: often enough that a CI
# log tells a slow stage from a hung one, rarely enough that a long run's log stays readable.
LOG_INTERVAL_S = 10.0


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
    """Progress and notices on stderr: live bars on a terminal, plain lines otherwise.

    `console`, `interval_s` and `clock` exist for tests: a console writing to a string
    buffer is not a terminal, and a fake clock makes the line cadence deterministic.
    """

    def __init__(self, verbose: bool = False, *, plain: bool = False, console: Console | None = None,
                 interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 stamp: Callable[[], str] | None = None) -> None:
        from rich.console import Console

        self.console = console if console is not None else Console(stderr=True)
        self.verbose = verbose
        self.plain = plain or not self.console.is_terminal  # plain lines: a log, a pipe, or --json
        self.interval_s = interval_s
        self.clock = clock
        self.stamp = stamp if stamp is not None else _wall_clock_stamp

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
        if self.plain:
            handle = _LogTaskHandle(self._write_line, description, total, self.interval_s, self.clock)
            yield handle
            handle.finish()  # not on an exception: the error line that follows says what happened
            return
        with self._progress() as progress:
            task_id = progress.add_task(description, total=total, info="")
            yield _RichTaskHandle(progress, task_id)

    def notice(self, message: str) -> None:
        if self.plain:
            self._write_line(f"• {message}")
            return
        # soft_wrap: one line per notice (rich would wrap it at 80 columns)
        self.console.print(f"[cyan]•[/cyan] {message}", highlight=False, soft_wrap=True)

    def debug(self, message: str) -> None:
        if not self.verbose:
            return
        if self.plain:
            self._write_line(message)
            return
        self.console.print(f"[dim]{message}[/dim]", highlight=False, soft_wrap=True)

    def _write_line(self, line: str) -> None:
        # Written to the stream itself, not through rich, so a line is never wrapped or styled,
        # and flushed at once so `tail -f` on a log shows it while the task runs.
        stream = self.console.file
        stream.write(f"{self.stamp()}{line}\n")
        stream.flush()


def _wall_clock_stamp() -> str:
    return time.strftime("[%H:%M:%S] ")


def _format_fields(fields: dict[str, object]) -> str:
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())


class _RichTaskHandle(TaskHandle):
    def __init__(self, progress, task_id) -> None:
        self.progress, self.task_id = progress, task_id

    def advance(self, amount: float = 1.0) -> None:
        self.progress.advance(self.task_id, amount)

    def update(self, **fields: object) -> None:
        self.progress.update(self.task_id, info=_format_fields(fields))


class _LogTaskHandle(TaskHandle):
    """One line when the task starts, one at most every `interval_s` while it runs, one at the end."""

    def __init__(self, write: Callable[[str], None], description: str, total: int | None, interval_s: float,
                 clock: Callable[[], float]) -> None:
        self.write, self.description, self.total = write, description, total
        self.interval_s, self.clock = interval_s, clock
        self.done = 0.0
        self.fields: dict[str, object] = {}
        self.started = self.last_line = clock()
        self.write(f"{description}: started" + (f" ({_count(total)} steps)" if total is not None else ""))

    def advance(self, amount: float = 1.0) -> None:
        self.done += amount
        self._maybe_write()

    def update(self, **fields: object) -> None:
        self.fields.update(fields)
        self._maybe_write()

    def finish(self) -> None:
        elapsed = self.clock() - self.started
        # A task that counts nothing (no total, never advanced) says only how long it took, not "0 done".
        counted = self.total is not None or self.done
        parts = [(f"{self._progress_count()} " if counted else "") + f"done in {_duration(elapsed)}"]
        if elapsed > 0 and self.done:
            parts.append(f"{_rate(self.done / elapsed)}/s")
        self.write(self._line(parts))

    def _maybe_write(self) -> None:
        now = self.clock()
        if now - self.last_line < self.interval_s:
            return
        self.last_line = now
        elapsed = now - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        parts = [self._progress_count(), f"{_rate(rate)}/s"]
        if self.total is not None and rate > 0:
            parts.append(f"ETA {_duration(max(0.0, self.total - self.done) / rate)}")
        self.write(self._line(parts))

    def _progress_count(self) -> str:
        return _count(self.done) + (f"/{_count(self.total)}" if self.total is not None else "")

    def _line(self, parts: list[str]) -> str:
        if self.fields:
            parts = [*parts, _format_fields(self.fields)]
        return f"{self.description}: " + ", ".join(parts)


def _count(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def _rate(per_second: float) -> str:
    return f"{per_second:,.0f}" if per_second >= 1000 else f"{per_second:.3g}"


def _duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`: short enough for a log line, exact enough for an ETA."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
