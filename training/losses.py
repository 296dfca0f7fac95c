"""List-wise losses. Every candidate list has the positive at index 0."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def listwise_ce(scores: torch.Tensor, positive: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of the positive among its list (paper Eq. 2). scores [B, N]; positive [B] (default 0)."""
    if positive is None:
        positive = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    return F.cross_entropy(scores.float(), positive)


def kl_to_target(target_scores: torch.Tensor, student_scores: torch.Tensor, tau: float) -> torch.Tensor:
    """KL(T || S) with T = softmax(target/tau), S = softmax(student/tau), averaged over the batch.

    The target is detached: no gradient reaches the model that produced it (paper Eqs. 3-6, where each
    model treats the other's list distribution as a fixed target). scores [B, N]."""
    target = F.softmax(target_scores.detach().float() / tau, dim=-1)
    log_student = F.log_softmax(student_scores.float() / tau, dim=-1)
    return F.kl_div(log_student, target, reduction="batchmean")
