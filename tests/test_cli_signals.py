"""SIGTERM and SIGINT during an atomic write: the temporaries go, one error line, exit 143 / 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

# Runs the real `mlx merge`, stalled right after it wrote the manifest into its temporary output
# directory (so the weights are there too), until the test sends the signal.
DRIVER = """
import sys, time
from pathlib import Path
from mlxkit.engines.core.manifest import Manifest

marker = Path(sys.argv[1])
write = Manifest.write

def stalled_write(self, directory):
    path = write(self, directory)
    marker.write_text(str(directory))
    time.sleep(120)
    return path

Manifest.write = stalled_write
from mlxkit.cli.main import main

sys.argv = ["mlx", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize("signum,exit_code,words", [(signal.SIGTERM, 143, "terminated"),
                                                     (signal.SIGINT, 130, "interrupted")])
def test_a_signal_mid_write_leaves_no_temporaries(two_models, tmp_path, signum, exit_code, words):
    out, marker = tmp_path / "merged", tmp_path / "marker"
    command = [sys.executable, "-c", DRIVER, str(marker), "merge", "--method", "linear", *map(str, two_models),
               "-o", str(out), "--quiet"]
    # A shell's background jobs (`nohup cmd &` in a script) inherit SIGINT ignored, and Python then installs
    # no KeyboardInterrupt handler; the merge gets the disposition an interactive user's process has.
    proc = subprocess.Popen(command, cwd=REPO, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the merge never reached its manifest"
            time.sleep(0.05)
        temporary = Path(marker.read_text())
        assert temporary.name.startswith(".merged.tmp-") and (temporary / "model.safetensors").exists()
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == exit_code, stderr
    assert stderr.strip().startswith("error:") and words in stderr and "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert not out.exists() and not temporary.exists()
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
