"""The response prior: a retrieval score correction for responses that sit close to every context.

A dense retriever's nearest neighbours are not symmetric: some responses lie close to a large share of
contexts ("hubs": long replies that touch many topics, generic answers) and win top places for contexts
they do not answer, while specific replies lose to them. The cross-domain similarity local scaling of
Conneau et al. (2018, "Word translation without parallel data") corrects this by the neighbourhood
density of each side; only the response side changes a context's ranking, so the retrieval score
becomes ``q . r - alpha * rho(r)``, where ``rho(r)`` is the mean of the ``k`` highest scores of ``r``
against a reference set of contexts (docs/results.md section 20 measures it).

``rho`` must not see a response's own dialogue: a response scores high against the contexts of the
conversation it comes from, so a reference sample drawn from the training split would penalise the
training conversations' responses and spare the held-out ones, which an evaluation on held-out pairs
would read as a gain. Each response's own conversations are masked out of its neighbourhood.

The bundle stores ``rho`` (``prior.npy``, one value per response) and ``alpha``, chosen by hits@1 on
held-out pairs where the bundle is built; the retriever searches :data:`DEPTH` hits, rescores them and
keeps the best (exact for the top 10 of the default bundle: section 20).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coreply.corpus import Pair
from coreply.text import normalize

K = 50
"""Reference contexts whose scores make a response's neighbourhood."""
REFERENCE = 20_000
"""Reference contexts sampled (seeded) from the pairs given, at most."""
DEPTH = 100
"""Hits a retriever with a prior searches before rescoring, at least."""
HELD_OUT = 10_000
"""Held-out pairs the weight is chosen on, at most (all 6,623 of the built-in validation split: 2,000
placed it too coarsely, docs/results.md section 20)."""
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The weights tried on held-out pairs; 0 turns the prior off."""

Search = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]
"""(queries [Q, D], k) -> (scores, ids) [Q, k] each, best first: a FAISS index's ``search``."""


@dataclass(frozen=True)
class Prior:
    """``values`` [N]: rho per pool id; ``alpha``: its weight in the score."""

    alpha: float
    values: np.ndarray

    def rescore(self, scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Search hits (scores [Q, n], ids [Q, n], -1 for none) -> the best ``k`` after subtracting
        ``alpha * rho``, best first; missing hits stay last."""
        adjusted = scores - self.alpha * self.values[np.maximum(ids, 0)]  # [Q, n]
        adjusted = np.where(ids >= 0, adjusted, -np.inf)
        order = np.argsort(-adjusted, axis=1, kind="stable")[:, :k]  # [Q, k]
        return np.take_along_axis(adjusted, order, 1), np.take_along_axis(ids, order, 1)

    def search(self, search: Search, queries: np.ndarray, k: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The best ``k`` of a pool of ``size`` for queries [Q, D] by ``search``, rescored: it searches
        at least :data:`DEPTH` hits. Returns (scores, ids) [Q, k] each."""
        scores, ids = search(queries, min(max(k, DEPTH), size))  # [Q, n] x2
        return self.rescore(scores, ids, k)


def reference_sample(pairs: Sequence[Pair], size: int = REFERENCE, seed: int = 0) -> list[Pair]:
    """At most ``size`` of ``pairs``, drawn without replacement (seeded), in draw order."""
    if len(pairs) <= size:
        return list(pairs)
    rng = np.random.default_rng(seed)
    return [pairs[i] for i in rng.choice(len(pairs), size, replace=False)]


def own_conversations(
    keys: Sequence[str], reference: Sequence[Pair], everything: Sequence[Pair]
) -> dict[int, list[int]]:
    """Pool id -> the columns of ``reference`` from a conversation that pool entry belongs to (as a
    response or a context turn of a pair in ``everything``, matched by :func:`normalize`d text). A pair
    with no conversation id is a conversation of its own."""
    where = {key: i for i, key in enumerate(keys)}
    members: dict[str, set[int]] = defaultdict(set)
    for n, pair in enumerate(everything):
        conversation = pair.conversation_id or f"#{n}"
        for text in (*pair.context, pair.response):
            if (i := where.get(normalize(text))) is not None:
                members[conversation].add(i)
    masked: dict[int, list[int]] = defaultdict(list)
    for column, pair in enumerate(reference):
        ids = members.get(pair.conversation_id) if pair.conversation_id else None
        if ids is None:  # not in ``everything`` (or no id): the pair's own texts
            ids = {i for t in (*pair.context, pair.response) if (i := where.get(normalize(t))) is not None}
        for i in ids:
            masked[i].append(column)
    return dict(masked)


def neighbourhood(
    responses: np.ndarray, contexts: np.ndarray, k: int = K, masked: Mapping[int, Sequence[int]] | None = None
) -> np.ndarray:
    """responses [N, D], reference contexts [M, D] -> rho [N]: each response's mean of its ``k`` highest
    inner products with the contexts, leaving out the columns ``masked[i]`` for response i (one masked
    against all but j < k contexts averages those j; against all of them, it gets the median rho)."""
    k = min(k, len(contexts))
    if k < 1:
        raise ValueError("the response prior needs at least one reference context")
    masked = masked or {}
    rho = np.empty(len(responses), dtype=np.float32)
    for start in range(0, len(responses), 4096):
        scores = responses[start : start + 4096] @ contexts.T  # [n, M]
        for row in range(len(scores)):
            if columns := masked.get(start + row):
                scores[row, columns] = -np.inf
        top = np.partition(scores, -k, axis=1)[:, -k:]  # [n, k]
        seen = np.isfinite(top)
        with np.errstate(invalid="ignore"):
            rho[start : start + len(scores)] = np.where(seen, top, 0).sum(1) / seen.sum(1)  # nan: none left
    rho[np.isnan(rho)] = np.nanmedian(rho)
    return rho


def choose_alpha(
    values: np.ndarray,
    scores: np.ndarray,
    ids: np.ndarray,
    gold: np.ndarray,
    alphas: Sequence[float] = ALPHAS,
) -> tuple[float, dict[str, float]]:
    """The weight with the best hits@1 on held-out queries (the first on ties, so 0 unless the prior
    helps): ``scores``/``ids`` [Q, n] their search hits with echoes already removed (id -1), ``gold`` [Q]
    the pool id of each query's reply. Returns it and hits@1 (%) per weight."""
    hits = {}
    for alpha in alphas:
        _, top = Prior(alpha, values).rescore(scores, ids, 1)  # [Q, 1]
        hits[f"{alpha:g}"] = round(100 * float(np.mean(top[:, 0] == gold)), 2)
    best = max(alphas, key=lambda a: hits[f"{a:g}"])
    return float(best), hits


def fit(
    encode_contexts: Callable[[Sequence[Sequence[str]]], np.ndarray],
    search: Search,
    vectors: np.ndarray,
    keys: Sequence[str],
    reference_pairs: Sequence[Pair],
    held_out: Sequence[Pair],
    alpha: float | None = None,
) -> tuple[Prior, dict[str, Any]]:
    """The prior of a pool (``vectors`` [N, D], ``keys`` its :func:`normalize`d texts): rho over a sample
    of ``reference_pairs``' contexts, each response's own conversations masked, and the weight with the
    best hits@1 on the first :data:`HELD_OUT` of ``held_out`` whose replies are in the pool, searched as a
    retriever serves them (echoes of a context turn removed), unless ``alpha`` gives it (``held_out`` is
    then not read). ``encode_contexts``: contexts -> [n, D]; ``search``: (queries [Q, D], k) -> (scores,
    ids) [Q, k] each. Returns it and a manifest entry."""
    reference = reference_sample(reference_pairs)
    values = neighbourhood(
        vectors,
        encode_contexts([p.context for p in reference]),
        masked=own_conversations(keys, reference, reference_pairs),
    )
    measured = {"k": min(K, len(reference)), "reference_contexts": len(reference)}
    if alpha is not None:
        return Prior(alpha, values), {"alpha": alpha, **measured, "chosen_on": "given"}
    where = {key: i for i, key in enumerate(keys)}
    pairs = [p for p in held_out if normalize(p.response) in where][:HELD_OUT]
    if not pairs:
        raise ValueError("the response prior needs held-out pairs whose replies are in the pool")
    depth = min(DEPTH + max(len(p.context) for p in pairs), len(keys))
    scores, ids = search(encode_contexts([p.context for p in pairs]), depth)  # [Q, depth] x2
    ids = np.array(ids)  # a copy: echoes are marked in it
    for row, pair in enumerate(pairs):  # the echo filter, as Query.keep applies it
        echoes = [where[k] for k in {normalize(t) for t in pair.context} if k in where]
        ids[row, np.isin(ids[row], echoes)] = -1
    gold = np.array([where[normalize(p.response)] for p in pairs])
    alpha, hits = choose_alpha(values, np.asarray(scores), ids, gold)
    entry = {
        "alpha": alpha,
        **measured,
        "chosen_on": f"{len(pairs)} held-out pairs, hits@1 of retrieval (echoes removed) per alpha",
        "hits@1": hits,
    }
    return Prior(alpha, values), entry
