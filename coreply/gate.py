"""The rerank gate and reach: where the first stage is sure, a default request skips the reranker, and
where it reranks, it reads only the candidates the first stage has not ruled out.

A bundle's gate is a first-stage :func:`lead` chosen at build time
(``evaluation.protocols.choose_gate``): the smallest one past which answering in the first stage's order,
instead of reranked and fused, changes at most :data:`GATE_FIDELITY` of its calibration pairs' top
answers. Its reach (``evaluation.protocols.choose_reach``) is the smallest first-stage margin such that
reranking, where the gate lets the reranker run, only the candidates that trail the best by less than it
changes at most :data:`REACH_FIDELITY` more of those answers. Light on purpose (numpy only): the CLI
reads the defaults.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from coreply.ranking import Candidates

GATE_FIDELITY = 0.05
"""The share of calibration contexts whose top answer a bundle's gate may change (docs/results.md §42)."""
REACH_FIDELITY = 0.01
"""The share of calibration contexts whose top answer a bundle's reach may change beyond what its gate
changes (docs/results.md §55)."""


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


def reach(candidates: Candidates, margin: float | None, floor: int = 1) -> int:
    """How many of the candidates (in first-stage order) the reranker reads: those before the first one
    that trails the first by at least ``margin`` in the first stage's scores, at least ``floor`` (the
    answers a request asks for) and at most all of them; all of them with no margin."""
    scores = candidates.first_stage
    if margin is None:
        return len(scores)
    beyond = np.flatnonzero(scores[0] - scores >= margin) if len(scores) else []  # [<= n]
    within = int(beyond[0]) if len(beyond) else len(scores)
    return min(max(within, floor), len(scores))


def gated(
    candidates: Candidates, fusion: str, gate: float | None, margin: float | None = None, top_k: int = 1
) -> tuple[str, int]:
    """How a request that named no fusion is answered: (``retrieval``, 0: the reranker skipped) where the
    first stage is :func:`confident` past ``gate``, else (``fusion``, how many candidates it reranks:
    the :func:`reach` of ``margin``, at least ``top_k``)."""
    if fusion == "retrieval" or confident(candidates, gate):
        return "retrieval", 0
    return fusion, reach(candidates, margin, top_k)
