"""`content_hash` is sha256 over a file's bytes (or a directory's names and bytes), remembered in the cache
under the files' stat records: a second hash of unchanged files reads no bytes, and any write rehashes."""

from __future__ import annotations

import builtins
import hashlib
import os
import time

import pytest

from mlxkit.engines.core import manifest
from mlxkit.engines.core.manifest import content_hash
from mlxkit.engines.core.paths import cache_dir


def _reference(root) -> str:
    """The documented digest, computed here without mlxkit: sorted relative names then bytes, for a
    directory's files outside dot-folders and other than mlxkit.json."""
    digest = hashlib.sha256()
    if root.is_file():
        digest.update(root.read_bytes())
    else:
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = file.relative_to(root)
            if file.name == "mlxkit.json" or any(part.startswith(".") for part in rel.parts):
                continue
            digest.update(str(rel).encode())
            digest.update(file.read_bytes())
    return "sha256:" + digest.hexdigest()


@pytest.fixture
def memo_everything(monkeypatch):
    """Remember every digest, of files written a moment ago too."""
    monkeypatch.setattr(manifest, "MEMO_MIN_BYTES", 1)
    monkeypatch.setattr(manifest, "RACY_WINDOW_NS", 0)


def _memos():
    folder = cache_dir() / "content_hashes"
    return sorted(folder.glob("*.json")) if folder.exists() else []


def _refuse_reading(monkeypatch, path):
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if os.fspath(file) == os.fspath(path):
            raise AssertionError(f"{path} was read again")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)


def test_a_file_is_hashed_once_and_then_read_from_the_memo(tmp_path, memo_everything, monkeypatch):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(100_000))
    first = content_hash(weights)
    assert first == _reference(weights)
    assert len(_memos()) == 1
    _refuse_reading(monkeypatch, weights)
    assert content_hash(weights) == first


def test_a_directory_hash_matches_the_reference_and_skips_the_manifest_and_dot_folders(tmp_path, memo_everything):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / ".work").mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "sub" / "weights.bin").write_bytes(os.urandom(5000))
    (model / "mlxkit.json").write_text("{}")
    (model / ".work" / "state.pt").write_bytes(b"scratch")
    first = content_hash(model)
    assert first == _reference(model)
    (model / "mlxkit.json").write_text('{"changed": true}')
    (model / ".work" / "state.pt").write_bytes(b"other scratch")
    assert content_hash(model) == first
    (model / "config.json").write_text('{"a": 2}')
    assert content_hash(model) == _reference(model) != first


def test_rewriting_a_file_in_place_with_the_same_size_and_modification_time_rehashes(tmp_path, memo_everything):
    data = tmp_path / "corpus.txt"
    data.write_bytes(b"a" * 4096)
    before = data.stat()
    old = content_hash(data)
    time.sleep(0.05)  # past the file clock's tick, so the rewrite gets a new change time
    with open(data, "r+b") as handle:
        handle.write(b"b")
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))  # what a careless copy tool leaves behind
    assert data.stat().st_size == before.st_size and data.stat().st_mtime_ns == before.st_mtime_ns
    assert content_hash(data) == _reference(data) != old


def test_a_damaged_memo_is_ignored_and_replaced(tmp_path, memo_everything):
    data = tmp_path / "corpus.txt"
    data.write_bytes(os.urandom(3000))
    content_hash(data)
    [memo] = _memos()
    memo.write_text('{"hash": "sha256:not-a-digest"}')
    assert content_hash(data) == _reference(data)
    memo.write_text("{truncated")
    assert content_hash(data) == _reference(data)
    assert '"sha256:' in memo.read_text()


def test_small_inputs_leave_no_memo(tmp_path):
    data = tmp_path / "tiny.txt"
    data.write_text("short")
    assert content_hash(data) == _reference(data)
    assert _memos() == []


def test_a_file_written_a_moment_ago_is_hashed_but_not_remembered(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "MEMO_MIN_BYTES", 1)
    data = tmp_path / "corpus.txt"
    data.write_bytes(os.urandom(3000))
    assert content_hash(data) == _reference(data)
    assert _memos() == []
