"""Output paths: checked up front, held by one run at a time, never replaced by a run that did not ask.

The race test starts two real `mlx export` processes on one output: exactly one wins, the output
is whole, and the loser gets one clear error line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mlxkit.engines.core.atomic import atomic_file, atomic_output_dir, user_path
from mlxkit.engines.core.outputs import check_output, lock_path, output_lock
from mlxkit.engines.core.owner import Owner, host_tag
from mlxkit.engines.errors import InputError, OutputBusyError


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _write_lock(out: Path, owner: dict) -> Path:
    lock = lock_path(out)
    lock.write_text(json.dumps(owner))
    return lock


def test_a_second_holder_is_refused_and_the_lock_goes_with_the_first(tmp_path):
    out = tmp_path / "out"
    with output_lock(out) as lock:
        assert Owner.from_dict(json.loads(lock.read_text())) == Owner.current()
        with pytest.raises(OutputBusyError, match="in use"):
            with output_lock(out):
                pass
        assert lock.exists()  # the refused run did not take it away
    assert not lock.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_dead_holder_on_this_host_is_taken_over(tmp_path):
    out = tmp_path / "out"
    _write_lock(out, {**Owner.current().to_dict(), "pid": _dead_pid()})
    with output_lock(out) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert list(tmp_path.iterdir()) == []


def test_a_reused_pid_does_not_keep_a_lock(tmp_path):
    """The pid runs, but it is a later process than the one that took the lock."""
    out = tmp_path / "out"
    me = Owner.current()
    if me.started is None:
        pytest.skip("no /proc: process start times cannot be read here")
    _write_lock(out, {**me.to_dict(), "started": me.started - 1})
    with output_lock(out):
        pass


def test_another_nodes_lock_is_never_removed(tmp_path):
    out = tmp_path / "out"
    lock = _write_lock(out, {"host": "node-elsewhere-7", "pid": _dead_pid(), "started": 1, "boot": "x"})
    with pytest.raises(OutputBusyError, match="another node") as refused:
        with output_lock(out):
            pass
    assert "node-elsewhere-7" in str(refused.value) and str(lock) in str(refused.value)
    assert lock.exists()


def test_missing_parents_are_created_and_removed_again_when_left_empty(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with output_lock(out):
        assert out.parent.is_dir()
    assert list(tmp_path.iterdir()) == []


def test_check_output_refuses_what_would_fail_late_or_destroy_an_input(tmp_path, monkeypatch):
    taken = tmp_path / "taken"
    taken.write_text("x")
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(InputError, match="not a directory"):
        check_output(taken / "x.gguf", kind="file")
    with pytest.raises(InputError, match="exists and is not a directory"):
        check_output(taken, kind="dir")
    with pytest.raises(InputError, match="is a directory"):
        check_output(model, kind="file")
    with pytest.raises(InputError, match="is the input"):
        check_output(model, kind="dir", inputs=[str(model)])
    with pytest.raises(InputError, match="holds the input"):
        check_output(tmp_path, kind="dir", inputs=[str(model)])
    assert check_output(model / "child", kind="dir", inputs=[str(model), "hub/id", None]) == model / "child"
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only directory (root ignores modes)
    with pytest.raises(InputError, match="not writable"):
        check_output(tmp_path / "new", kind="dir")


def test_the_final_rename_never_replaces_an_output_that_appeared_meanwhile(tmp_path):
    out = tmp_path / "child"
    with pytest.raises(InputError, match="appeared"):
        with atomic_output_dir(out) as tmp:
            (tmp / "config.json").write_text("mine")
            out.mkdir()
            (out / "config.json").write_text("theirs")
    assert (out / "config.json").read_text() == "theirs"
    target = tmp_path / "x.gguf"
    with pytest.raises(InputError, match="appeared"):
        with atomic_file(target, overwrite=False) as tmp:
            tmp.write_text("mine")
            target.write_text("theirs")
    assert target.read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child", "x.gguf"]


def test_every_file_of_an_output_directory_is_0644_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        with atomic_output_dir(tmp_path / "out") as tmp:
            (tmp / "model.safetensors").write_bytes(b"x")
            (tmp / "sub").mkdir()
            (tmp / "sub" / "a.json").write_text("{}")
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in out.rglob("*")} == {
        "model.safetensors": 0o644, "sub": 0o755, "sub/a.json": 0o644}


def test_another_nodes_temporary_is_left_alone(tmp_path):
    from mlxkit.engines.core.atomic import atomic_write_text

    dead = _dead_pid()
    ours = tmp_path / f".x.json.tmp-{dead}.{host_tag()}-abc.json"
    theirs = tmp_path / f".x.json.tmp-{dead}.{host_tag('node-elsewhere-7')}-def.json"
    for path in (ours, theirs):
        path.write_text("half")
    atomic_write_text(tmp_path / "x.json", "whole")
    assert not ours.exists() and theirs.exists()


def test_error_messages_name_the_users_path_not_the_temporary():
    assert user_path("/w/.x.gguf.tmp-15059.ab12cd34-k2j3.gguf") == "/w/x.gguf"
    assert user_path("/w/.child.tmp-1.ab12cd34-q9/model.safetensors") == "/w/child/model.safetensors"
    assert user_path("/w/plain/file") == "/w/plain/file"


def test_two_exports_started_together_on_one_output_one_wins_whole(two_models, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = [subprocess.Popen([sys.executable, "-m", "mlxkit", "export", str(model), "--format", "hf", "--out", "race",
                              "--quiet"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for model in two_models]
    results = [(run.wait(timeout=300), *run.communicate()) for run in runs]
    codes = [code for code, _, _ in results]
    assert sorted(code == 0 for code in codes) == [False, True], results
    winner = codes.index(0)
    _, _, loser_err = results[1 - winner]
    errors = [line for line in loser_err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in loser_err, loser_err
    assert "race" in errors[0] and ("in use" in errors[0] or "already exists" in errors[0]), errors[0]
    out = tmp_path / "race"
    weights = {}
    for shard in out.glob("*.safetensors"):
        weights.update(load_file(shard))
    source = {}
    for shard in two_models[winner].glob("*.safetensors"):
        source.update(load_file(shard))
    manifest = json.loads((out / "mlxkit.json").read_text())
    assert str(two_models[winner]) in json.dumps(manifest["inputs"])  # the winner's, whole
    for name, tensor in source.items():
        assert torch.equal(weights[name], tensor), name
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no lock, no temporary
