"""The restatement guard: an answer is a reply, not a rewording of what the user just said.

A retriever that starts as a sentence-similarity model ranks paraphrases of the last turn high ("what's
your favorite movie?" -> "What is your favorite movie?"), and training on replies makes it do so more
(docs/results.md §9.2). The echo filter drops only exact copies of context turns. The guard also drops a
candidate whose cosine with the context's last turn reaches a threshold, both texts embedded as
*responses* by the bundle's own retriever (so the guard costs one short encode per request and reads the
candidates' vectors back from the index). The threshold is calibrated on held-out (context, human reply)
pairs: the ``quantile`` of the same cosine between each last turn and the reply a person actually gave,
so with the default 0.995 the guard would drop one human reply in 200.

Calibration runs where a bundle is built and where ``coreply eval`` evaluates, from one function, so the
guard that serves is the guard that was measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

DEFAULT_QUANTILE = 0.995
"""Share of held-out human replies the guard lets through (their cosine with the last turn is below it)."""
MAX_PAIRS = 5000
"""Held-out pairs the threshold is calibrated on, at most."""
MARGIN = 5
"""Extra hits a guarded recall fetches, so that ``n`` usually survive the guard."""

EncodeResponses = Callable[[Sequence[str]], np.ndarray]
"""texts [N] -> response vectors [N, D] (the retriever's response tower)."""


def unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1: [N, D] -> [N, D]."""
    x = np.asarray(x, dtype="float32")
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def calibrate(encode_responses: EncodeResponses, pairs: Sequence[Any], quantile: float) -> dict[str, Any]:
    """The guard's manifest entry: the ``quantile`` of cos(last turn, human reply) over (at most
    :data:`MAX_PAIRS` of) ``pairs`` (objects with ``context`` and ``response``)."""
    if not 0.5 <= quantile < 1.0:
        raise ValueError(f"the restatement quantile must be in [0.5, 1), got {quantile}")
    pairs = list(pairs)[:MAX_PAIRS]
    if not pairs:
        raise ValueError("calibrating the restatement guard needs held-out pairs")
    last = unit(encode_responses([p.context[-1] for p in pairs]))  # [N, D]
    gold = unit(encode_responses([p.response for p in pairs]))  # [N, D]
    cosine = np.einsum("nd,nd->n", last, gold)  # [N]
    return {
        "threshold": round(float(np.quantile(cosine, quantile)), 4),
        "quantile": quantile,
        "calibrated_on": f"{len(pairs)} held-out pairs",
    }


def restating(
    encode_responses: EncodeResponses,
    vectors: Callable[[np.ndarray], np.ndarray],
    last_turns: Sequence[str],
    ids: Sequence[np.ndarray],
    threshold: float,
) -> list[np.ndarray]:
    """Per query, a boolean mask over its candidate ``ids`` [k_i]: True where the candidate restates the
    query's last turn (cosine >= ``threshold``). ``vectors(ids [n]) -> [n, D]`` reads pool vectors."""
    if not last_turns:
        return []
    last = unit(encode_responses(list(last_turns)))  # [B, D]
    flat = np.concatenate([np.asarray(i, dtype="int64") for i in ids])  # [sum k_i]
    if not len(flat):
        return [np.zeros(0, dtype=bool) for _ in ids]
    pool = unit(vectors(flat))  # [sum k_i, D]
    owner = np.repeat(np.arange(len(ids)), [len(i) for i in ids])  # [sum k_i]
    cosine = np.einsum("nd,nd->n", pool, last[owner])  # [sum k_i]
    return np.split(cosine >= threshold, np.cumsum([len(i) for i in ids])[:-1])
