"""Atomic writes: every output file and directory appears whole or not at all.

This is the only module that creates temporary siblings and renames them into place.
Temporary names are `.<name>.tmp-<pid>.<host tag>-<random>`, so a later run on the same output
can find what a killed run left behind and remove it (`remove_stale_temporaries`) while leaving
alone the temporaries of a process that is still writing, such as another rank of a torchrun job.
A pid is only meaningful on its own node: a temporary whose host tag is another node's is never
judged here (on a shared file system that node may still be writing it).

Without `overwrite`, the final rename never replaces an output that appeared while the run
worked: a directory is renamed (which fails onto a non-empty one) and a file is hard-linked
into place (which fails onto any), after a last check.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from mlxkit.engines.core.owner import host_tag, pid_alive
from mlxkit.engines.errors import InputError

TEMP_MARK = ".tmp-"


def _temp_prefix(path: Path) -> str:
    return f".{path.name}{TEMP_MARK}"


def published_name(path: Path) -> str:
    """The name a staging directory or file will have once published (its own name otherwise)."""
    name = path.name
    if name.startswith(".") and TEMP_MARK in name:
        return name[1:].split(TEMP_MARK, 1)[0]
    return name


def _own_temp_prefix(path: Path) -> str:
    return f"{_temp_prefix(path)}{os.getpid()}.{host_tag()}-"


def _writer_alive(temporary: Path, prefix: str) -> bool:
    """Whether the writer named in a temporary's name may still run (names without a pid are stale).

    A name tagged with another host is another node's, and counts as alive: only its own node can tell.
    """
    pid, _, tag = temporary.name[len(prefix):].split("-", 1)[0].partition(".")
    if not pid.isdigit():
        return False
    if tag and tag != host_tag():
        return True
    return pid_alive(int(pid))


def user_path(path: str | os.PathLike) -> str:
    """The path a user asked for, for a path inside one of our temporaries (for error messages)."""
    parts = []
    for part in Path(path).parts:
        mark = part.rfind(TEMP_MARK)
        parts.append(part[1:mark] if part.startswith(".") and mark > 1 else part)
    return str(Path(*parts)) if parts else str(path)


def _appeared(out: Path) -> InputError:
    return InputError(f"output '{out}' appeared while this run worked (another run wrote it); "
                      "pass --overwrite to replace it")


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Delete temporaries of `path` left by killed runs (same parent, `.<name>.tmp-*`, writer gone)."""
    path = Path(path)
    removed = []
    if path.parent.is_dir():
        prefix = _temp_prefix(path)
        for stale in path.parent.glob(glob.escape(prefix) + "*"):
            if _writer_alive(stale, prefix):
                continue
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
            removed.append(stale)
    return removed


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling directory that is renamed to `out` on success.

    On any exception the temporary directory is removed, so a failed or interrupted run
    never leaves a partial checkpoint behind. An existing `out` is replaced only when
    `overwrite` is set, and only after the new one is complete; without it, an `out` that
    appeared meanwhile is an error and stays as it is.
    """
    out = Path(out).expanduser().resolve()
    if out.exists() and not overwrite:
        raise InputError(f"output '{out}' already exists (pass --overwrite to replace it)")
    if out.exists() and not out.is_dir():
        raise InputError(f"output '{out}' exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)
    tmp = Path(tempfile.mkdtemp(prefix=_own_temp_prefix(out), dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the output is an ordinary directory
    try:
        yield tmp
        _ordinary_modes(tmp)
        if not overwrite:
            if os.path.lexists(out):
                raise _appeared(out)
            try:
                os.rename(tmp, out)  # onto a directory that is not empty this fails, never replaces
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                    raise _appeared(out) from None
                raise
        elif out.exists():
            trash = out.with_name(f"{_own_temp_prefix(out)}old")
            os.replace(out, trash)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _ordinary_modes(directory: Path) -> None:
    """Files 0644 and directories 0755, whichever writer made them (safetensors, peft and
    tokenizers create files with the umask, which can make them private)."""
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o644)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling path to write; it is renamed to `path` when the block succeeds.

    For writers that take a file name (safetensors' `save_file`, `torch.save`, `np.savez`).
    The temporary keeps `path`'s suffix, because some writers append one when it is missing.
    Every file comes out mode 0644, whatever the writer or the umask made it. With
    `overwrite=False` (a user's output without `--overwrite`) an existing `path` is never replaced.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp_name = tempfile.mkstemp(prefix=_own_temp_prefix(path), suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the output is an ordinary file
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_into_place(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _link_into_place(tmp: Path, path: Path) -> None:
    if os.path.lexists(path):
        raise _appeared(path)
    try:
        os.link(tmp, path)  # refuses an existing `path`, atomically
    except FileExistsError:
        raise _appeared(path) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        os.replace(tmp, path)  # no hard links here: the check above is the last word
        return
    os.unlink(tmp)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a binary file through a temporary sibling and an atomic rename."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str, overwrite: bool = True) -> None:
    """Write a text file through a temporary sibling and an atomic rename (see `atomic_file` for `overwrite`)."""
    with atomic_file(path, overwrite=overwrite) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: str | os.PathLike, data: Any, indent: int | None = 1) -> None:
    """Write strict JSON (NaN and infinity are refused, not written as non-standard tokens)."""
    atomic_write_text(path, json.dumps(data, indent=indent, allow_nan=False, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
