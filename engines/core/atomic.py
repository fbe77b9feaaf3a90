"""Atomic writes: every output file and directory appears whole or not at all.

This is the only module that creates temporary siblings and renames them into place.
Temporary names are `.<name>.tmp-<pid>-<random>`, so a later run on the same output can find
what a killed run left behind and remove it (`remove_stale_temporaries`) while leaving alone
the temporaries of a process that is still writing, such as another rank of a torchrun job.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from mlxkit.engines.errors import InputError

TEMP_MARK = ".tmp-"


def _temp_prefix(path: Path) -> str:
    return f".{path.name}{TEMP_MARK}"


def _own_temp_prefix(path: Path) -> str:
    return f"{_temp_prefix(path)}{os.getpid()}-"


def _writer_alive(temporary: Path, prefix: str) -> bool:
    """Whether the process named in a temporary's name still runs (names without a pid are stale)."""
    pid = temporary.name[len(prefix):].split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


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
    `overwrite` is set, and only after the new one is complete.
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        trash = out.with_name(f"{_own_temp_prefix(out)}old")
        os.replace(out, trash)
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling path to write; it is renamed to `path` when the block succeeds.

    For writers that take a file name (safetensors' `save_file`, `torch.save`, `np.savez`).
    The temporary keeps `path`'s suffix, because some writers append one when it is missing.
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
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a binary file through a temporary sibling and an atomic rename."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a text file through a temporary sibling and an atomic rename."""
    with atomic_file(path) as tmp:
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
