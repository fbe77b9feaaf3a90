"""Atomic writes: outputs appear whole or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from mlxkit.engines.errors import InputError


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
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the output is an ordinary directory
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        trash = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, trash)
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a text file through a temporary sibling and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
