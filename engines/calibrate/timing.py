"""Time prefill and decode steps of a causal LM on one device.

One measurement = a fresh KV cache, one prefill forward of `batch × seq` tokens, then
`decode_steps` single-token forwards. Each forward is bracketed by device synchronisation
(`torch.cuda.synchronize` on CUDA; CPU ops are synchronous) and a clock: the monotonic
wall clock, or, for single-threaded CPU runs, the calling thread's CPU time
(`time.thread_time`), which leaves out the time the OS gives to other processes, so a
shared machine still yields the cost of one dedicated core. The
first `warmup` measurements are discarded (allocator, kernel selection, caches); the
result is the median over `repeats` measurements, and for decode the median over all
steps of all repeats.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    prefill_ms: float
    decode_ms: float          # median single decode step
    decode_ctx: float         # mean context length of the timed decode steps
    weights_bytes: int
    kv_cache_bytes: int | None  # bytes held by the cache after the last step (None: the engine does not say)
    peak_bytes: int | None    # CUDA peak allocated during the measurement; None on CPU


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []) or []:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


@torch.inference_mode()
def time_model(model, batch: int, seq: int, *, decode_steps: int = 8, warmup: int = 1, repeats: int = 3,
               seed: int = 0, clock: str = "wall") -> Timing:
    """Median prefill and decode-step times (ms) of `model` at `batch × seq` prompt tokens.

    `clock` is "wall" (`time.perf_counter`) or "cpu" (`time.thread_time`; single-threaded CPU only).
    """
    from transformers.cache_utils import DynamicCache

    now = time.thread_time if clock == "cpu" else time.perf_counter
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=generator).to(device)
    prefill, decode = [], []
    cache = None
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for index in range(warmup + repeats):
        cache = DynamicCache(config=model.config)
        synchronize(device)
        start = now()
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        synchronize(device)
        elapsed = now() - start
        token = out.logits[:, -1:].argmax(-1)
        steps = []
        for _ in range(decode_steps):
            synchronize(device)
            t0 = now()
            out = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
            synchronize(device)
            steps.append(now() - t0)
            token = out.logits[:, -1:].argmax(-1)
        if index >= warmup:
            prefill.append(elapsed)
            decode.extend(steps)
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return Timing(prefill_ms=statistics.median(prefill) * 1e3,
                  decode_ms=statistics.median(decode) * 1e3 if decode else 0.0,
                  decode_ctx=seq + (decode_steps + 1) / 2.0,
                  weights_bytes=int(weights), kv_cache_bytes=_cache_bytes(cache), peak_bytes=peak)
