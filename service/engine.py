"""The request path: the bundle's :class:`~coreply.ranking.Pipeline` (recall, drop echoes and
exclusions, rerank, fuse, order), its two model stages run through two micro-batchers (retrieval:
encode + search; rerank: pairs), on one inference thread or, with ``overlap_stages``, one thread each."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from coreply import gate
from coreply.bundle import Bundle, default_fusion, make_backend, pipeline
from coreply.device import resolve_device, set_threads
from coreply.inference import Backend
from coreply.ranking import Candidates, Query, order
from coreply.responder import replies
from service.batching import MicroBatcher
from service.cascade import Cascade
from service.metrics import STAGES, Metrics
from service.settings import Settings


@dataclass(frozen=True)
class Job:
    query: Query
    top_k: int
    n_candidates: int
    fusion: str
    deadline: float | None = None  # time.perf_counter() value; queued work past it is dropped
    min_retrieval_score: float | None = None  # responses below it are dropped; none left: the fallback
    gated: bool = False  # the bundle's rerank gate and reach apply (no fusion named): a confident first
    # stage answers, else the reranker reads the candidates within the reach
    allow_variants: bool = False  # answers may be spelling variants of a better one ("heyy" after "Hey!")


class Engine:
    def __init__(
        self, bundle: Bundle, backend: Backend, threads: int, settings: Settings, metrics: Metrics
    ) -> None:
        self.bundle, self.backend, self.settings, self.metrics = bundle, backend, settings, metrics
        self.threads = threads  # intra-op threads of the backend
        self.active = 0  # requests in respond() now (a replaced engine stops when this reaches 0)
        self.pipeline = pipeline(bundle, backend)
        self.scopes: dict[str, np.ndarray] = {}  # API key name -> [N] bool it may be answered (the state's)
        self.default_fusion = default_fusion(bundle.manifest)
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
        # one inference thread for both stages, or one each (a batch is reranked while the next is
        # encoded and searched): see Settings.overlap_stages
        self.overlap_stages = settings.overlap_stages and not oversubscribes(backend, threads)
        retrieve_on = ThreadPoolExecutor(1, thread_name_prefix="coreply-retrieve")
        rerank_on = (
            ThreadPoolExecutor(1, thread_name_prefix="coreply-rerank") if self.overlap_stages else retrieve_on
        )
        self.executors = {retrieve_on, rerank_on}
        wait = settings.batch_wait_ms / 1000
        self.retriever = MicroBatcher(
            "retrieve",
            self._retrieve_batch,
            retrieve_on,
            settings.batch_max_contexts,
            wait,
            settings.queue_max,
        )
        self.reranker = MicroBatcher(
            "rerank", self._rerank_batch, rerank_on, settings.batch_max_pairs, wait, settings.queue_max
        )

    # ----------------------------------------------------------------- batch functions (inference thread)

    def _retrieve_batch(self, items: Sequence[tuple[Query, int]]):
        """[(query, n)] -> [Candidates], one encode and one search for the whole batch (and deeper ones for
        contexts the restatement guard left short, counted in the same stages); ``filter`` is the rest of
        recall (dropping echoes, exclusions and restatements)."""
        start = time.perf_counter()
        got = self.pipeline.recall([q for q, _ in items], [n for _, n in items])
        timings = dict(self.pipeline.timings)
        timings["filter"] = max(time.perf_counter() - start - sum(timings.values()), 0.0)
        return got, timings

    def _rerank_batch(self, items: Sequence[tuple[Query, Candidates, int]]):
        """[(query, candidates, n)] -> the candidates with rerank scores of their first n, all scored in
        one call."""
        start = time.perf_counter()
        candidates = [c for _, c, _ in items]
        queries = self.pipeline.ground([q for q, _, _ in items])
        grounded = time.perf_counter()
        self.pipeline.rerank(queries, candidates, [n for _, _, n in items])
        return candidates, {"knowledge": grounded - start, "rerank": time.perf_counter() - grounded}

    def describe(self) -> dict[str, Any]:
        """What this engine serves and how: ``/readyz``'s body and the log line of a start or reload."""
        bundle, pipeline, gating = self.bundle, self.pipeline, self.settings.rerank_gate
        return {
            "bundle_version": bundle.version,
            "responses": len(bundle.texts),
            "withdrawn": len(bundle.withdrawn),
            "filter_fields": sorted(bundle.filters.fields),
            "backend": self.backend.name,
            "reranker": pipeline.reranker,
            "rerank_gate": pipeline.gate if gating else None,
            "rerank_reach": pipeline.reach if gating else None,
            "restatement_guard": bundle.manifest.get("restatement"),
            "response_prior": bundle.manifest.get("prior"),
            "lexical": bundle.manifest.get("lexical"),
            "knowledge": {
                "reads": pipeline.reads_knowledge,
                "retriever": pipeline.select_knowledge is not None,
                "default_sentences": len(bundle.knowledge),
            },
            "threads": self.threads,
            "overlap_stages": self.overlap_stages,
        }

    # ------------------------------------------------------------------------------------ request path

    async def start(self) -> None:
        self.retriever.start()
        self.reranker.start()

    async def stop(self) -> None:
        await self.retriever.stop()
        await self.reranker.stop()
        for executor in self.executors:
            executor.shutdown(wait=True)

    async def retire(self, timeout_s: float) -> None:
        """Stop once the requests already using this engine are done (at most ``timeout_s``)."""
        deadline = time.perf_counter() + timeout_s
        while self.active and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        await self.stop()

    async def respond(self, job: Job) -> dict:
        self.active += 1
        try:
            return await self._respond(job)
        finally:
            self.active -= 1

    async def _respond(self, job: Job) -> dict:
        started = time.perf_counter()
        timings = dict.fromkeys(STAGES, 0.0)
        reranks = job.fusion != "retrieval"
        plan = self.cascade.plan(job.n_candidates, reranks, job.top_k) if self.cascade else None
        n_candidates = plan.n_candidates if plan else job.n_candidates
        fusion = "retrieval" if plan and plan.skip_rerank else job.fusion
        done = await self.retriever.submit((job.query, n_candidates), deadline=job.deadline)
        self._account(done, timings, "retrieve")
        candidates: Candidates = done.result
        reranked, gated = len(candidates.ids), False  # a named fusion reranks every candidate
        if job.gated and fusion != "retrieval":
            fusion, reranked = gate.gated(
                candidates, fusion, self.pipeline.gate, self.pipeline.reach, job.top_k
            )
            gated = fusion == "retrieval"
        if fusion != "retrieval" and reranked:
            done = await self.reranker.submit(
                (job.query, candidates, reranked), size=reranked, deadline=job.deadline
            )
            self._account(done, timings, "rerank")
        read = 0 if candidates.rerank is None else len(candidates.rerank)
        self.metrics.reranked.observe(read)
        positions, final = order(candidates, fusion, n_candidates, self.pipeline.weight, reranked)
        responses = [
            asdict(r) | {"metadata": r.metadata or None}
            for r in replies(self.bundle, candidates, positions, final, job.top_k, job.allow_variants)
        ]
        if responses:
            self.metrics.answer_score.observe(responses[0]["retrieval_score"])
        fallback = None
        if job.min_retrieval_score is not None:
            responses = [r for r in responses if r["retrieval_score"] >= job.min_retrieval_score]
        if not responses:  # none scored high enough, or a filter (or exclusions) allowed none
            fallback = self.settings.fallback_text
            self.metrics.fallbacks.inc()
        timings["total"] = time.perf_counter() - started
        if self.cascade is not None:
            self.cascade.observe(timings["queue_wait"])
            self.metrics.cascade_level.set(self.cascade.level)
        degraded = None
        if plan is not None and plan.level:
            self.metrics.degraded.inc()
            degraded = {
                "level": plan.level,
                "requested_candidates": job.n_candidates,
                "requested_fusion": job.fusion,
            }
        return {
            "responses": responses,
            "fusion": fusion,
            "rerank_gated": gated,
            "reranked": read,
            "n_candidates": len(candidates.ids),
            "bundle_version": self.bundle.version,
            "timings_ms": {name: round(1000 * s, 3) for name, s in timings.items()},
            "degraded": degraded,
            "fallback": fallback,
        }

    def _account(self, done, timings: dict[str, float], batcher: str) -> None:
        timings["queue_wait"] += done.queue_s
        self.metrics.stage.labels("queue_wait").observe(done.queue_s)
        for stage, seconds in done.stages.items():
            timings[stage] += seconds
            self.metrics.stage.labels(stage).observe(seconds)
        self.metrics.batch_items.labels(batcher).observe(done.batch_items)


def oversubscribes(backend: Backend, threads: int) -> bool:
    """Whether a thread per stage would put more OpenMP threads on the CPU than it has cores: both stages
    run PyTorch there, each thread with its own team of ``threads``. libgomp then stops spinning and every
    parallel region waits for its workers to wake (on 2 vCPUs a lone request at n_r 10 took 92 ms
    instead of 71; docs/performance.md §11), so such an engine keeps one inference thread."""
    return backend.cpu_torch and 2 * threads > (os.cpu_count() or 1)


def load_engine(settings: Settings, metrics: Metrics) -> Engine:
    """Load and verify the bundle, pick the thread count, build the engine (not yet started)."""
    from coreply.bundle import load_bundle, search_on

    device = str(resolve_device(settings.device))
    bundle = search_on(load_bundle(settings.bundle), device)
    if settings.threads:
        threads = settings.threads
        backend = make_backend(bundle, settings.backend, threads, device, settings.packed)
    else:
        backend, threads = fastest_backend(bundle, settings, device)
    return Engine(bundle, backend, threads, settings, metrics)


def fastest_backend(bundle: Bundle, settings: Settings, device: str) -> tuple[Backend, int]:
    """Time a typical request's model work with 1 thread and with every core; keep the faster backend."""
    cores = os.cpu_count() or 1
    candidates = [1] if cores == 1 or device != "cpu" else [1, cores]
    context = ["hi! how was your weekend?", "great, i went hiking in the hills. and you?"]
    texts = bundle.texts[: settings.default_candidates]
    timed = []
    for threads in candidates:
        backend = make_backend(bundle, settings.backend, threads, device, settings.packed)
        runs = []
        for _ in range(4):
            t = time.perf_counter()
            backend.encode_contexts([context])
            if backend.has_cross:
                backend.score_pairs([context] * len(texts), texts)
            runs.append(time.perf_counter() - t)
        timed.append((float(np.median(runs[1:])), threads, backend))
    _, threads, backend = min(timed, key=lambda t: t[0])
    set_threads(threads)  # process-wide, and make_backend set it for the last candidate tried
    return backend, threads
