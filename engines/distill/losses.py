"""Distillation losses, returned as sums over positions so the caller normalises once.

Gradient accumulation and data parallelism split a global batch into pieces; each piece's
loss is its sum over positions divided by the global batch's position count, so the
accumulated (and all-reduced) gradient equals the gradient of the global mean.

The logit terms never hold a whole batch's [positions, vocab] logits: positions are taken
in chunks, and each chunk's loss runs under activation checkpointing, so the chunk's
teacher and student logits are freed after its forward and recomputed in the backward.

Every loss is accumulated in float32, whatever the dtype the hidden states arrive in (the
forward may run under bfloat16 autocast), on the device of the hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mlxkit.engines.eval.metrics import kl_from_log_probs

# Final hidden states -> logits, as the model's forward computes them (`models.heads.OutputHead`).
Head = Callable[[torch.Tensor], torch.Tensor]

LOGIT_CHUNK = 512  # positions per chunk: [512, 49152] float32 is 100 MB per tensor


def cosine_distance_sum(student_hidden: Sequence[torch.Tensor], teacher_hidden: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ over layers and positions of 1 − cos(h_student, h_teacher); tensors [B, T, H], one pair per layer."""
    total = student_hidden[0].new_zeros((), dtype=torch.float32)
    for h_s, h_t in zip(student_hidden, teacher_hidden, strict=True):
        total = total + (1.0 - F.cosine_similarity(h_s.float(), h_t.float(), dim=-1)).sum()
    return total


@dataclass
class LogitTermSums:
    kl: torch.Tensor   # Σ_positions T² · KL(teacher_T || student_T)
    nll: torch.Tensor  # Σ_positions −log p_student(next token)


def _softened(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / temperature`, without the copy at temperature 1 (dividing by 1 changes no value, and a
    [chunk, vocabulary] copy and its gradient cost two passes over fresh memory)."""
    return logits if temperature == 1.0 else logits / temperature


def _chunk_sums(student_h: torch.Tensor, teacher_h: torch.Tensor, targets: torch.Tensor,
                student_head: Head, teacher_head: Head, temperature: float,
                with_kl: bool, with_nll: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = student_head(student_h).float()
    kl = nll = logits.new_zeros((), dtype=torch.float32)
    if with_kl:
        with torch.no_grad():
            teacher_logp = F.log_softmax(_softened(teacher_head(teacher_h).float(), temperature), dim=-1)
        kl = kl_from_log_probs(teacher_logp, F.log_softmax(_softened(logits, temperature), dim=-1)).sum() * \
            temperature ** 2
    if with_nll:
        nll = F.cross_entropy(logits, targets, reduction="sum")
    return kl, nll


def logit_term_sums(student_final: torch.Tensor, teacher_final: torch.Tensor, input_ids: torch.Tensor,
                    student_head: Head, teacher_head: Head, *, temperature: float = 1.0,
                    with_kl: bool = True, with_nll: bool = False, chunk: int = LOGIT_CHUNK) -> LogitTermSums:
    """KL and NLL sums over the positions that predict a next token (all but the last of each sequence).

    `student_final` / `teacher_final` are the final normalised hidden states [B, T, H]; the heads
    map them to logits. The teacher side runs without gradients.
    """
    hidden = student_final.shape[-1]
    s = student_final[:, :-1].reshape(-1, hidden)
    t = teacher_final[:, :-1].reshape(-1, teacher_final.shape[-1]).detach()
    targets = input_ids[:, 1:].reshape(-1).to(s.device)
    kl_total = nll_total = s.new_zeros((), dtype=torch.float32)
    for lo in range(0, s.shape[0], chunk):
        hi = lo + chunk
        kl, nll = checkpoint(_chunk_sums, s[lo:hi], t[lo:hi], targets[lo:hi], student_head, teacher_head,
                             temperature, with_kl, with_nll, use_reentrant=False)
        kl_total, nll_total = kl_total + kl, nll_total + nll
    return LogitTermSums(kl_total, nll_total)


def top_k_kl(teacher_top_logp: torch.Tensor, teacher_top_index: torch.Tensor,
             student_logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k tokens plus one bucket for the rest of the vocabulary.

    `teacher_top_logp` [N, k] are the teacher's log-probabilities of its k likeliest tokens
    (`teacher_top_index` [N, k]); `student_logp` [N, V] the student's full log-probabilities.
    Merging the other tokens into one outcome gives the KL of the coarsened distributions,
    which by the data-processing inequality never exceeds the full KL, and equals it when
    the student's distribution over the merged tokens is proportional to the teacher's.
    Returns the KL at each row [N], in float32.
    """
    p_log = teacher_top_logp.float()
    q_log = student_logp.gather(-1, teacher_top_index.long())
    head = (p_log.exp() * (p_log - q_log)).sum(-1)
    # The merged outcome: log(1 − Σ p) computed from the log-probabilities, clamped where rounding
    # makes the top-k mass reach 1 (then the bucket carries no probability and adds nothing).
    p_rest = torch.logsumexp(p_log, -1).clamp(max=0.0)
    q_rest = torch.logsumexp(q_log, -1).clamp(max=-1e-7)
    log_p_tail = torch.log((-torch.expm1(p_rest)).clamp(min=0.0))
    log_q_tail = torch.log(-torch.expm1(q_rest))
    tail = torch.where(torch.isfinite(log_p_tail), log_p_tail.exp() * (log_p_tail - log_q_tail),
                       torch.zeros_like(head))
    return head + tail


def _cached_chunk_sums(student_h: torch.Tensor, top_logp: torch.Tensor, top_index: torch.Tensor,
                       targets: torch.Tensor, student_head: Head, temperature: float,
                       with_nll: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = student_head(student_h).float()
    kl = top_k_kl(top_logp, top_index, F.log_softmax(_softened(logits, temperature), dim=-1)).sum() * temperature ** 2
    nll = F.cross_entropy(logits, targets, reduction="sum") if with_nll else logits.new_zeros((), dtype=torch.float32)
    return kl, nll


def cached_logit_term_sums(student_final: torch.Tensor, top_logp: torch.Tensor, top_index: torch.Tensor,
                           input_ids: torch.Tensor, student_head: Head, *, temperature: float = 1.0,
                           with_nll: bool = False, chunk: int = LOGIT_CHUNK) -> LogitTermSums:
    """`logit_term_sums` against a teacher's cached top-k log-probabilities ([B, T-1, K], at `temperature`)
    instead of its hidden states: the KL term is `top_k_kl`, T²-scaled."""
    hidden = student_final.shape[-1]
    s = student_final[:, :-1].reshape(-1, hidden)
    k = top_logp.shape[-1]
    logp, index = top_logp.reshape(-1, k).to(s.device), top_index.reshape(-1, k).to(s.device)
    targets = input_ids[:, 1:].reshape(-1).to(s.device)
    kl_total = nll_total = s.new_zeros((), dtype=torch.float32)
    for lo in range(0, s.shape[0], chunk):
        hi = lo + chunk
        kl, nll = checkpoint(_cached_chunk_sums, s[lo:hi], logp[lo:hi], index[lo:hi], targets[lo:hi], student_head,
                             temperature, with_nll, use_reentrant=False)
        kl_total, nll_total = kl_total + kl, nll_total + nll
    return LogitTermSums(kl_total, nll_total)
