"""Progress in a log: plain, flushed lines when stderr is not a terminal."""

from __future__ import annotations

import io

from rich.console import Console

from mlxkit.engines.core.progress import RichReporter


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FlushCountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


def _reporter(stream, clock, interval_s=30.0) -> RichReporter:
    return RichReporter(console=Console(file=stream), interval_s=interval_s, clock=clock, stamp=lambda: "")


def test_a_log_gets_a_start_line_throttled_progress_and_an_end_line():
    stream, clock = FlushCountingStream(), FakeClock()
    reporter = _reporter(stream, clock)
    assert not reporter.console.is_terminal
    with reporter.task("training", total=10) as task:
        assert stream.getvalue() == "training: started (10 steps)\n"
        clock.now += 10
        task.advance()  # 10 s after the start: too early for a line
        assert stream.getvalue().count("\n") == 1
        clock.now += 20
        task.advance()
        task.update(loss=0.12345, step="b")
        lines = stream.getvalue().splitlines()
        # 2 of 10 in 30 s: 0.0667/s, so 8 more take 120 s; the fields arrived after this line
        assert lines[1] == "training: 2/10, 0.0667/s, ETA 2m00s"
        clock.now += 31
        task.advance(3)
    lines = stream.getvalue().splitlines()
    assert lines[2] == "training: 5/10, 0.082/s, ETA 1m01s, loss=0.1235  step=b"
    assert lines[3] == "training: 5/10 done in 1m01s, 0.082/s, loss=0.1235  step=b"
    assert len(lines) == 4
    assert stream.flushes >= 4  # every line is flushed as it is written


def test_track_without_a_total_and_a_failing_task_has_no_end_line():
    stream, clock = FlushCountingStream(), FakeClock()
    reporter = _reporter(stream, clock, interval_s=0.0)

    def items():
        for i in range(3):
            clock.now += 2
            yield i

    assert list(reporter.track(items(), "reading")) == [0, 1, 2]
    lines = stream.getvalue().splitlines()
    assert lines[0] == "reading: started"
    assert lines[1].startswith("reading: 1, 0.5/s") and "ETA" not in lines[1]
    assert lines[-1] == "reading: 3 done in 6s, 0.5/s"

    stream.truncate(0), stream.seek(0)
    with reporter.task("evaluating"):  # counts nothing: its end line gives the time alone
        clock.now += 8
    assert stream.getvalue().splitlines() == ["evaluating: started", "evaluating: done in 8s"]

    stream.truncate(0), stream.seek(0)
    try:
        with reporter.task("doomed", total=2):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert stream.getvalue().splitlines() == ["doomed: started (2 steps)"]


def test_notices_still_print_and_debug_only_when_verbose():
    stream = io.StringIO()
    RichReporter(console=Console(file=stream)).debug("hidden")
    reporter = RichReporter(verbose=True, console=Console(file=stream))
    reporter.notice("using sampled text")
    reporter.debug("shown")
    assert "using sampled text" in stream.getvalue() and "shown" in stream.getvalue()
    assert "hidden" not in stream.getvalue()


def test_plain_lines_carry_the_wall_clock_time_and_json_runs_get_them_on_a_terminal_too():
    stream, clock = FlushCountingStream(), FakeClock()
    terminal = Console(file=stream, force_terminal=True)
    reporter = RichReporter(plain=True, console=terminal, clock=clock, stamp=lambda: "[12:00:00] ")
    assert terminal.is_terminal and reporter.plain
    with reporter.task("scoring", total=2) as task:
        clock.now += 11
        task.advance()  # past the default interval: a progress line
    reporter.notice("cached library reused")
    lines = stream.getvalue().splitlines()
    assert lines == ["[12:00:00] scoring: started (2 steps)", "[12:00:00] scoring: 1/2, 0.0909/s, ETA 11s",
                     "[12:00:00] scoring: 1/2 done in 11s, 0.0909/s", "[12:00:00] • cached library reused"]
    import re

    default = RichReporter(console=Console(file=io.StringIO()))
    default.notice("x")
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] • x\n", default.console.file.getvalue())


def test_a_json_run_piped_to_files_has_progress_on_stderr_and_only_the_json_on_stdout(tiny_llama_dir, text_file):
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "mlxkit", "eval", str(tiny_llama_dir), "--data", str(text_file),
                           "--device", "cpu", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["perplexity"] > 0  # stdout is exactly one JSON object
    stamped = [line for line in done.stderr.splitlines() if line[:1] == "[" and line[9:11] == "] "]
    assert any(line.endswith(": started") or "started (" in line for line in stamped), done.stderr
    assert any(" done in " in line for line in stamped), done.stderr
    quiet = subprocess.run([sys.executable, "-m", "mlxkit", "eval", str(tiny_llama_dir), "--data", str(text_file),
                            "--device", "cpu", "--json", "--quiet"], capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and not [line for line in quiet.stderr.splitlines() if " done in " in line]
