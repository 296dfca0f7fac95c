"""The ranking path, written once: recall -> drop echoes, exclusions and restatements -> reorder by the
words shared with the context (the lexical stage, when the pool has one) -> rerank -> fuse -> order.

The rerank stage is a cross-encoder (pairs through a transformer) or, when the retriever is a
Poly-encoder, the poly stage: its context codes attend over the candidates' cached response vectors
(no transformer pass at all).

The service (``POST /respond``), ``coreply eval`` (protocol B) and the index builder's calibration all
rank through :class:`Pipeline` and :func:`order`, so they cannot rank differently. The service runs the
two model stages (:meth:`Pipeline.recall`, :meth:`Pipeline.rerank`) inside its micro-batchers;
evaluation and calibration run them back to back (``evaluation.protocols.retrieve_and_rerank``).
Scoring (expensive) and ordering (cheap) are separate, so an evaluation scores once and orders under
every fusion and n_r.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, get_args

import numpy as np
import torch

from coreply import restatement
from coreply.lexical import Stage as LexicalStage
from coreply.models import poly_scores
from coreply.text import normalize
from coreply.vectors import TextVectors, unit

Fusion = Literal["retrieval", "rerank", "sum", "zscore"]
FUSIONS: tuple[str, ...] = get_args(Fusion)
ZSCORE_WEIGHT = 0.5
"""The z-score fusion weight of the retrieval score when a bundle was not calibrated."""


@dataclass
class Hits:
    """What a retriever found for a batch of contexts."""

    ids: np.ndarray  # [B, k] pool ids, best first; -1 pads a short row
    scores: np.ndarray  # [B, k]
    codes: np.ndarray | None = None  # [B, m, D] a Poly-encoder's context codes (for the poly stage)


Allow = Sequence[np.ndarray | None] | None
"""Per context, [N] bool over pool ids: the rows its search runs within (None: the whole pool)."""


class Retriever(Protocol):
    """Finds hits for a batch of contexts (with ``allow``, each within its allowed rows; a retriever
    that never serves a filtered query may leave it out). A Poly-encoder retriever's hits also carry
    codes. A dense retriever also has ``vectors(ids [n]) -> [n, D]`` (the pool's response vectors: the
    poly stage and the restatement guard read them) and ``encode_responses(texts [n]) -> [n, D]`` (the
    guard's context turns)."""

    def __call__(self, contexts: Sequence[Sequence[str]], k: int, allow: Allow = None) -> Hits: ...


ScorePairs = Callable[..., np.ndarray]
"""(contexts [N], responses [N][, knowledge [N]]) -> reranker scores [N]: a cross-encoder, or a serving
backend; the knowledge argument is passed only when some query carries knowledge."""

SelectKnowledge = Callable[[Sequence[Sequence[str]], Sequence[Sequence[str]]], list[tuple[str, ...]]]
"""(contexts [N], knowledge sets [N]) -> the sentences the reranker reads per context, most relevant
first: a :class:`~coreply.knowledge.KnowledgeSelector`."""


@dataclass(frozen=True)
class Query:
    """One query: the dialogue so far, pool entries that must not be answered (by text or id),
    background knowledge the reply may draw on (a persona, an operator's facts), whether answers may
    restate the context (by default a guarded pipeline drops them), and ``allow``, [N] bool over pool
    ids: the only responses it may be answered with (a metadata filter, :mod:`coreply.filters`; the
    search runs within them), or None for all."""

    context: Sequence[str]
    exclude_texts: Sequence[str] = ()
    exclude_ids: Collection[int] = frozenset()
    knowledge: Sequence[str] = ()
    allow_restatements: bool = False
    allow: np.ndarray | None = field(default=None, compare=False)

    def depth(self, n: int) -> int:
        """How many hits to fetch so that ``n`` survive the filter: the pool holds each normalised text
        once, so every blocked text (a context turn or an excluded text) or id hides at most one hit."""
        return n + len(self.context) + len(self.exclude_texts) + len(self.exclude_ids)

    def keep(
        self,
        ids: np.ndarray,
        keys: Sequence[str],
        withdrawn: Collection[int] = (),
        depth: int | None = None,
        passed_over: Collection[int] = (),
    ) -> list[int]:
        """Positions in ``ids`` that may be answered: among the first ``depth`` hits that are neither
        padding (-1) nor ``withdrawn`` (the hits a pool without the withdrawn responses would return),
        those that are not an excluded or ``passed_over`` id, nor the normalised text of a context turn
        (an echo) or of an excluded text."""
        blocked = {normalize(t) for t in (*self.context, *self.exclude_texts)}
        live = [(j, i) for j, i in enumerate(ids.tolist()) if i >= 0 and i not in withdrawn][:depth]
        return [
            j
            for j, i in live
            if keys[i] not in blocked and i not in self.exclude_ids and i not in passed_over
        ]


@dataclass
class Candidates:
    """One query's candidates in first-stage order, and the reranker's scores of the first few. The first
    stage is the dense retriever alone, or with a lexical stage the fusion of its scores with BM25's."""

    ids: np.ndarray  # [n] pool ids
    retrieval: np.ndarray  # [n] float64, the dense retriever's scores
    rerank: np.ndarray | None = field(default=None)  # [m <= n] float64, scores of ids[:m]
    codes: np.ndarray | None = field(default=None)  # [m, D] the context's Poly-encoder codes
    lexical: np.ndarray | None = field(default=None)  # [n] float64, BM25 scores (a lexical stage)
    hybrid: np.ndarray | None = field(default=None)  # [n] float64, dense fused with lexical

    @property
    def first_stage(self) -> np.ndarray:
        """[n] the scores the candidates are in order of: ``hybrid`` when set, else ``retrieval``."""
        return self.retrieval if self.hybrid is None else self.hybrid


def zscore(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / (x.std() + 1e-6)


def fuse(mode: str, retrieval: np.ndarray, rerank: np.ndarray, weight: float = ZSCORE_WEIGHT) -> np.ndarray:
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


def order(
    candidates: Candidates, fusion: str, n_r: int, weight: float = ZSCORE_WEIGHT, reranked: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(positions best first, their final scores) among the first ``n_r`` candidates under ``fusion``;
    ties keep first-stage order. Fusion ``retrieval`` is the first stage's order (dense, or dense with
    lexical); any other needs rerank scores of those ``n_r``, or with ``reranked`` (a rerank reach,
    :func:`coreply.gate.reach`) of the first ``reranked`` of them: those are fused and ordered, and the
    rest follow in first-stage order, with their first-stage scores."""
    retrieval = candidates.first_stage[:n_r]
    m = len(retrieval) if reranked is None else min(reranked, len(retrieval))
    if fusion == "retrieval" or not m:
        final, m = retrieval, len(retrieval)
    else:
        rerank = candidates.rerank
        if rerank is None or len(rerank) < m:
            raise ValueError(f"fusion {fusion!r} over {m} candidates needs their rerank scores")
        final = fuse(fusion, retrieval[:m], rerank[:m], weight)
    positions = np.argsort(-final, kind="stable")
    return np.r_[positions, m : len(retrieval)], np.r_[final[positions], retrieval[m:]]


def score_lists(
    score_pairs: ScorePairs,
    contexts: Sequence[Sequence[str]],
    lists: Sequence[Sequence[str]],
    knowledge: Sequence[Sequence[str]] | None = None,
) -> list[np.ndarray]:
    """Score each context (grounded on its ``knowledge``, when given) against its own candidate texts in
    one call (pairs flattened, split back)."""
    flat_c = [c for c, texts in zip(contexts, lists, strict=True) for _ in texts]
    flat_r = [t for texts in lists for t in texts]
    args: tuple = (flat_c, flat_r)
    if knowledge is not None:
        args += ([k for k, texts in zip(knowledge, lists, strict=True) for _ in texts],)
    flat = np.asarray(score_pairs(*args), dtype="float64") if flat_r else np.zeros(0)
    bounds = np.cumsum([len(texts) for texts in lists])[:-1]
    return np.split(flat, bounds)


class Pipeline:
    """A retriever over a pool, optionally a rerank stage, and the z-score weight, rerank ``gate`` and
    ``reach`` (:mod:`coreply.gate`) the pool was calibrated with. ``texts`` and ``keys`` (normalised
    texts) are the pool, row i = id i. The rerank stage is the cross-encoder ``score_pairs`` when given,
    else with ``poly`` the Poly-encoder retriever's own codes, else none. A cross-encoder that reads
    knowledge is given each query's knowledge as ``select_knowledge`` narrows it (:meth:`ground`), or
    as the query carries it. With a restatement ``guard``, recall drops candidates that restate the context
    (:mod:`coreply.restatement`); with a ``lexical`` stage it then reorders them by the words they share
    with it (:mod:`coreply.lexical`). ``withdrawn`` ids are never answered: every search fetches that
    many more hits and keeps those a pool without them would return. ``passed_over`` ids are never
    answered either, but dropped from the hits as an echo is, without fetching more: the bundle's replies
    that say nothing (a deeper search reorders the response prior's tail, results.md §73)."""

    def __init__(
        self,
        retrieve: Retriever,
        texts: Sequence[str],
        keys: Sequence[str],
        score_pairs: ScorePairs | None = None,
        weight: float = ZSCORE_WEIGHT,
        poly: bool = False,
        select_knowledge: SelectKnowledge | None = None,
        reads_knowledge: bool = False,
        guard: restatement.Guard | None = None,
        lexical: LexicalStage | None = None,
        gate: float | None = None,
        withdrawn: Collection[int] = frozenset(),
        reach: float | None = None,
        passed_over: Collection[int] = frozenset(),
    ) -> None:
        self.retrieve, self.texts, self.keys, self.withdrawn = retrieve, texts, keys, withdrawn
        self.passed_over = passed_over
        self._withdrawn_ids = np.fromiter(withdrawn, dtype=np.int64, count=len(withdrawn))  # for masks
        self.score_pairs, self.weight, self.gate, self.reach = score_pairs, weight, gate, reach
        self.select_knowledge, self.reads_knowledge = select_knowledge, reads_knowledge
        self.guard, self.lexical = guard, lexical
        if poly and score_pairs is None and not hasattr(retrieve, "vectors"):
            raise ValueError("the poly stage needs a Poly-encoder retriever (with cached response vectors)")
        if guard is not None and not (hasattr(retrieve, "vectors") and hasattr(retrieve, "encode_responses")):
            raise ValueError("the restatement guard needs a dense retriever (response vectors)")
        self.turn_vectors = (  # unit vectors of context turns: a conversation's turns are encoded once
            TextVectors(lambda texts: unit(retrieve.encode_responses(texts)))  # type: ignore[attr-defined]
            if guard
            else None
        )
        self._word_sets: restatement.WordSets | None = None
        self.reranker = "cross" if score_pairs is not None else "poly" if poly else None
        self.timings: dict[str, float] = {}
        """Seconds per stage of the last :meth:`recall`: the retriever's (``encode``, ``search``, summed
        over its calls: a guarded recall may search again deeper) and ``lexical``."""

    @property
    def lexical(self) -> LexicalStage | None:
        return self._lexical

    @lexical.setter
    def lexical(self, stage: LexicalStage | None) -> None:
        """Set (or drop) the lexical stage; the pool's term counts are counted here, once."""
        self._lexical = stage
        self._terms = stage.bm25.index(self.texts) if stage else None

    def recall(self, queries: Sequence[Query], n: Sequence[int]) -> list[Candidates]:
        """Up to ``n[i]`` answerable candidates for each query, from one retrieval call for all (and, for
        guarded queries the guard left short, deeper calls for those: :data:`restatement.DEEPEN`). A
        lexical stage reorders the first ``max(n[i], depth)`` answerable candidates of that search (its
        depth for a served request, at most 100 candidates by default), then keeps ``n[i]``."""
        guard = self.guard is not None
        fetch = [max(m, self.lexical.depth) for m in n] if self.lexical else n
        live = len(self.texts) - len(self.withdrawn)  # the answerable pool
        lives = [self._live(q, live) for q in queries]  # each query's: its allowed rows not withdrawn
        k = max(q.depth(m) for q, m in zip(queries, fetch, strict=True))
        k = min(k + (restatement.MARGIN if guard else 0), max(lives))
        out: list[Candidates | None] = [None] * len(queries)
        todo = list(range(len(queries)))
        timings: dict[str, float] = {}
        while todo:
            allow = [queries[i].allow for i in todo]
            within = {"allow": allow} if any(a is not None for a in allow) else {}
            hits = self.retrieve([queries[i].context for i in todo], k + len(self.withdrawn), **within)
            for stage, seconds in getattr(self.retrieve, "timings", {}).items():
                timings[stage] = timings.get(stage, 0.0) + seconds
            keep = self._answerable([queries[i] for i in todo], hits.ids, k)
            deeper = min(k * restatement.DEEPEN, restatement.MAX_DEPTH, max(lives[i] for i in todo))
            short = []
            for row, i in enumerate(todo):
                room = deeper > k and lives[i] > k  # a deeper search would find more of this query's rows
                if len(keep[row]) < n[i] and guard and not queries[i].allow_restatements and room:
                    short.append(i)
                    continue
                kept = keep[row][: fetch[i]]
                codes = None if hits.codes is None else hits.codes[row]
                scores = np.asarray(hits.scores[row], dtype="float64")[kept]
                out[i] = Candidates(np.asarray(hits.ids[row])[kept], scores, codes=codes)
            todo, k = short, deeper
        if self.lexical is not None:
            start = time.perf_counter()
            out = [self._reorder(q, c, m) for q, c, m in zip(queries, out, n, strict=True)]  # type: ignore[arg-type]
            timings["lexical"] = time.perf_counter() - start
        self.timings = timings
        return out  # type: ignore[return-value]

    def _reorder(self, query: Query, c: Candidates, n: int) -> Candidates:
        """The lexical stage on one query's candidates: BM25 scores of their texts against its context,
        z-score fused with their dense scores; the best ``n`` of that order."""
        stage, terms = self.lexical, self._terms
        assert stage is not None and terms is not None
        bm25 = stage.bm25.scores_at(stage.query(query.context), terms, c.ids)  # [n']
        fused = fuse("zscore", c.retrieval, bm25, stage.weight) if len(bm25) else bm25
        best = np.argsort(-fused, kind="stable")[:n]
        return replace(
            c, ids=c.ids[best], retrieval=c.retrieval[best], lexical=bm25[best], hybrid=fused[best]
        )

    def _live(self, query: Query, live: int) -> int:
        """How many responses ``query`` may be answered with at most: the pool's ``live`` ones, or its
        allowed rows that are not withdrawn."""
        if query.allow is None:
            return live
        return int(query.allow.sum() - query.allow[self._withdrawn_ids].sum())

    def word_sets(self) -> restatement.WordSets:
        """The pool's distinct words, read on first use (by a guard that counts words)."""
        if self._word_sets is None:
            self._word_sets = restatement.WordSets(self.texts)
        return self._word_sets

    def _answerable(self, queries: Sequence[Query], ids: np.ndarray, depth: int) -> list[list[int]]:
        """Per query, the positions of its hit ``ids`` [B, depth + withdrawn] that :meth:`Query.keep`
        allows, that are not passed over and, unless the query allows restatements, that do not restate
        its context (one guard call for all)."""
        keep = [
            q.keep(row, self.keys, self.withdrawn, depth, self.passed_over)
            for q, row in zip(queries, ids, strict=True)
        ]
        guarded = [i for i, q in enumerate(queries) if not q.allow_restatements]
        if self.guard is None or self.turn_vectors is None or not guarded:
            return keep
        masks = restatement.restating(
            self.turn_vectors,
            self.retrieve.vectors,  # type: ignore[attr-defined]
            self.word_sets,
            [queries[i].context for i in guarded],
            [ids[i][keep[i]] for i in guarded],
            self.guard,
        )
        for i, restates in zip(guarded, masks, strict=True):
            keep[i] = [j for j, bad in zip(keep[i], restates, strict=True) if not bad]
        return keep

    def rerank(
        self, queries: Sequence[Query], candidates: Sequence[Candidates], n_r: int | Sequence[int]
    ) -> None:
        """Score the first ``n_r`` candidates of every query (or ``n_r[i]`` of query i) with the rerank
        stage (one call for all cross-encoder pairs)."""
        n = [n_r] * len(candidates) if isinstance(n_r, int) else n_r
        if self.reranker == "poly":
            vectors = self.retrieve.vectors  # type: ignore[attr-defined]
            for c, m in zip(candidates, n, strict=True):
                c.rerank = poly_rescore(c.codes, vectors(c.ids[:m]))
            return
        if self.score_pairs is None:
            raise ValueError("this pipeline has no rerank stage")
        lists = [[self.texts[i] for i in c.ids[:m]] for c, m in zip(candidates, n, strict=True)]
        contexts = [q.context for q in queries]
        knowledge = [q.knowledge for q in queries] if any(q.knowledge for q in queries) else None
        scored = score_lists(self.score_pairs, contexts, lists, knowledge)
        for c, scores in zip(candidates, scored, strict=True):
            c.rerank = scores

    def ground(self, queries: Sequence[Query]) -> list[Query]:
        """The queries with the knowledge the reranker will read: ``select_knowledge``'s pick for each
        query that carries knowledge (unchanged without a selector)."""
        todo = [i for i, q in enumerate(queries) if q.knowledge]
        if self.select_knowledge is None or not todo:
            return list(queries)
        picked = self.select_knowledge(
            [queries[i].context for i in todo], [queries[i].knowledge for i in todo]
        )
        out = list(queries)
        for i, chosen in zip(todo, picked, strict=True):
            out[i] = replace(out[i], knowledge=chosen)
        return out


def poly_rescore(codes: np.ndarray | None, vectors: np.ndarray) -> np.ndarray:
    """The poly stage for one context: codes [m, D], candidate vectors [n, D] -> scores [n] (float64),
    by the model's own :func:`~coreply.models.poly_scores`."""
    if codes is None:
        raise ValueError("the poly stage needs the retriever's context codes")
    with torch.inference_mode():
        scores = poly_scores(torch.from_numpy(codes)[None].float(), torch.from_numpy(vectors).float())
    return scores[0].double().numpy()
