"""Evaluation protocols.

* Protocol A ("1-of-N", DSTC7 sub-task 1 style): per test pair, the gold + N-1 negatives drawn with a
  fixed seed from the split's responses whose normalised text differs from the gold's. Scored by the
  bi-encoder, the cross-encoder and their sum.
* Protocol B ("full pool", DSTC7 sub-task 2 style): retrieve from the pool (BM25 or bi-encoder exact
  inner product), drop echoes of the context, rerank the top n_r with the cross-encoder and fuse: the
  service's own :class:`~coreply.ranking.Pipeline`, so evaluation ranks exactly as ``/respond`` does.
A hit is a retrieved text whose normalised form equals the gold's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from coreply.bundle import TorchExactIndex
from coreply.corpus import NegativeSampler, Pair, build_pool
from coreply.gate import GATE_FIDELITY, REACH_FIDELITY, confident, gated, lead
from coreply.models import BiEncoder, CrossEncoder, PolyEncoder, poly_scores
from coreply.prior import Prior
from coreply.ranking import ZSCORE_WEIGHT, Candidates, Hits, Pipeline, Query, order, score_lists
from coreply.text import normalize
from evaluation.metrics import KS, gold_rank, summarize

log = logging.getLogger(__name__)


def protocol_a_lists(
    pairs: Sequence[Pair], pool: Sequence[str], size: int = 100, seed: int = 0
) -> list[list[str]]:
    """Candidate lists, gold first. Pairs that ship their own negatives (benchmark files) use those. A
    list never holds the gold twice: with fewer distinct responses than ``size``, lists are as long as
    the pool allows, and a warning says so."""
    if size < 2:
        raise ValueError(f"a protocol A list needs the gold and at least one negative (size {size})")
    sampler = NegativeSampler(pool)
    if size - 1 > sampler.capacity and not all(p.negatives for p in pairs):
        log.warning(
            "protocol A lists of %d asked for, but the negative pool has %d distinct responses: "
            "lists of %d instead",
            size,
            sampler.distinct,
            sampler.capacity + 1,
        )
        size = sampler.capacity + 1
    rng = np.random.default_rng([seed, 3])
    lists = []
    for pair in pairs:
        negatives = list(pair.negatives[: size - 1]) or sampler.sample(pair.response, size - 1, rng)
        lists.append([pair.response, *negatives])
    return lists


def score_lists_bi(
    bi: BiEncoder, contexts: Sequence[Sequence[str]], lists: Sequence[Sequence[str]]
) -> dict[str, list[np.ndarray]]:
    """{'bi': dot-product scores per list} and, for a Poly-encoder, {'poly': its code-attention scores}."""
    texts = sorted({t for candidates in lists for t in candidates})
    index = {t: i for i, t in enumerate(texts)}
    responses = bi.embed_responses(texts)  # [T, D]
    if isinstance(bi, PolyEncoder):
        vectors = bi.embed_context_codes(contexts)  # [B, 1 + m, D]
        queries, codes = vectors[:, 0], vectors[:, 1:]
    else:
        queries, codes = bi.embed_contexts(contexts), None  # [B, D]
    rows = [responses[[index[t] for t in cands]] for cands in lists]  # [N_i, D] each
    out = {"bi": [(r @ q).numpy() for q, r in zip(queries, rows, strict=True)]}
    if codes is not None:
        out["poly"] = [poly_scores(c[None], r)[0].numpy() for c, r in zip(codes, rows, strict=True)]
    return out


def score_lists_cross(
    cross: CrossEncoder, contexts: Sequence[Sequence[str]], lists: Sequence[Sequence[str]]
) -> list[np.ndarray]:
    return score_lists(lambda c, r: cross.score_pairs(c, r).numpy(), contexts, lists)


def evaluate_lists(
    pairs: Sequence[Pair],
    lists: Sequence[Sequence[str]],
    bi: BiEncoder | None = None,
    cross: CrossEncoder | None = None,
) -> dict[str, dict]:
    """Protocol A for whichever models are given: {'bi'|'poly'|'cross'|'sum': {'metrics', 'ranks',
    'top'}} ('poly' when the bi-encoder is a Poly-encoder)."""
    contexts = [p.context for p in pairs]
    scores: dict[str, list[np.ndarray]] = {}
    if bi is not None:
        scores |= score_lists_bi(bi, contexts, lists)
    if cross is not None:
        scores["cross"] = score_lists_cross(cross, contexts, lists)
    if bi is not None and cross is not None:
        scores["sum"] = [b + c for b, c in zip(scores["bi"], scores["cross"], strict=True)]
    out = {}
    for name, per_pair in scores.items():
        ranks = [gold_rank(s) for s in per_pair]
        top = [int(np.argmax(s)) for s in per_pair]  # index of each list's answer
        out[name] = {"metrics": summarize(ranks), "ranks": ranks, "top": top}
    return out


# ----------------------------------------------------------------------------------------- protocol B


class BM25Retriever:
    """BM25 over the pool (``bm25s``); the query is the context's utterances joined."""

    def __init__(self, pool: Sequence[str]) -> None:
        import bm25s

        self._bm25s = bm25s
        self.model = bm25s.BM25()
        self.model.index(bm25s.tokenize(list(pool), show_progress=False), show_progress=False)
        self.size = len(pool)

    def __call__(self, contexts: Sequence[Sequence[str]], k: int) -> Hits:
        tokens = self._bm25s.tokenize([" ".join(c) for c in contexts], show_progress=False)
        ids, scores = self.model.retrieve(tokens, k=min(k, self.size), show_progress=False)
        return Hits(np.asarray(ids), np.asarray(scores))


class DenseRetriever:
    """Bi-encoder + exact inner-product search over the pool: one matmul and a top-k on the model's
    device (the GPU when training there; evaluation needs no FAISS). A Poly-encoder's hits also carry
    its context codes, and :meth:`vectors` hands out the pool's response vectors (for the poly stage and
    the restatement guard). :meth:`search` and :meth:`vectors` are those of a
    :class:`coreply.bundle.TorchExactIndex`, the search a bundle's exact index gets. With a ``prior`` its
    hits are rescored as a bundle's retriever rescores them (:meth:`coreply.prior.Prior.search`)."""

    def __init__(self, bi: BiEncoder, pool: Sequence[str]) -> None:
        self.bi = bi
        self.index = TorchExactIndex(bi.embed_responses(pool).to(bi.device))  # [P, D]
        self.search, self.vectors = self.index.search, self.index.reconstruct_batch
        self.prior: Prior | None = None

    def __call__(self, contexts: Sequence[Sequence[str]], k: int) -> Hits:
        ids, scores, codes = [], [], []
        k = min(k, self.index.ntotal)
        poly = isinstance(self.bi, PolyEncoder)
        for start in range(0, len(contexts), 256):  # [256, P] score blocks keep memory flat
            block = contexts[start : start + 256]
            if poly:
                both = self.bi.embed_context_codes(block)  # [Q, 1 + m, D]
                queries = both[:, 0]
                codes.append(both[:, 1:].numpy())
            else:
                queries = self.bi.embed_contexts(block)
            if self.prior is None:
                top_scores, top_ids = self.search(queries, k)  # [Q, k] x2
            else:
                top_scores, top_ids = self.prior.search(self.search, queries, k, self.index.ntotal)
            ids.append(top_ids)
            scores.append(top_scores)
        return Hits(np.concatenate(ids), np.concatenate(scores), np.concatenate(codes) if poly else None)

    def encode_contexts(self, contexts: Sequence[Sequence[str]]) -> np.ndarray:
        """[n] contexts -> [n, D] by the context tower (the response prior's reference contexts)."""
        return self.bi.embed_contexts(contexts).float().cpu().numpy()

    def encode_responses(self, texts: Sequence[str]) -> np.ndarray:
        """[n] texts -> [n, D] by the response tower (the restatement guard's last turns)."""
        return self.bi.embed_responses(texts).float().cpu().numpy()


@dataclass
class Retrieved:
    """Per query: the pipeline's candidates (echo-free, retrieval order; rerank scores of the first
    n_r), and the seconds each stage took for all queries."""

    candidates: list[Candidates]
    retrieve_s: float
    rerank_s: float


def conversation_others(pairs: Sequence[Pair], split: Sequence[Pair]) -> list[tuple[str, ...]]:
    """Per pair, the other lines of its conversation in ``split`` (every context turn and response of
    the split's pairs with its conversation id), less its gold and its own context's turns (the first is
    the answer sought, the rest a pipeline drops as echoes), each normalised text once: what a pool
    would lack that does not hold the conversation being served. A pair without a conversation id has
    none."""
    lines: dict[str, dict[str, str]] = {}  # conversation id -> normalised text -> a line with it
    for pair in split:
        if pair.conversation_id:
            own = lines.setdefault(pair.conversation_id, {})
            for text in (*pair.context, pair.response):
                own.setdefault(normalize(text), text)
    out = []
    for pair in pairs:
        drop = {normalize(t) for t in (*pair.context, pair.response)}
        own = lines.get(pair.conversation_id, {}) if pair.conversation_id else {}
        out.append(tuple(text for key, text in own.items() if key not in drop))
    return out


def retrieve_and_rerank(
    pairs: Sequence[Pair],
    ranking: Pipeline,
    depth: int,
    n_r: int,
    exclude: Sequence[Sequence[str]] | None = None,
) -> Retrieved:
    """Retrieve ``depth`` echo-free candidates per query through ``ranking`` and rerank the first
    ``n_r`` with its rerank stage (if any). ``exclude``: per pair, texts its query may not answer (as a
    request's ``exclude``; :func:`conversation_others` for a pool without the conversation)."""
    start = time.perf_counter()
    texts = exclude if exclude is not None else [()] * len(pairs)
    queries = [Query(p.context, exclude_texts=x) for p, x in zip(pairs, texts, strict=True)]
    candidates = ranking.recall(queries, [depth] * len(pairs))
    got = Retrieved(candidates, time.perf_counter() - start, 0.0)
    return rerank(pairs, got, ranking, n_r) if ranking.reranker is not None and n_r > 0 else got


def rerank(pairs: Sequence[Pair], got: Retrieved, ranking: Pipeline, n_r: int) -> Retrieved:
    """A copy of ``got`` whose first ``n_r`` candidates per query are scored by ``ranking``'s rerank
    stage (several stages can rerank one retrieval)."""
    candidates = [replace(c, rerank=None) for c in got.candidates]
    start = time.perf_counter()
    ranking.rerank([Query(p.context) for p in pairs], candidates, n_r)
    return Retrieved(candidates, got.retrieve_s, time.perf_counter() - start)


def ranked_ids(
    got: Retrieved,
    fusion: str,
    n_r: int,
    weight: float = ZSCORE_WEIGHT,
    gate: float | None = None,
    reach: float | None = None,
) -> list[np.ndarray]:
    """Per query, pool ids best first under a fusion of the top ``n_r``; in the first stage's order
    where it is confident past ``gate``, else with only the candidates within ``reach`` fused
    (:func:`~coreply.gate.gated`, as a gated bundle serves a request for one answer)."""
    out = []
    for c in got.candidates:
        used, reranked = gated(c, fusion, gate, reach)
        out.append(c.ids[order(c, used, n_r, weight, reranked)[0]])
    return out


def reranked_per_context(
    got: Retrieved, fusion: str, n_r: int, gate: float | None = None, reach: float | None = None
) -> float:
    """How many of its first ``n_r`` candidates the reranker reads a context, on average, behind ``gate``
    and within ``reach`` (:func:`~coreply.gate.gated`; 0 for a context the gate skips)."""
    read = [min(gated(c, fusion, gate, reach)[1], n_r) for c in got.candidates]  # [N]
    return float(np.mean(read)) if read else 0.0


def ranks_for(
    pairs: Sequence[Pair],
    pool_keys: Sequence[str],
    got: Retrieved,
    fusion: str,
    n_r: int,
    weight: float = ZSCORE_WEIGHT,
    gate: float | None = None,
    reach: float | None = None,
) -> list[float]:
    """Rank of the gold under a fusion of the top ``n_r`` (gated as :func:`ranked_ids`)."""
    ranks = []
    for pair, ids in zip(pairs, ranked_ids(got, fusion, n_r, weight, gate, reach), strict=True):
        gold = normalize(pair.response)
        hits = [r for r, j in enumerate(ids) if pool_keys[j] == gold]
        ranks.append(float(hits[0] + 1) if hits else float("inf"))
    return ranks


def pool_for_eval(
    all_responses: Sequence[str], test: Sequence[Pair], limit: int | None, seed: int
) -> list[str]:
    """The full de-duplicated pool, or (``limit``) the test golds plus a seeded sample of the rest."""
    pool = build_pool(all_responses)
    if limit is None or limit >= len(pool):
        return pool
    golds = build_pool([p.response for p in test])
    gold_keys = {normalize(t) for t in golds}
    rest = [t for t in pool if normalize(t) not in gold_keys]
    rng = np.random.default_rng([seed, 5])
    take = rng.choice(len(rest), size=max(0, limit - len(golds)), replace=False)
    return golds + [rest[i] for i in sorted(take)]


POOL_N_R = 10
"""How many of the retriever's first candidates a training validation's pool lets the reranker reorder
(protocol B is decided at n_r = 10)."""


def recall_pool(pairs: Sequence[Pair], pool: Sequence[str], bi: BiEncoder) -> Retrieved:
    """The retriever's first ``max(KS)`` echo-free candidates over ``pool`` for each pair (unguarded)."""
    keys = [normalize(t) for t in pool]
    return retrieve_and_rerank(pairs, Pipeline(DenseRetriever(bi, pool), pool, keys), max(KS), 0)


def evaluate_pool(
    pairs: Sequence[Pair],
    pool: Sequence[str],
    got: Retrieved,
    cross: CrossEncoder | None = None,
    n_r: int = POOL_N_R,
) -> dict[str, dict[str, Any]]:
    """Protocol B over ``pool`` from a :func:`recall_pool`: {'bi_pool': {'metrics', 'ranks'}} in the
    retriever's order and, with ``cross``, 'cross_pool' and 'sum_pool': its first ``n_r`` reordered by
    the reranker's scores and by their sum with the retriever's (a gold outside them is not found)."""
    keys = [normalize(t) for t in pool]
    fusions = {"bi_pool": ("retrieval", max(KS))}
    if cross is not None:
        lists = [[pool[i] for i in c.ids[:n_r]] for c in got.candidates]
        scored = score_lists_cross(cross, [p.context for p in pairs], lists)
        reranked = [replace(c, rerank=s) for c, s in zip(got.candidates, scored, strict=True)]
        got = replace(got, candidates=reranked)
        fusions |= {"cross_pool": ("rerank", n_r), "sum_pool": ("sum", n_r)}
    out = {}
    for name, (fusion, depth) in fusions.items():
        ranks = ranks_for(pairs, keys, got, fusion, depth)
        out[name] = {"metrics": summarize(ranks), "ranks": ranks}
    return out


def choose_zscore_weight(
    pairs: Sequence[Pair], pool_keys: Sequence[str], got: Retrieved, n_r: int
) -> tuple[float, dict[float, list[float]]]:
    """The z-score fusion weight with the best hits@1 (then MRR; then the larger weight) on validation,
    and the gold's ranks (:func:`ranks_for`) at every weight of the grid 0.0, 0.1, .., 1.0."""
    ranks = {w / 10: ranks_for(pairs, pool_keys, got, "zscore", n_r, w / 10) for w in range(11)}
    grid = {w: summarize(r) for w, r in ranks.items()}
    return max(grid, key=lambda w: (grid[w]["hits@1"], grid[w]["mrr"], w)), ranks


def choose_gate(
    got: Retrieved, fusion: str, n_r: int, weight: float, fidelity: float = GATE_FIDELITY
) -> float | None:
    """The rerank gate: the smallest first-stage :func:`~coreply.gate.lead` such that answering every
    context that leads by at least that much in the first stage's order, instead of reranked and fused
    by ``fusion``, changes the top answer of at most ``fidelity`` of ``got``'s contexts (None: no lead
    does; always rerank). No labels are read: the gate keeps the reranker's answers, right or wrong, in
    all but that share, so a bundle's hits@1 moves by at most that much either way. ``got`` holds rerank
    scores of every context's first ``n_r``."""
    if not 0 <= fidelity < 1:
        raise ValueError(f"the gate's fidelity must be in [0, 1), got {fidelity}")
    leads = np.array([lead(c) for c in got.candidates])  # [N]
    changed = np.array(  # [N] the fused top answer is not the first stage's
        [
            len(c.ids) > 0 and order(c, fusion, n_r, weight)[0][0] != order(c, "retrieval", n_r)[0][0]
            for c in got.candidates
        ]
    )
    by_lead = np.argsort(-leads, kind="stable")  # largest lead first
    leads, changed = leads[by_lead], np.cumsum(changed[by_lead])  # changed: among those leading as far
    last = np.r_[leads[1:] != leads[:-1], True]  # the last of each run of equal leads
    fits = np.flatnonzero(last & np.isfinite(leads) & (changed <= fidelity * len(leads)))  # a prefix
    return float(leads[fits[-1]]) if len(fits) else None


def choose_reach(
    got: Retrieved,
    fusion: str,
    n_r: int,
    weight: float,
    gate: float | None,
    fidelity: float = REACH_FIDELITY,
) -> float | None:
    """The rerank reach: the smallest first-stage margin such that reranking, in every context ``gate``
    leaves to the reranker, only the candidates before the first that trails the best by that much
    (:func:`~coreply.gate.reach`) changes the top answer of at most ``fidelity`` of ``got``'s contexts
    against reranking all ``n_r`` (None: no contexts). A context's answer changes exactly when the
    candidate that wins the fusion of all ``n_r`` lies outside the reach, that is when the margin is at
    most the largest first-stage deficit up to and including the winner; so the margin is just above
    the deficit of the context ranked ``fidelity`` x N + 1 by it. Like the gate it reads no labels.
    ``got`` holds rerank scores of every context's first ``n_r``."""
    if not 0 <= fidelity < 1:
        raise ValueError(f"the reach's fidelity must be in [0, 1), got {fidelity}")
    deficits = [0.0] * len(got.candidates)  # [N] what a context's fused winner needs
    for i, c in enumerate(got.candidates):
        if len(c.ids) and not confident(c, gate):
            winner = order(c, fusion, n_r, weight)[0][0]
            deficits[i] = float(np.max(c.first_stage[0] - c.first_stage[: winner + 1]))
    if not deficits:
        return None
    needed = np.sort(deficits)[::-1][int(fidelity * len(deficits))]  # may be left out of the reach
    return float(np.nextafter(needed, np.inf))
