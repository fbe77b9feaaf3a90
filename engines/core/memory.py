"""Process-wide allocator tuning for jobs that churn through large temporary tensors.

Two opposite needs, each for its own kind of job:

* `keep_freed_memory`: a job that frees and reallocates the same large blocks over and over (the direct
  solver) keeps them in the heap, so that it reuses warm pages;
* `release_freed_memory`: a job whose resident size is what limits it (training on a CPU) hands the free
  pages inside the heap back at the points where little is live.

The first: glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh `mmap`, and a
`free` hands the pages straight back to the kernel. A direct solver that builds and drops hundreds of
MiB per elimination level therefore pays a page fault and a kernel zero-fill for every page, every
level: at 1025^2 that was a third of SSI's factorisation time. Keeping freed memory in the heap makes
later levels reuse warm pages. Worker threads would otherwise get arenas of their own, which give large
blocks back to the kernel regardless, so all threads share the main arena (big blocks make its lock
cheap). The cost is that the process's resident size stays at its peak until it exits, which is why only
a command that owns its process (the CLI, a benchmark) should call `keep_freed_memory`, before it starts
threads.
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
_trim = None


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Ask glibc to serve large blocks from the heap and never trim it; returns whether it applied.

    A no-op (returning False) on other C libraries and platforms.
    """
    global _applied
    if _applied:
        return True
    try:
        mallopt = _libc().mallopt  # type: ignore[union-attr]
    except AttributeError:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # glibc returns 1 on success; musl and others lack mallopt or return 0
    _applied = all(mallopt(param, value) == 1 for param, value in
                   ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, 1)))
    return _applied


def release_freed_memory() -> bool:
    """Return the whole free pages inside glibc's heap to the kernel (`malloc_trim(0)`); whether it could.

    glibc serves blocks below its mmap threshold, which it raises up to 32 MiB as mapped blocks are freed,
    from the heap, and frees them back into the heap, not to the kernel. A training step's activations and
    gradients come and go in blocks of that size, interleaved with blocks that stay (optimiser moments), so
    the freed space stays resident and the next step's allocations land elsewhere: in a CPU GKD run the
    resident size grew by 300 to 500 MiB per micro-batch that way. Called between micro-batches, when only
    the weights, the moments and the gradients are live, it costs one pass over the free lists and the
    page faults of the memory reused later. A no-op (returning False) where there is no glibc.
    """
    global _trim
    if _trim is None:
        trim = getattr(_libc(), "malloc_trim", None)
        if trim is not None:
            trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
        _trim = trim or False
    if not _trim:
        return False
    _trim(0)
    return True
