"""The Python API: a bundle's whole answer path in one object, in-process, for scripts, notebooks and
``coreply chat``. It ranks exactly as ``POST /respond`` does (the same :class:`~coreply.ranking.Pipeline`),
without the service's batching, limits and metrics::

    from coreply import Responder

    bot = Responder.load("artifacts/default-bundle")
    for reply in bot.respond(["hi!", "hey, how was your weekend?"], top_k=3):
        print(reply.score, reply.text, reply.metadata)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coreply import gate
from coreply.bundle import Bundle, default_fusion, load_bundle, make_backend, pipeline, search_on
from coreply.filters import Filter
from coreply.ranking import FUSIONS, Candidates, Query, order
from coreply.text import variant_key


@dataclass(frozen=True)
class Reply:
    id: int  # row in the bundle (what ``exclude_ids`` takes)
    text: str
    score: float  # under the fusion used
    retrieval_score: float  # the dense retriever's
    rerank_score: float | None
    lexical_score: float | None  # BM25's, with a lexical stage
    metadata: dict[str, Any]  # the pool file's other fields for this response ({} if none)


class Responder:
    def __init__(self, bundle: Bundle, backend: Any) -> None:
        self.bundle, self.backend = bundle, backend
        self.pipeline = pipeline(bundle, backend)
        self.default_fusion = default_fusion(bundle.manifest)

    @classmethod
    def load(
        cls, path: str | Path, backend: str = "auto", device: str = "cpu", threads: int = 1
    ) -> Responder:
        """Load and verify the bundle at ``path``; ``backend`` is ``auto`` (ONNX when exported), ``onnx``,
        ``torch`` or ``torch-bf16`` (:func:`coreply.bundle.make_backend`)."""
        bundle = search_on(load_bundle(path), device)
        return cls(bundle, make_backend(bundle, backend, threads, device))

    def respond(
        self,
        context: Sequence[str],
        top_k: int = 1,
        n_candidates: int = 10,
        fusion: str | None = None,
        exclude_ids: Sequence[int] = (),
        exclude_texts: Sequence[str] = (),
        knowledge: Sequence[str] | None = None,
        allow_restatements: bool = False,
        filter: Filter | None = None,
        allow_variants: bool = False,
    ) -> list[Reply]:
        """The best ``top_k`` of ``n_candidates`` recalled for ``context`` (oldest utterance first), never
        a copy of a context turn nor an excluded response, nor (with the bundle's restatement guard,
        unless ``allow_restatements``) a restatement of a context turn; reranked and fused unless
        ``fusion`` is ``retrieval``. Default: the bundle's calibrated fusion, or retrieval without a
        rerank stage, in the first stage's order where it leads past the bundle's rerank gate, else
        reranking only the candidates within the bundle's reach (:func:`~coreply.gate.gated`); a named
        fusion always reranks all of them. ``knowledge`` (a persona, facts) grounds a reranker that reads
        it; default: the bundle's own. ``filter`` answers only with responses whose metadata matches it
        (:mod:`coreply.filters`; a field no response has raises :class:`~coreply.filters.FilterError`).
        The replies are distinct answers, none a spelling variant of a better one, unless
        ``allow_variants`` (:func:`replies`)."""
        gated = fusion is None
        fusion = fusion or self.default_fusion
        if fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}")
        if fusion != "retrieval" and self.pipeline.reranker is None:
            raise ValueError(f"fusion {fusion!r} needs a rerank stage and this bundle has none")
        if not context or top_k < 1 or n_candidates < top_k:
            raise ValueError("need a non-empty context and 1 <= top_k <= n_candidates")
        if knowledge and not self.pipeline.reads_knowledge:
            raise ValueError("knowledge: this bundle's reranker does not read knowledge")
        knowledge = self.bundle.knowledge if knowledge is None else knowledge
        allow = None if filter is None else self.bundle.filters.allowed(filter)
        query = Query(
            tuple(context),
            tuple(exclude_texts),
            frozenset(exclude_ids),
            tuple(knowledge),
            allow_restatements,
            allow,
        )
        (candidates,) = self.pipeline.recall([query], [n_candidates])
        reranked = n_candidates
        if gated:
            fusion, reranked = gate.gated(candidates, fusion, self.pipeline.gate, self.pipeline.reach, top_k)
        if fusion != "retrieval" and len(candidates.ids):
            self.pipeline.rerank(self.pipeline.ground([query]), [candidates], reranked)
        positions, final = order(candidates, fusion, n_candidates, self.pipeline.weight, reranked)
        return replies(self.bundle, candidates, positions, final, top_k, allow_variants)


def replies(
    bundle: Bundle,
    candidates: Candidates,
    positions: np.ndarray,
    final: np.ndarray,
    top_k: int,
    allow_variants: bool = False,
) -> list[Reply]:
    """The first ``top_k`` candidates at ``positions`` (best first, as :func:`~coreply.ranking.order`
    gives them, with their ``final`` scores) as replies; unless ``allow_variants``, a candidate that is a
    spelling variant of a better one (:func:`~coreply.text.variant_key`: "heyy" after "Hey!") is passed
    over and the next takes its place, so fewer than ``top_k`` come back only when the candidates hold
    fewer distinct answers. The first reply is the same either way. A candidate past a rerank reach (which
    reads at least ``top_k``) has no rerank score, and its first-stage score as its score."""
    rerank, lexical = candidates.rerank, candidates.lexical
    out: list[Reply] = []
    seen: set[str] = set()
    for j, score in zip(positions, final, strict=True):
        if len(out) == top_k:
            break
        i = int(candidates.ids[j])
        key = variant_key(bundle.texts[i])
        if key in seen and not allow_variants:
            continue
        seen.add(key)
        out.append(
            Reply(
                id=i,
                text=bundle.texts[i],
                score=float(score),
                retrieval_score=float(candidates.retrieval[j]),
                rerank_score=None if rerank is None or j >= len(rerank) else float(rerank[j]),
                lexical_score=None if lexical is None else float(lexical[j]),
                metadata=bundle.metadata[i],
            )
        )
    return out
