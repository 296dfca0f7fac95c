"""`coreply ground eval`: protocol A for a knowledge-grounded ranker, with the knowledge its setting reads
(the knowledge retriever's top-m, all of it, or none), per-case ranks, and paired significance against
other such evaluations of the same cases."""

from __future__ import annotations

import platform
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from coreply.corpus import Pair
from coreply.knowledge import KnowledgeSelector, knowledge_stats, select_for_pairs
from coreply.models import BiEncoder, CrossEncoder
from coreply.ranking import score_lists
from evaluation.metrics import gold_rank, paired_bootstrap, per_case, summarize
from evaluation.protocols import protocol_a_lists


def grounded_ranks(
    cross: CrossEncoder,
    retriever: BiEncoder | None,
    pairs: Sequence[Pair],
    lists: Sequence[Sequence[str]],
    top_m: int,
    use_knowledge: bool = True,
) -> list[int]:
    """Rank of the gold (list position 0) per pair. The ranker reads the retriever's top-m when a
    retriever is given, else every sentence as given; nothing when it reads no knowledge or
    ``use_knowledge`` is off (the same ranker with its knowledge withheld)."""
    knowledge = None
    if use_knowledge and cross.reads_knowledge:
        selector = KnowledgeSelector(retriever, top_m) if retriever is not None else None
        knowledge = select_for_pairs(selector, pairs)
    score = lambda c, r, k=None: cross.score_pairs(c, r, k).numpy()  # noqa: E731
    return [gold_rank(s) for s in score_lists(score, [p.context for p in pairs], lists, knowledge)]


def evaluate_grounded(
    name: str,
    cross: CrossEncoder,
    retriever: BiEncoder | None,
    test: Sequence[Pair],
    negatives: Sequence[str],
    candidates: int = 100,
    top_m: int = 5,
    use_knowledge: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Protocol A over ``test`` (negatives drawn from ``negatives`` with ``seed``): {'meta', 'metrics',
    'ranks'}. Lists depend only on the pairs, the negatives and the seed, so evaluations of other
    settings on the same arguments are paired case by case."""
    lists = protocol_a_lists(test, negatives, candidates, seed)
    reads = use_knowledge and cross.reads_knowledge
    ranks = grounded_ranks(cross, retriever, test, lists, top_m, use_knowledge)
    setting = "none" if not reads else f"retrieved top-{top_m}" if retriever is not None else "all"
    return {
        "meta": {
            "name": name,
            "knowledge": setting,
            "cross_hash": getattr(cross, "content_hash", None),
            "retriever_hash": getattr(retriever, "content_hash", None) if reads else None,
            "max_knowledge_tokens": cross.config.max_knowledge_tokens if reads else 0,
            "test": knowledge_stats(test),
            "candidates": len(lists[0]) if lists else 0,
            "seed": seed,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        },
        "metrics": summarize(ranks),
        "ranks": ranks,
    }


def significance(result: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """One-sided paired-bootstrap p-values that ``result`` is not better than ``other`` on hits@1 and MRR;
    both must be evaluations of the same cases."""
    a, b = np.asarray(result["ranks"], dtype=float), np.asarray(other["ranks"], dtype=float)
    if a.shape != b.shape or result["meta"]["seed"] != other["meta"]["seed"]:
        raise ValueError(f"{other['meta']['name']!r} was evaluated on other cases (size or seed differ)")
    return {m: paired_bootstrap(per_case(a, m), per_case(b, m)) for m in ("hits@1", "mrr")}
