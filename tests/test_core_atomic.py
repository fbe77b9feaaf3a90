"""The atomic writer: whole files or nothing, and what killed writers leave is removed by the next write."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxkit.engines.core.atomic import atomic_file, atomic_output_dir, atomic_write_text


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_write_removes_temporaries_of_dead_writers_and_keeps_live_ones(tmp_path):
    target = tmp_path / "block.safetensors"
    dead = tmp_path / f".block.safetensors.tmp-{_dead_pid()}-abc.safetensors"
    unnamed = tmp_path / ".block.safetensors.tmp-xyz.safetensors"  # the pre-pid naming: no writer to wait for
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".block.safetensors.tmp-{sleeper.pid}-def.safetensors"
        other = tmp_path / f".other.tmp-{_dead_pid()}-ghi"  # another output's temporary
        for path in (dead, unnamed, live, other):
            path.write_bytes(b"half")
        atomic_write_text(target, "whole")
        assert target.read_text() == "whole"
        assert not dead.exists() and not unnamed.exists()
        assert live.exists() and other.exists()
    finally:
        sleeper.kill()


def test_a_failed_write_leaves_neither_file_nor_temporary(tmp_path):
    target = tmp_path / "out.json"
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            tmp.write_text("partial")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_an_output_directory_clears_stale_temporaries_and_appears_whole(tmp_path):
    out = tmp_path / "child"
    stale = tmp_path / f".child.tmp-{_dead_pid()}-abc"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    with atomic_output_dir(out) as tmp:
        assert not out.exists()
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child"]
    assert (out / "config.json").read_text() == "{}"
