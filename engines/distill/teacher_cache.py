"""The teacher's top-k next-token log-probabilities, computed once per token block and kept on disk.

When several students are distilled on the same text, or one student sees its text more
than once, the teacher's forward is the same every time. With `loss.teacher_top_k: K` the
trainer asks this cache for each training sequence: a sequence met before is read from
disk, and only new ones run the teacher. The logit loss then compares the student with the
teacher's K likeliest tokens plus one bucket for the rest (`losses.top_k_kl`).

Entries are content-addressed: the file name is a digest of the sequence's token ids, so
any run with the same teacher, K, temperature and compute dtype reuses any sequence it
shares with an earlier run, whatever data file it came from. The directory's manifest
records those settings and the teacher's hash; each entry is written atomically.

One file per sequence suits the budgets of a CPU or a few GPUs (131,072 tokens at K = 64
is 256 files, 67 MB); billions of tokens would want the entries packed into shards.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mlxkit.engines.core.atomic import atomic_file, atomic_write_json
from mlxkit.engines.core.paths import cache_dir
from mlxkit.engines.models.heads import OutputHead

CACHE_FORMAT = 1
# Positions per teacher-head chunk: [512, 49152] float32 logits are 100 MB.
POSITION_CHUNK = 512


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


class TeacherLogitCache:
    """Top-k log-probabilities of one teacher at one temperature, for any token sequence."""

    def __init__(self, teacher_key: dict[str, Any], top_k: int, temperature: float, compute_dtype: str,
                 root: Path | None = None) -> None:
        settings = {"format": CACHE_FORMAT, "teacher": teacher_key, "top_k": top_k, "temperature": temperature,
                    "compute_dtype": compute_dtype}
        self.top_k, self.temperature = top_k, temperature
        self.path = (root or cache_dir() / "teacher_logits") / _digest(settings)
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = self.path / "manifest.json"
        if not manifest.exists():
            atomic_write_json(manifest, settings)
        self.hits = self.misses = 0

    def _entry(self, row: torch.Tensor) -> Path:
        digest = hashlib.sha256(row.to(device="cpu", dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]
        return self.path / f"{digest}.safetensors"

    @torch.no_grad()
    def top_k_for(self, teacher, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, T-1, K] float32 log-probabilities, [B, T-1, K] int64 token ids) of the teacher's likeliest next
        tokens at every position of `ids` [B, T] that has a next token, on the device of `ids`."""
        entries = [self._entry(row) for row in ids]
        missing = [i for i, entry in enumerate(entries) if not entry.exists()]
        self.misses += len(missing)
        self.hits += len(entries) - len(missing)
        computed = dict(zip(missing, self._compute(teacher, ids[missing]))) if missing else {}
        logps, indices = [], []
        for i, entry in enumerate(entries):
            if i in computed:
                logp, index = computed[i]
                with atomic_file(entry) as tmp:
                    save_file({"logp": logp.cpu().contiguous(), "index": index.to(torch.int32).cpu().contiguous()},
                              str(tmp))
            else:
                stored = load_file(str(entry))
                logp, index = stored["logp"], stored["index"]
            logps.append(logp.to(ids.device, torch.float32))
            indices.append(index.to(ids.device, torch.int64))
        return torch.stack(logps), torch.stack(indices)

    def _compute(self, teacher, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from mlxkit.engines.training.step import decoder_states

        hidden = decoder_states(teacher, ids)[1][:, :-1]
        head = OutputHead(teacher)
        rows = []
        for row in hidden:
            values, index = [], []
            for lo in range(0, row.shape[0], POSITION_CHUNK):
                logp = F.log_softmax(head(row[lo:lo + POSITION_CHUNK]).float() / self.temperature, dim=-1)
                top = logp.topk(self.top_k, dim=-1)
                values.append(top.values)
                index.append(top.indices)
            rows.append((torch.cat(values), torch.cat(index)))
        return rows
