"""Process-wide allocator tuning for jobs that churn through large temporary tensors.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh `mmap`, and a
`free` hands the pages straight back to the kernel. A direct solver that builds and drops hundreds of
MiB per elimination level therefore pays a page fault and a kernel zero-fill for every page, every
level: at 1025^2 that was a third of SSI's factorisation time. Keeping freed memory in the heap makes
later levels reuse warm pages. Worker threads would otherwise get arenas of their own, which give large
blocks back to the kernel regardless, so all threads share the main arena (big blocks make its lock
cheap). The cost is that the process's resident size stays at its peak until it exits, which is why only
a command that owns its process (the CLI, a benchmark) should call this, before it starts threads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameter numbers from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_applied = False


def keep_freed_memory() -> bool:
    """Ask glibc to serve large blocks from the heap and never trim it; returns whether it applied.

    A no-op (returning False) on other C libraries and platforms.
    """
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # glibc returns 1 on success; musl and others lack mallopt or return 0
    _applied = all(mallopt(param, value) == 1 for param, value in
                   ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, 1)))
    return _applied
