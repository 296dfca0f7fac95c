"""`coreply eval`: score one retriever/reranker combination on protocols A and B, as the JSON that
`coreply report` (:mod:`evaluation.tables`) merges into tables."""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from typing import Any

import torch

from coreply import prior, restatement
from coreply.checkpoint import load_bi, load_checkpoint, read_meta
from coreply.config import ZERO_SHOT
from coreply.corpus import Pair
from coreply.models import PolyEncoder
from coreply.ranking import ZSCORE_WEIGHT, Pipeline
from coreply.text import normalize
from evaluation.metrics import KS, summarize
from evaluation.protocols import (
    BM25Retriever,
    DenseRetriever,
    Retrieved,
    choose_zscore_weight,
    evaluate_lists,
    protocol_a_lists,
    ranked_ids,
    ranks_for,
    rerank,
    retrieve_and_rerank,
)
from evaluation.restatement import RestatementJudge

log = logging.getLogger(__name__)


@dataclass
class EvalSpec:
    name: str
    bi: str | None
    cross: str | None
    test: list[Pair]
    valid: list[Pair]
    pool: list[str]
    negatives: list[str]  # protocol A draws negatives from these: the responses of the *whole* split
    protocols: tuple[str, ...] = ("A", "B")
    retrievers: tuple[str, ...] = ("bi",)
    n_r: tuple[int, ...] = (10, 50, 100, 200)
    candidates: int = 100
    seed: int = 0
    device: str = "cpu"
    judge: str | None = ZERO_SHOT  # bi-encoder judging restatements (evaluation/restatement.py); None: skip
    guard_pairs: list[Pair] = field(default_factory=list)  # held-out pairs calibrating the guard
    guard_quantile: float | None = restatement.DEFAULT_QUANTILE  # None: protocol B without the guard
    prior_pairs: list[Pair] = field(default_factory=list)  # the response prior's reference; none: no prior
    # per test pair, texts protocol B may not answer (protocols.conversation_others: a pool without the
    # conversation being served); None: the pool as it is
    exclude: list[tuple[str, ...]] | None = None


def _row(name: str, ranks: list[float], **extra: Any) -> dict[str, Any]:
    return {"system": name, "metrics": summarize(ranks), "ranks": ranks, **extra}


def run_eval(spec: EvalSpec) -> dict[str, Any]:
    """Evaluate and return {'meta', 'A': [rows], 'B': [rows], 'sweep': [...]}; rows keep per-case ranks."""
    bi = load_bi(spec.bi, spec.device) if spec.bi else None
    cross = load_checkpoint(spec.cross, spec.device, expect="cross") if spec.cross else None
    residual_to = read_meta(spec.cross, verify=False)["extra"].get("residual_to") if spec.cross else None
    if residual_to and residual_to != getattr(bi, "content_hash", None):
        log.warning(
            "%s corrects retriever %s, not %s: its sum rows mean little",
            spec.cross,
            residual_to[:12],
            spec.bi,
        )
    bi_name = _label(spec.bi, "Bi")
    cross_name = _label(spec.cross, "Cross")
    poly_name = _label(spec.bi, "Poly")  # a Poly-encoder's code scores (its pooled vector is bi_name)
    result: dict[str, Any] = {"A": [], "B": [], "sweep": []}
    recall_test = partial(retrieve_and_rerank, spec.test, n_r=0, exclude=spec.exclude)  # (ranking, depth)
    contexts = [p.context for p in spec.test]
    judge = RestatementJudge(load_bi(spec.judge, spec.device)) if spec.judge else None

    def restates(answers: list[str | None]) -> dict[str, float]:
        return {"restates": round(judge.rate(contexts, answers), 2)} if judge else {}

    def retrieval_row(label: str, got: Retrieved) -> dict[str, Any]:
        return _row(
            label,
            ranks_for(spec.test, keys, got, "retrieval", depth),
            ms_per_case=round(1000 * got.retrieve_s / len(spec.test), 2),
            **restates(top_answers(spec.pool, got, "retrieval", depth)),
        )

    if judge:
        result["restatement"] = {
            "judge": spec.judge,
            "threshold": judge.threshold,
            "gold": restates([p.response for p in spec.test])["restates"],
        }
    candidates = 0
    if "A" in spec.protocols:
        lists = protocol_a_lists(spec.test, spec.negatives, spec.candidates, spec.seed)
        candidates = max(len(c) for c in lists)
        scored = evaluate_lists(spec.test, lists, bi, cross)  # type: ignore[arg-type]
        names = {"bi": bi_name, "poly": poly_name, "cross": cross_name}
        names["sum"] = f"{bi_name} + {cross_name} (sum)"
        result["A"] = [
            _row(names[k], v["ranks"], **restates([c[t] for c, t in zip(lists, v["top"], strict=True)]))
            for k, v in scored.items()
        ]
    if "B" in spec.protocols:
        keys = [normalize(t) for t in spec.pool]
        depth = max(max(KS), *spec.n_r)
        for retriever_name in spec.retrievers:
            if retriever_name == "bm25":
                retrieve, label = BM25Retriever(spec.pool), "BM25"
            else:
                if bi is None:
                    raise ValueError("retriever 'bi' needs --bi")
                retrieve, label = DenseRetriever(bi, spec.pool), bi_name  # type: ignore[assignment]
            t0 = time.perf_counter()
            recall = Pipeline(retrieve, spec.pool, keys)
            got = recall_test(recall, depth)
            # a bundle's recall, one addition at a time: each row, then the next; every rerank stage
            # reads the last (as served)
            if spec.guard_quantile is not None and spec.guard_pairs and retriever_name == "bi":
                result["B"].append(retrieval_row(label, got))
                guard = restatement.calibrate(
                    retrieve.encode_responses, spec.guard_pairs, spec.guard_quantile
                )
                recall = Pipeline(retrieve, spec.pool, keys, guard=restatement.Guard.of(guard))
                got = recall_test(recall, depth)
                if emptied := sum(not len(c.ids) for c in got.candidates):  # a model that scores all alike
                    log.warning(
                        "note: the restatement guard left %d of %d test contexts no candidate (its rows "
                        "count them as misses; --restatement-quantile off evaluates without it)",
                        emptied,
                        len(spec.test),
                    )
                label = f"{label} + guard"
                result.setdefault("restatement", {})["guard"] = guard
            if spec.prior_pairs and spec.guard_pairs and isinstance(retrieve, DenseRetriever):
                result["B"].append(retrieval_row(label, got))
                retrieve.prior, result["prior"] = prior.fit(
                    retrieve.encode_contexts,
                    retrieve.search,
                    retrieve.index.vectors.float().cpu().numpy(),
                    keys,
                    spec.prior_pairs,
                    spec.guard_pairs,
                )
                got = recall_test(recall, depth)
                label = f"{label} + prior"
            per_case_ms = 1000 * got.retrieve_s / len(spec.test)
            result["B"].append(retrieval_row(label, got))
            stages = []  # (name, pipeline) per rerank stage this retriever can feed
            if cross is not None:
                score = lambda c, r: cross.score_pairs(c, r).numpy()  # noqa: E731
                stages.append((cross_name, Pipeline(retrieve, spec.pool, keys, score)))
            if isinstance(retrieve, DenseRetriever) and isinstance(bi, PolyEncoder):
                stages.append((poly_name, Pipeline(retrieve, spec.pool, keys, poly=True)))
            valid_got = retrieve_and_rerank(spec.valid, recall, depth, 0) if spec.valid and stages else None
            for stage_name, stage in stages:
                reranked = rerank(spec.test, got, stage, max(spec.n_r))
                valid_reranked = rerank(spec.valid, valid_got, stage, max(spec.n_r)) if valid_got else None
                for n_r in spec.n_r:
                    # Rerank time scales with n_r: charge each n_r its share of the measured rerank time.
                    ms = per_case_ms + 1000 * reranked.rerank_s / len(spec.test) * n_r / max(spec.n_r)
                    weight = (
                        choose_zscore_weight(spec.valid, keys, valid_reranked, n_r)[0]
                        if valid_reranked
                        else ZSCORE_WEIGHT
                    )
                    for fusion, title in (
                        ("rerank", "rerank"),
                        ("sum", "sum"),
                        ("zscore", f"z-score w={weight:.1f}"),
                    ):
                        ranks = ranks_for(spec.test, keys, reranked, fusion, n_r, weight)
                        result["B"].append(
                            _row(
                                f"{label} → {stage_name} [{title}]",
                                ranks,
                                n_r=n_r,
                                fusion=fusion,
                                ms_per_case=round(ms, 2),
                                **restates(top_answers(spec.pool, reranked, fusion, n_r, weight)),
                            )
                        )
                        result["sweep"].append(
                            {
                                "system": f"{label} → {stage_name} [{fusion}]",
                                "n_r": n_r,
                                "hits@1": summarize(ranks)["hits@1"],
                                "ms_per_case": ms,
                            }
                        )
            print(f"  {label}: B done in {time.perf_counter() - t0:.0f}s", flush=True)
    result["meta"] = {
        "name": spec.name,
        "bi": spec.bi,
        "cross": spec.cross,
        "bi_hash": getattr(bi, "content_hash", None),
        "cross_hash": getattr(cross, "content_hash", None),
        "test_pairs": len(spec.test),
        "valid_pairs_for_calibration": len(spec.valid),
        "pool_size": len(spec.pool),
        "excluded_per_case": (
            None
            if spec.exclude is None
            else round(sum(map(len, spec.exclude)) / max(1, len(spec.exclude)), 2)
        ),
        "candidates_protocol_a": candidates or spec.candidates,
        "protocol_a_negative_pool": len(spec.negatives),
        "n_r": list(spec.n_r),
        "seed": spec.seed,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, device {spec.device}",
    }
    return result


def top_answers(
    pool: list[str], got: Retrieved, fusion: str, n_r: int, weight: float = ZSCORE_WEIGHT
) -> list[str | None]:
    """Each query's answer under a fusion: its best-ranked response (None if nothing was retrieved)."""
    return [pool[r[0]] if len(r) else None for r in ranked_ids(got, fusion, n_r, weight)]


def _label(path: str | None, kind: str) -> str:
    if path is None:
        return kind
    if path == ZERO_SHOT:
        return "zero-shot MiniLM"
    train_config = read_meta(path, verify=False).get("extra", {}).get("train_config", {})
    parts = [{"core": "CORE", "mutual": "mutual", "distill": "distill"}.get(train_config.get("mode", ""), "")]
    if train_config.get("hard_negatives"):
        parts.append("hard")
    if train_config.get("cross_residual"):
        parts.append("residual")  # its scores correct its retriever's: the 'sum' rows are the reranker
    if train_config.get("own_turn_negatives") or train_config.get("paraphrase_negatives"):
        parts.append("restate")  # restatement negatives (training/sampling.py)
    suffix = "+".join(p for p in parts if p)
    return f"{kind}-Enc ({suffix})" if suffix else f"{kind}-Enc"
