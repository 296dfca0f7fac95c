"""The rerank gate: where the first stage is sure, a default request skips the reranker.

A bundle's gate is a first-stage :func:`lead` chosen at build time
(``evaluation.protocols.choose_gate``): the smallest one past which answering in the first stage's order,
instead of reranked and fused, changes at most :data:`GATE_FIDELITY` of its calibration pairs' top
answers. Light on purpose (numpy only): the CLI reads the default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from coreply.ranking import Candidates

GATE_FIDELITY = 0.05
"""The share of calibration contexts whose top answer a bundle's gate may change (docs/results.md §42)."""


def lead(candidates: Candidates) -> float:
    """How far the first stage's best candidate leads its second: the difference of their scores, in the
    scores it orders by (with a lexical stage the hybrid ones); inf with fewer than two, where no
    reranker can change the answer."""
    scores = candidates.first_stage
    if len(scores) < 2:
        return float("inf")
    second, best = np.partition(scores, len(scores) - 2)[-2:]
    return float(best - second)


def confident(candidates: Candidates, gate: float | None) -> bool:
    """Whether the first stage's :func:`lead` reaches ``gate`` (None: no gate, never confident)."""
    return gate is not None and lead(candidates) >= gate


def gated_fusion(candidates: Candidates, fusion: str, gate: float | None) -> str:
    """The fusion a request that named none is answered with: ``retrieval`` (the reranker skipped) where
    the first stage is :func:`confident` past ``gate``, else ``fusion``."""
    return "retrieval" if confident(candidates, gate) else fusion
