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


# Final hidden states -> logits, as the model's forward computes them (`models.heads.OutputHead`).
Head = Callable[[torch.Tensor], torch.Tensor]

# Bytes of one [positions, vocabulary] float32 tensor of a chunk. Above glibc's largest mmap threshold
# (32 MiB) each such tensor is mapped and unmapped whole, so none is left behind fragmenting the heap;
# at SmolLM2's 49,152 words this is 256 positions, which took 210 MiB off a CPU GKD run's peak against
# 512 positions (BENCHMARKS.md, "GKD's peak memory").
CHUNK_BYTES = 48 * 2**20
MIN_CHUNK = 16


def logit_chunk(vocab_size: int) -> int:
    """Positions per chunk for a vocabulary of `vocab_size`: `CHUNK_BYTES` of float32 logits."""
    return max(MIN_CHUNK, CHUNK_BYTES // (4 * vocab_size))


def _head_vocabulary(head: Head) -> int:
    """The vocabulary of an `OutputHead` or of a bare projection module."""
    size = getattr(head, "vocab_size", None)
    return int(size) if size is not None else int(head.weight.shape[0])  # type: ignore[attr-defined]


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


class _KLFromLogits(torch.autograd.Function):
    """T² · Σ_rows KL(teacher_T || softmax(logits / T)), given the teacher's log-probabilities at T.

    Autograd through `kl_from_log_probs` and `log_softmax` keeps the difference, the teacher's
    probabilities and the log-probabilities for the backward, and allocates a fresh vocabulary-wide
    tensor for each of its gradients. This keeps two tensors and computes the gradient, T·(q − p) with
    q the student's probabilities at T, in place in the first. The value is the same bit for bit; the
    gradient differs from autograd's by float32 rounding (autograd's carries a factor Σ p, 1 to within
    rounding). The saved tensors are overwritten, so the graph can be differentiated once.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, teacher_logp: torch.Tensor, temperature: float) -> torch.Tensor:
        logp = F.log_softmax(_softened(logits, temperature), dim=-1)
        probs = teacher_logp.exp()
        # The terms of `kl_from_log_probs`, in the same order of operations.
        kl = torch.sub(teacher_logp, logp).mul_(probs).sum(-1).sum() * temperature ** 2
        ctx.save_for_backward(logp, probs)
        ctx.temperature = temperature
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logp, probs = ctx.saved_tensors
        return logp.exp_().sub_(probs).mul_(grad * ctx.temperature), None, None


def _chunk_sums(student_h: torch.Tensor, teacher_h: torch.Tensor, targets: torch.Tensor,
                student_head: Head, teacher_head: Head, temperature: float,
                with_kl: bool, with_nll: bool) -> tuple[torch.Tensor, torch.Tensor]:
    teacher_logp = None
    if with_kl:  # first, so that the teacher's logits are freed before the student's are made
        with torch.no_grad():
            teacher_logp = F.log_softmax(_softened(teacher_head(teacher_h).float(), temperature), dim=-1)
    logits = student_head(student_h).float()
    kl = nll = logits.new_zeros((), dtype=torch.float32)
    if teacher_logp is not None:
        kl = _KLFromLogits.apply(logits, teacher_logp, temperature)
    if with_nll:
        nll = F.cross_entropy(logits, targets, reduction="sum")
    return kl, nll


def logit_term_sums(student_final: torch.Tensor, teacher_final: torch.Tensor, input_ids: torch.Tensor,
                    student_head: Head, teacher_head: Head, *, temperature: float = 1.0,
                    with_kl: bool = True, with_nll: bool = False, chunk: int | None = None) -> LogitTermSums:
    """KL and NLL sums over the positions that predict a next token (all but the last of each sequence).

    `student_final` / `teacher_final` are the final normalised hidden states [B, T, H]; the heads
    map them to logits. The teacher side runs without gradients. `chunk` positions go through the
    heads at a time (default: `logit_chunk` of the vocabulary).
    """
    chunk = chunk or logit_chunk(_head_vocabulary(student_head))
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
                           with_nll: bool = False, chunk: int | None = None) -> LogitTermSums:
    """`logit_term_sums` against a teacher's cached top-k log-probabilities ([B, T-1, K], at `temperature`)
    instead of its hidden states: the KL term is `top_k_kl`, T²-scaled."""
    chunk = chunk or logit_chunk(_head_vocabulary(student_head))
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
