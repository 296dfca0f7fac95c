"""The request path: encode the context, recall top-n by inner product, drop echoes and exclusions,
rerank with the cross-encoder, fuse, answer. Model work runs on one inference thread through two
micro-batchers (retrieval: encode + search; rerank: pairs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from coreply.bundle import Bundle, make_backend
from coreply.fusion import drop_blocked, fuse
from coreply.inference import Backend
from service.batching import MicroBatcher
from service.cascade import Cascade
from service.metrics import Metrics
from service.settings import Settings


@dataclass(frozen=True)
class Query:
    context: list[str]
    top_k: int
    n_candidates: int
    fusion: str
    exclude_ids: frozenset[int]
    exclude_texts: tuple[str, ...]
    deadline: float | None = None  # time.perf_counter() value; queued work past it is dropped


class Engine:
    def __init__(
        self, bundle: Bundle, backend: Backend, threads: int, settings: Settings, metrics: Metrics
    ) -> None:
        self.bundle, self.backend, self.settings, self.metrics = bundle, backend, settings, metrics
        self.threads = threads  # intra-op threads of the backend
        self.active = 0  # requests in respond() now (a replaced engine stops when this reaches 0)
        self.zscore_weight = float(bundle.manifest.get("fusion", {}).get("zscore_weight", 0.5))
        self.default_fusion = "zscore" if backend.has_reranker else "retrieval"
        self.cascade = (
            Cascade(
                settings.cascade_high_ms,
                settings.cascade_low_ms,
                settings.cascade_floor_candidates,
                settings.cascade_skip_rerank,
                settings.cascade_step_s,
            )
            if settings.cascade
            else None
        )
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="coreply-infer")
        wait = settings.batch_wait_ms / 1000
        self.retriever = MicroBatcher(
            "retrieve",
            self._retrieve_batch,
            self.executor,
            settings.batch_max_contexts,
            wait,
            settings.queue_max,
        )
        self.reranker = MicroBatcher(
            "rerank", self._rerank_batch, self.executor, settings.batch_max_pairs, wait, settings.queue_max
        )

    # ----------------------------------------------------------------- batch functions (inference thread)

    def _retrieve_batch(self, items: Sequence[tuple[list[str], int]]):
        """[(context, k)] -> [(ids [k], scores [k])], one encode and one search for the whole batch."""
        start = time.perf_counter()
        queries = self.backend.encode_contexts([c for c, _ in items])  # [B, D]
        encoded = time.perf_counter()
        k = min(max(k for _, k in items), self.bundle.index.ntotal)
        scores, ids = self.bundle.index.search(np.ascontiguousarray(queries, dtype="float32"), k)  # [B, k]
        searched = time.perf_counter()
        results = [(ids[i, :want], scores[i, :want]) for i, (_, want) in enumerate(items)]
        return results, {"encode": encoded - start, "search": searched - encoded}

    def _rerank_batch(self, items: Sequence[tuple[list[str], list[str]]]):
        """[(context, candidate texts)] -> [scores [n]], all pairs scored together, sorted by length."""
        start = time.perf_counter()
        contexts = [c for c, texts in items for _ in texts]
        responses = [t for _, texts in items for t in texts]
        flat = self.backend.score_pairs(contexts, responses) if responses else np.zeros(0, dtype="float32")
        out, offset = [], 0
        for _, texts in items:
            out.append(flat[offset : offset + len(texts)])
            offset += len(texts)
        return out, {"rerank": time.perf_counter() - start}

    # ------------------------------------------------------------------------------------ request path

    async def start(self) -> None:
        self.retriever.start()
        self.reranker.start()

    async def stop(self) -> None:
        await self.retriever.stop()
        await self.reranker.stop()
        self.executor.shutdown(wait=True)

    async def retire(self, timeout_s: float) -> None:
        """Stop once the requests already using this engine are done (at most ``timeout_s``)."""
        deadline = time.perf_counter() + timeout_s
        while self.active and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        await self.stop()

    async def respond(self, query: Query) -> dict:
        self.active += 1
        try:
            return await self._respond(query)
        finally:
            self.active -= 1

    async def _respond(self, query: Query) -> dict:
        started = time.perf_counter()
        timings = {"queue_wait": 0.0, "encode": 0.0, "search": 0.0, "rerank": 0.0}
        reranks = query.fusion != "retrieval"
        plan = self.cascade.plan(query.n_candidates, reranks, query.top_k) if self.cascade else None
        n_candidates = plan.n_candidates if plan else query.n_candidates
        fusion = "retrieval" if plan and plan.skip_rerank else query.fusion
        blocked = (*query.context, *query.exclude_texts)
        # the pool holds each normalised text once, so each blocked text or id hides at most one hit
        k = n_candidates + len(blocked) + len(query.exclude_ids)
        done = await self.retriever.submit((list(query.context), k), deadline=query.deadline)
        self._account(done, timings, "retrieve")
        ids, retrieval = drop_blocked(*done.result, self.bundle.keys, blocked, query.exclude_ids)
        ids, retrieval = ids[:n_candidates], retrieval[:n_candidates].astype("float64")
        rerank: np.ndarray | None = None
        if fusion != "retrieval" and len(ids):
            texts = [self.bundle.texts[i] for i in ids]
            done = await self.reranker.submit(
                (list(query.context), texts), size=len(texts), deadline=query.deadline
            )
            self._account(done, timings, "rerank")
            rerank = done.result.astype("float64")
            self.metrics.reranked.observe(len(texts))
        else:
            self.metrics.reranked.observe(0)
        final = retrieval if rerank is None else fuse(fusion, retrieval, rerank, self.zscore_weight)
        order = np.argsort(-final, kind="stable")[: query.top_k]
        responses = [
            {
                "id": int(ids[j]),
                "text": self.bundle.texts[ids[j]],
                "score": float(final[j]),
                "retrieval_score": float(retrieval[j]),
                "rerank_score": None if rerank is None else float(rerank[j]),
            }
            for j in order
        ]
        timings["total"] = time.perf_counter() - started
        if self.cascade is not None:
            self.cascade.observe(timings["queue_wait"])
            self.metrics.cascade_level.set(self.cascade.level)
        degraded = None
        if plan is not None and plan.level:
            self.metrics.degraded.inc()
            degraded = {
                "level": plan.level,
                "requested_candidates": query.n_candidates,
                "requested_fusion": query.fusion,
            }
        return {
            "responses": responses,
            "fusion": fusion,
            "n_candidates": len(ids),
            "bundle_version": self.bundle.version,
            "timings_ms": {name: round(1000 * s, 3) for name, s in timings.items()},
            "degraded": degraded,
        }

    def _account(self, done, timings: dict[str, float], batcher: str) -> None:
        timings["queue_wait"] += done.queue_s
        self.metrics.stage.labels("queue_wait").observe(done.queue_s)
        for stage, seconds in done.stages.items():
            timings[stage] += seconds
            self.metrics.stage.labels(stage).observe(seconds)
        self.metrics.batch_items.labels(batcher).observe(done.batch_items)


def load_engine(settings: Settings, metrics: Metrics) -> Engine:
    """Load and verify the bundle, pick the thread count, build the engine (not yet started)."""
    from coreply.bundle import load_bundle, search_on

    bundle = search_on(load_bundle(settings.bundle), settings.device)
    if settings.threads:
        threads = settings.threads
        backend = make_backend(bundle, settings.backend, threads, settings.device)
    else:
        backend, threads = fastest_backend(bundle, settings)
    return Engine(bundle, backend, threads, settings, metrics)


def fastest_backend(bundle: Bundle, settings: Settings) -> tuple[Backend, int]:
    """Time a typical request's model work with 1 thread and with every core; keep the faster backend."""
    import os

    cores = os.cpu_count() or 1
    candidates = [1] if cores == 1 or settings.device != "cpu" else [1, cores]
    context = ["hi! how was your weekend?", "great, i went hiking in the hills. and you?"]
    texts = bundle.texts[: settings.default_candidates]
    timed = []
    for threads in candidates:
        backend = make_backend(bundle, settings.backend, threads, settings.device)
        runs = []
        for _ in range(4):
            t = time.perf_counter()
            backend.encode_contexts([context])
            if backend.has_reranker:
                backend.score_pairs([context] * len(texts), texts)
            runs.append(time.perf_counter() - t)
        timed.append((float(np.median(runs[1:])), threads, backend))
    _, threads, backend = min(timed, key=lambda t: t[0])
    import torch

    torch.set_num_threads(threads)  # process-wide, and make_backend set it for the last candidate tried
    return backend, threads
