"""The `mlxkit.json` manifest written beside every artifact: how it was made."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxkit.engines.core.atomic import atomic_write_json, atomic_write_text

MANIFEST_NAME = "mlxkit.json"


# Inputs at least this large have their digest remembered in the cache (`content_hash`); smaller ones
# hash faster than the memo is read.
MEMO_MIN_BYTES = 16 << 20
# File times tick at the kernel's clock granularity (milliseconds), so a file written this recently could
# be written again, the same size, with the same times: its digest is not remembered (git's racy-clean rule).
RACY_WINDOW_NS = 2_000_000_000


def content_hash(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """sha256 of a file, or of a directory's files (names and bytes, sorted).

    Large weight files are hashed in full: the manifest promises the exact inputs. A digest is
    remembered in the cache under the stat records of the files it covers (size, modification and
    change times, inode, device), which any write to them changes, so the same unchanged parent or
    corpus is read once, not once per verb and run that records it. Files written in the last
    `RACY_WINDOW_NS` are hashed every time.
    """
    path = Path(path)
    files = [path] if path.is_file() else [p for p in sorted(path.rglob("*")) if p.is_file() and not (
        p.name == MANIFEST_NAME or any(part.startswith(".") for part in p.relative_to(path).parts))]
    stamp = _stat_stamp(path, files)
    memo = _memo_file(stamp) if sum(entry[1] for entry in stamp[1]) >= MEMO_MIN_BYTES else None
    if memo is not None and (remembered := _read_memo(memo)) is not None:
        return remembered
    digest = hashlib.sha256()
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode())
        with open(file, "rb") as handle:
            while block := handle.read(chunk):
                digest.update(block)
    value = "sha256:" + digest.hexdigest()
    if memo is not None and _settled(stamp) and _stat_stamp(path, files) == stamp:  # unchanged while read
        try:
            atomic_write_json(memo, {"hash": value})
        except OSError:
            pass  # a read-only cache only costs the next run a rehash
    return value


def _stat_stamp(root: Path, files: list[Path]) -> tuple[str, list[tuple]]:
    entries = []
    for file in files:
        st = file.stat()
        entries.append((str(file.relative_to(root)) if root.is_dir() else "", st.st_size, st.st_mtime_ns,
                        st.st_ctime_ns, st.st_ino, st.st_dev))
    return str(root.resolve()), entries


def _settled(stamp: tuple[str, list[tuple]]) -> bool:
    """Whether every file was last written or changed at least `RACY_WINDOW_NS` ago."""
    now = time.time_ns()
    return all(now - max(mtime, ctime) >= RACY_WINDOW_NS for _, _, mtime, ctime, _, _ in stamp[1])


def _memo_file(stamp: tuple[str, list[tuple]]) -> Path | None:
    from mlxkit.engines.core.paths import cache_dir
    from mlxkit.engines.errors import InputError

    try:
        root = cache_dir() / "content_hashes"
    except InputError:
        return None
    return root / (hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:32] + ".json")


def _read_memo(memo: Path) -> str | None:
    try:
        value = json.loads(memo.read_text()).get("hash")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value.startswith("sha256:") and len(value) == 71 else None


@dataclass
class Manifest:
    """Provenance of one output: tool version, command, inputs, seeds, timing, results."""

    verb: str
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    seeds: dict[str, int] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def add_input(self, role: str, spec: str, path: str | os.PathLike | None = None) -> None:
        """Record an input by its spec and, when it is on disk, its content hash."""
        entry: dict[str, Any] = {"spec": spec}
        if path is not None and Path(path).exists():
            entry["path"] = str(Path(path).resolve())
            entry["hash"] = content_hash(path)
        self.inputs[role] = entry

    def to_dict(self) -> dict[str, Any]:
        from mlxkit import __version__

        return {
            "tool": "mlxkit",
            "version": __version__,
            "verb": self.verb,
            "command": _command_line(),
            "inputs": self.inputs,
            "seeds": self.seeds,
            "settings": self.settings,
            "results": self.results,
            "started_unix": round(self.started, 3),
            "wall_time_s": round(time.time() - self.started, 3),
            "python": sys.version.split()[0],
            "platform": platform.platform(),
        }

    def write(self, directory: str | os.PathLike, *, card: bool = True) -> Path:
        """The manifest, and beside it (unless `card` is False) the model card generated from it when the
        directory holds a model."""
        from mlxkit.engines.core.model_card import write_model_card

        path = Path(directory) / MANIFEST_NAME
        data = json.loads(json.dumps(self.to_dict(), default=_jsonable))
        atomic_write_text(path, json.dumps(data, indent=2) + "\n")
        if card:
            write_model_card(Path(directory), data)
        return path


def _command_line() -> str:
    import shlex

    argv = list(sys.argv)
    if argv and argv[0].endswith(("/mlx", "\\mlx.exe")):
        argv[0] = "mlx"
    return " ".join(shlex.quote(a) for a in argv)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return str(value)
