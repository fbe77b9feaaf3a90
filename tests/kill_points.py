"""Run `mlx ARGS` and SIGKILL it at the K-th write, the way a power cut or an OOM killer would.

    python tests/kill_points.py COUNT_FILE K MODE -- ARGS...

Every call that writes to the file system is an event: `open` for writing, `os.replace`,
`os.rename`, `shutil.rmtree`, safetensors' `save_file` and `torch.save`. At event K the process
kills itself with SIGKILL, so no handler, `finally` or atexit runs:

* MODE `before`: just before the call;
* MODE `torn`: after the call, having first cut the file it wrote to half its size (for the
  writers that take a path; other events behave as `after`), i.e. a write torn by the kill;
* MODE `after`: just after the call.

K = 0 never kills: the run goes to the end and COUNT_FILE receives the number of events it
made, which is what a test draws its seeded kill points from (and COUNT_FILE.trace one line
per event: its number, the call and the path it wrote, to tell where each kill point falls). Writers are patched before
mlxkit is imported, so `from safetensors.torch import save_file` inside mlxkit binds the
patched one.
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
import signal
import sys
from pathlib import Path

COUNT_FILE, KILL_AT, MODE = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ARGS = sys.argv[sys.argv.index("--") + 1:]
events = 0
trace: list[str] = []


def _note(kind: str, args) -> None:
    if KILL_AT == 0:
        target = args[-1] if kind in ("os.replace", "os.rename") else (args[1] if kind != "open" and len(args) > 1
                                                                       else args[0] if args else "")
        trace.append(f"{events} {kind} {target}")


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _tear(path: object) -> None:
    try:
        target = Path(os.fspath(path))
        if target.is_file():
            size = target.stat().st_size
            with _open(target, "r+b") as handle:
                handle.truncate(size // 2)
    except (TypeError, OSError):
        pass


def _event(call, kind: str, path_of=None):
    def wrapper(*args, **kwargs):
        global events
        events += 1
        _note(kind, args)
        if events == KILL_AT and MODE == "before":
            _die()
        result = call(*args, **kwargs)
        if events == KILL_AT:
            if MODE == "torn" and path_of is not None:
                _tear(path_of(args, kwargs))
            _die()
        return result
    return wrapper


_open = builtins.open


def _writes(args, kwargs) -> bool:
    mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
    return isinstance(mode, str) and any(flag in mode for flag in "wax+")


def _open_counted(*args, **kwargs):
    if not _writes(args, kwargs):
        return _open(*args, **kwargs)
    return _open_then_maybe_die(*args, **kwargs)


def _open_then_maybe_die(*args, **kwargs):
    global events
    events += 1
    _note("open", args)
    if events == KILL_AT and MODE == "before":
        _die()
    handle = _open(*args, **kwargs)
    if events == KILL_AT:
        if MODE == "after":
            _die()  # the file exists, empty: killed between creating and writing it
        # A torn write must come after the writer wrote its contents: cut the file once it is closed.
        close = handle.close

        def close_then_die():
            close()
            _tear(args[0])
            _die()
        handle.close = close_then_die
    return handle


builtins.open = io.open = _open_counted
os.replace = _event(os.replace, "os.replace")
os.rename = _event(os.rename, "os.rename")
shutil.rmtree = _event(shutil.rmtree, "shutil.rmtree")

import safetensors.torch  # noqa: E402
import torch  # noqa: E402

safetensors.torch.save_file = _event(safetensors.torch.save_file, "save_file",
                                     lambda a, k: a[1] if len(a) > 1 else k["filename"])
torch.save = _event(torch.save, "torch.save", lambda a, k: a[1] if len(a) > 1 else k["f"])

from mlxkit.cli.main import main  # noqa: E402

sys.argv = ["mlx", *ARGS]
try:
    main()
finally:
    if KILL_AT == 0:
        builtins.open = io.open = _open  # the report itself is no event
        COUNT_FILE.write_text(str(events))
        COUNT_FILE.with_name(COUNT_FILE.name + ".trace").write_text("".join(line + "\n" for line in trace))
