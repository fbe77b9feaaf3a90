"""Output paths: checked before any work, and held by one run at a time.

`check_output` refuses, up front, every output path that a run could only fail on at its end or
that would destroy an input: a parent that is a file, a directory that cannot be written, an output
of the wrong kind, an output that is an input or would contain one.

`output_lock` holds an output for a whole run. The lock is a file `.<name>.lock` beside the output,
put in place with a hard link (atomic, and exclusive on NFS as on a local disk) and holding its
owner: host, pid, process start time and boot id (`engines/core/owner.py`). A second run on the
same output finds the lock and stops with `OutputBusyError`. A lock is judged stale, and taken
over, only on its own host: when its pid is gone, or belongs to a later process, or the node
rebooted since. A lock held on another node is never removed from here; the error names the host
and the lock file, for a user who knows that run is gone. Work directories of a run are named after
its output (`.<out>.<kind>-work/`, or inside it), so the output's lock holds them too.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, Literal, Optional

from mlxkit.engines.core.owner import Owner
from mlxkit.engines.errors import InputError, OutputBusyError

OutputKind = Literal["dir", "file"]


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(path.anchor or "/")


def check_output(out: str | os.PathLike, *, kind: OutputKind, inputs: Iterable[str | os.PathLike | None] = ()) -> Path:
    """Refuse an output path the run cannot write, or one that would replace an input; return it resolved.

    Missing parent directories are fine (they are created), but the nearest one that exists must be a
    writable directory. An existing output is left to the caller to refuse or replace (`--overwrite`),
    as long as it is of the right `kind`.
    """
    given = Path(out).expanduser()
    resolved = given.resolve()
    if resolved.exists():
        if kind == "dir" and not resolved.is_dir():
            raise InputError(f"output '{given}' exists and is not a directory")
        if kind == "file" and resolved.is_dir():
            raise InputError(f"output '{given}' is a directory")
    parent = _nearest_existing(resolved.parent)
    if not parent.is_dir():
        raise InputError(f"cannot write '{given}': '{parent}' is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"cannot write '{given}': the directory '{parent}' is not writable")
    for spec in inputs:
        if spec is None or not os.path.exists(Path(spec).expanduser()):
            continue  # a hub id or a packaged name: not a path the output could replace
        source = Path(spec).expanduser().resolve()
        if source == resolved:
            raise InputError(f"output '{given}' is the input '{spec}'; write the output elsewhere")
        if resolved in source.parents:
            raise InputError(f"output '{given}' holds the input '{spec}'; write the output elsewhere")
    return resolved


def lock_path(out: str | os.PathLike) -> Path:
    """The lock file of an output: `.<name>.lock` beside it."""
    resolved = Path(out).expanduser().resolve()
    return resolved.parent / f".{resolved.name}.lock"


def _read_owner(path: Path) -> Optional[Owner]:
    try:
        return Owner.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _place(path: Path, payload: str) -> bool:
    """Create `path` holding `payload`, only if nothing is there; False when something is."""
    draft = path.with_name(f"{path.name}.new-{os.getpid()}-{time.monotonic_ns()}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, payload.encode())
    finally:
        os.close(fd)
    try:
        os.link(draft, path)  # fails if `path` exists: the whole content appears at once, or nothing
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        # A file system without hard links: exclusive creation, then the content.
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, payload.encode())
        finally:
            os.close(fd)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(draft)


def _remove_if(path: Path, owner: Owner) -> None:
    if _read_owner(path) == owner:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _break_stale(lock: Path, stale: Owner, me: Owner, payload: str) -> None:
    """Remove a lock whose owner is dead, under a second lock so two runs never both remove one."""
    breaker = lock.with_name(lock.name + ".break")
    if not _place(breaker, payload):
        holder = _read_owner(breaker)
        if holder is None or holder.alive() is False:  # a breaker killed in its few instructions
            with contextlib.suppress(FileNotFoundError):
                os.unlink(breaker)
        return
    try:
        if _read_owner(lock) == stale:  # nobody else can replace it while we hold the breaker
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
    finally:
        _remove_if(breaker, me)


def _busy(out: Path, lock: Path, holder: Optional[Owner]) -> OutputBusyError:
    if holder is None:
        return OutputBusyError(f"output '{out}' is being claimed by another run (lock '{lock}'); try again")
    where = f"pid {holder.pid} on {holder.host}"
    if holder.on_this_host():
        return OutputBusyError(f"output '{out}' is in use by another run ({where}); wait for it to finish "
                               "or write elsewhere")
    return OutputBusyError(f"output '{out}' is in use by a run on another node ({where}); if that run is "
                           f"gone, delete '{lock}'")


@contextlib.contextmanager
def output_lock(out: str | os.PathLike) -> Iterator[Path]:
    """Hold `out` for the duration of the block; another run on it gets `OutputBusyError`.

    Missing parent directories are created, and removed again if the run leaves them empty.
    """
    resolved = Path(out).expanduser().resolve()
    created = [p for p in (resolved.parent, *resolved.parent.parents) if not os.path.lexists(p)]
    resolved.parent.mkdir(parents=True, exist_ok=True)
    lock = lock_path(resolved)
    me = Owner.current()
    payload = json.dumps({**me.to_dict(), "argv": sys.argv[:32]})
    try:
        for _ in range(50):
            if _place(lock, payload):
                break
            holder = _read_owner(lock)
            if holder is None:
                # Only a lock from before hard links were used could be torn: judge it by age.
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - lock.stat().st_mtime > 60:
                        _break_stale(lock, holder, me, payload)  # type: ignore[arg-type]
                        continue
                time.sleep(0.05)
                continue
            if holder.alive() is not False:
                raise _busy(resolved, lock, holder)
            _break_stale(lock, holder, me, payload)
        else:
            raise _busy(resolved, lock, _read_owner(lock))
    except BaseException:
        _remove_empty(created)
        raise
    try:
        yield lock
    finally:
        _remove_if(lock, me)
        _remove_empty(created)


def _remove_empty(created: list[Path]) -> None:
    for directory in created:  # deepest first
        try:
            directory.rmdir()
        except OSError:
            break


@contextlib.contextmanager
def claim_output(out: str | os.PathLike, *, kind: OutputKind, inputs: Iterable[str | os.PathLike | None] = (),
                 lock: bool = True) -> Iterator[Path]:
    """`check_output`, then `output_lock` for the block (`lock=False`: check only, e.g. a non-main rank)."""
    inputs = list(inputs)
    resolved = check_output(out, kind=kind, inputs=inputs)
    if not lock:
        yield resolved
        return
    with output_lock(resolved):
        yield resolved
