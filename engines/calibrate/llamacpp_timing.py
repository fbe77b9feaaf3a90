"""Time prefill and decode steps of a GGUF file in llama.cpp (llama-cpp-python), like `timing.time_model`.

One measurement = an empty context (`Llama.reset`), one `eval` of the whole prompt as a
single batch, then `decode_steps` single-token `eval`s, each bracketed by the wall clock
(llama.cpp runs its own thread pool, so thread CPU time would miss most of the work). The
first `warmup` measurements are discarded; the result is the median over `repeats`
measurements, and for decode the median over all steps of all repeats. The prompt and the
decode tokens are fixed random ids (timing does not depend on them).

llama-cpp-python's high-level API holds one sequence per context, so only batch 1 is timed.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from mlxkit.engines.calibrate.timing import Timing
from mlxkit.engines.errors import BackendError


def require_llama_cpp() -> str:
    """The llama-cpp-python version; a `BackendError` naming the install when it is missing."""
    try:
        import llama_cpp
    except ImportError:
        raise BackendError("--engine llamacpp needs llama-cpp-python: pip install 'mlxkit[llamacpp]' "
                           "(a source build of llama.cpp, several CPU-minutes)") from None
    return str(getattr(llama_cpp, "__version__", "unknown"))


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """llama.cpp logs from C to file descriptor 2 even with verbose=False; keep it off the user's terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def time_gguf(path: str | os.PathLike, seq: int, *, decode_steps: int = 8, warmup: int = 1, repeats: int = 3,
              threads: int, seed: int = 0) -> Timing:
    """Median prefill and decode-step times (ms) of the GGUF at `path` for a `seq`-token prompt, batch 1."""
    import llama_cpp

    with native_stderr_silenced():
        llm = llama_cpp.Llama(str(path), n_ctx=seq + decode_steps + 8, n_batch=seq, n_ubatch=seq,
                              n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
    try:
        rng = np.random.default_rng(seed)
        vocab = llm.n_vocab()
        prompt = rng.integers(3, vocab, size=seq).tolist()
        tokens = rng.integers(3, vocab, size=decode_steps).tolist()
        prefill, decode = [], []
        for index in range(warmup + repeats):
            llm.reset()  # the next eval starts from position 0: an empty context
            start = time.perf_counter()
            llm.eval(prompt)
            elapsed = time.perf_counter() - start
            steps = []
            for token in tokens:
                t0 = time.perf_counter()
                llm.eval([token])
                steps.append(time.perf_counter() - t0)
            if index >= warmup:
                prefill.append(elapsed)
                decode.extend(steps)
    finally:
        with native_stderr_silenced():
            llm.close()
    return Timing(prefill_ms=statistics.median(prefill) * 1e3,
                  decode_ms=statistics.median(decode) * 1e3 if decode else 0.0,
                  decode_ctx=seq + (decode_steps + 1) / 2.0,
                  weights_bytes=Path(path).stat().st_size, kv_cache_bytes=None, peak_bytes=None)
