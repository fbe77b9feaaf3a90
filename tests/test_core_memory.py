"""keep_freed_memory: freed large blocks stay in the process instead of going back to the kernel."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_PROBE = """
import importlib.util, os, sys
# load the module alone: importing the mlxkit package would pull in transformers (seconds per process)
spec = importlib.util.spec_from_file_location("memory", sys.argv[2])
memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)
keep_freed_memory = memory.keep_freed_memory
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
t = b"\\x01" * (64 * 2**20)  # 64 MiB, written, above glibc's largest mmap threshold
before_free = rss()
del t
print(applied, keep_freed_memory() if applied else False, (before_free - rss()) / 2**20)
"""


def _run(mode: str) -> tuple[bool, bool, float]:
    from mlxkit.engines.core import memory

    out = subprocess.run([sys.executable, "-c", _PROBE, mode, memory.__file__], capture_output=True, text=True,
                         check=True)
    applied, again, released = out.stdout.split()
    return applied == "True", again == "True", float(released)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_blocks_stay_mapped_only_when_asked():
    applied, again, released_kept = _run("keep")
    assert applied and again  # idempotent
    assert released_kept < 8  # the 64 MiB stayed in the heap
    _, _, released_default = _run("default")
    assert released_default > 56  # glibc's default hands a block this large straight back


_TRIM_PROBE = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("memory", sys.argv[2])
memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
# 600 blocks of 100 KiB (below glibc's initial mmap threshold, so in the heap), every other one freed:
# 30 MiB of holes that the live blocks between them keep from coalescing or reaching the heap's top.
blocks = [bytearray(b"\\x01" * (100 * 1024)) for _ in range(600)]
del blocks[::2]
before = rss()
applied = memory.release_freed_memory() if sys.argv[1] == "release" else False
print(applied, (before - rss()) / 2**20)
"""


def _run_trim(mode: str) -> tuple[bool, float]:
    from mlxkit.engines.core import memory

    out = subprocess.run([sys.executable, "-c", _TRIM_PROBE, mode, memory.__file__], capture_output=True, text=True,
                         check=True)
    applied, released = out.stdout.split()
    return applied == "True", float(released)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_pages_inside_the_heap_go_back_only_when_released():
    applied, released = _run_trim("release")
    assert applied
    assert released > 20  # most of the 30 MiB of holes left the resident set
    _, kept = _run_trim("keep")
    assert kept < 4  # without the call the holes stay resident
