"""Seeds derived from a run seed and a name, so that results do not depend on work order.

Every engine that needs a per-item seed (a block, a tensor, a model, a data shard) calls
`derive_seed`; hashing all parts together means two different items never share a seed
by arithmetic accident, and the same item gets the same seed in every process.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from the run `seed` and any number of names or indices."""
    text = "\x1f".join([str(int(seed))] + [str(p) for p in parts])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def seeded_generator(seed: int, *parts: object, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator seeded by `derive_seed(seed, *parts)`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_seed(seed, *parts))
    return generator
