"""Score fusion and candidate filtering shared by evaluation and the service, so both rank alike."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import numpy as np

from coreply.text import normalize

FUSIONS = ("retrieval", "rerank", "sum", "zscore")


def zscore(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / (x.std() + 1e-6)


def fuse(mode: str, retrieval: np.ndarray, rerank: np.ndarray, weight: float = 0.5) -> np.ndarray:
    """Final scores of one query's candidates. ``sum`` is the precursor paper's Eq. 10; ``zscore`` is
    ``weight * z(retrieval) + (1 - weight) * z(rerank)`` with per-query standardisation."""
    if mode == "retrieval":
        return retrieval
    if mode == "rerank":
        return rerank
    if mode == "sum":
        return retrieval + rerank
    if mode == "zscore":
        return weight * zscore(retrieval) + (1 - weight) * zscore(rerank)
    raise ValueError(f"unknown fusion {mode!r}; expected one of {FUSIONS}")


def drop_blocked(
    ids: np.ndarray,
    scores: np.ndarray,
    pool_keys: Sequence[str],
    blocked_texts: Iterable[str],
    blocked_ids: Collection[int] = (),
) -> tuple[np.ndarray, np.ndarray]:
    """Remove FAISS padding (-1), the ids in ``blocked_ids`` and pool entries whose normalised text is in
    ``blocked_texts``."""
    blocked = {normalize(t) for t in blocked_texts}
    keep = [
        j for j, i in enumerate(ids) if i >= 0 and int(i) not in blocked_ids and pool_keys[i] not in blocked
    ]
    return ids[keep], scores[keep]


def drop_echoes(context: Sequence[str], ids: np.ndarray, scores: np.ndarray, pool_keys: Sequence[str]):
    """Remove pool entries whose normalised text equals an utterance of the context."""
    return drop_blocked(ids, scores, pool_keys, context)
