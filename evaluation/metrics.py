"""Ranking metrics and paired significance."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

KS = (1, 2, 5, 10, 50)


def gold_rank(scores: np.ndarray) -> int:
    """1-based rank of candidate 0 (the gold). Ties count against the gold, so a constant scorer gets
    rank N, not 1."""
    return 1 + int(np.sum(scores[1:] >= scores[0]))


def summarize(ranks: Sequence[float], ks: Sequence[int] = KS) -> dict[str, float]:
    """hits@k and MRR in percent. A rank of ``inf`` means the gold was not retrieved (counts 0)."""
    r = np.asarray(ranks, dtype=float)
    if r.size == 0:
        raise ValueError("no ranks to summarize")
    out = {f"hits@{k}": float(100 * np.mean(r <= k)) for k in ks}
    out["mrr"] = float(100 * np.mean(1.0 / r))
    out["n"] = int(r.size)
    return out


def per_case(ranks: Sequence[float], metric: str) -> np.ndarray:
    """Per-case values of ``hits@k`` or ``mrr`` (0/1 or reciprocal rank) for paired tests."""
    r = np.asarray(ranks, dtype=float)
    if metric == "mrr":
        return 1.0 / r
    return (r <= int(metric.split("@")[1])).astype(float)


def paired_bootstrap(a: np.ndarray, b: np.ndarray, samples: int = 10_000, seed: int = 0) -> float:
    """One-sided p-value that system ``a`` is not better than ``b`` on paired per-case values:
    the share of bootstrap resamples whose mean difference (a - b) is <= 0."""
    if a.shape != b.shape or a.size == 0:
        raise ValueError("paired_bootstrap needs two equal-length, non-empty arrays")
    diff = a - b
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, diff.size, size=(samples, diff.size))
    means = diff[idx].mean(axis=1)
    return float((np.sum(means <= 0) + 1) / (samples + 1))
