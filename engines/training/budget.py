"""Memory a training run needs, estimated before any work, against what the machine and device hold; and the
peak a run reached, for its summary.

The estimate counts the weights, the trainable parameters' gradients and AdamW moments (float32),
and the activations of one micro-batch (the per-layer terms of Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models": about 34·s·h + 5·a·s² elements per sequence
and layer at 16 bits, doubled for float32), plus the logits and their gradient. It is a lower bound
of the peak, so a run it refuses could never have fitted; a run it accepts can still run out.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Optional

import torch

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import ResourceError
from mlxkit.engines.training.device import Placement

ADAMW_FLOAT32_COPIES = 3  # gradient, first and second moment


def _size(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def machine_memory_bytes() -> Optional[int]:
    """Physical memory of this machine, None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def peak_rss_mib() -> float:
    """This process's peak resident size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """Memory of `device`: the GPU's own, or the machine's for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return machine_memory_bytes()


def optimiser_bytes(trainable: int) -> int:
    return ADAMW_FLOAT32_COPIES * 4 * trainable


def activation_bytes(config, micro_batch: int, seq_len: int, element_bytes: int) -> int:
    """Activations of one micro-batch through a decoder (config: hidden size, layers, heads, vocabulary)."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    per_layer = micro_batch * seq_len * (34 * hidden + 5 * heads * seq_len) * element_bytes // 2
    logits = 3 * micro_batch * seq_len * vocab * 4  # float32 logits, their softmax and gradient
    return layers * per_layer + logits


def check_fits(need: int, device: torch.device, what: str,
               hint: str = "lower the batch, the sequence length or the model size") -> None:
    """Refuse `need` bytes on `device` (and, for a GPU, the host copy is not counted: only the device's)."""
    have = device_memory_bytes(device)
    if have is not None and need > have:
        where = "this machine" if device.type == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})"
        raise ResourceError(f"{what} needs at least {_size(need)}, but {where} has {_size(have)}; {hint}")


def check_training_fits(state: int, config, micro_batch: int, seq_len: int, placement: Placement, what: str, *,
                        shards: int = 1, extra_elements_per_token: int = 0) -> None:
    """Refuse a training run whose lower-bound memory exceeds its device's: `state` bytes (weights, gradients
    and optimiser moments, split over `shards` ranks when sharded), one micro-batch's activations through
    `config`'s decoder in the compute dtype, and `extra_elements_per_token` more elements per token of it."""
    element = torch.finfo(placement.dtype).bits // 8
    need = state // shards + activation_bytes(config, micro_batch, seq_len, element) + \
        micro_batch * seq_len * extra_elements_per_token * element
    check_fits(need, placement.device, what)


def check_data_vs_batch(sequences: int, batch: int, reporter: Reporter, flag: str = "--batch") -> None:
    """A notice when one batch would repeat the data many times over (a typo in the batch, usually)."""
    if sequences > 0 and batch >= 10 * sequences:
        reporter.notice(f"{flag} {batch} is {batch // sequences}x the {sequences} training sequence(s) the data "
                        "gives: every step repeats each sequence that often")
