"""The service's runtime state: the live engine, readiness, draining, and hot reload.

An engine must answer a golden query with finite scores before it serves, at start-up and on reload.
A reload loads the configured bundle (e.g. a ``current`` symlink moved to a new version) beside the
live one, verifies and warms it, then swaps it in; requests already running finish on the old one. On
any failure the old bundle keeps serving, and ``coreply_reloads_total{result="failed"}`` and the log
say why. A bundle of the live one's version (which covers its files and choices) is verified and left
as it is: ``result="unchanged"``."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi.exceptions import RequestValidationError

from coreply.bundle import read_manifest
from coreply.device import on_own_thread
from coreply.filters import FilterError
from coreply.ranking import Query
from service.engine import Engine, Job
from service.keys import Admission, ApiKey
from service.metrics import Metrics
from service.settings import Settings

LOG = logging.getLogger("coreply.service")
GOLDEN = ["hello! how are you?"]  # the warm-up request; a bundle must answer it before it serves


def make_job(body: Any, engine: Engine, deadline: float | None = None, key: ApiKey | None = None) -> Job:
    """A validated request body as the engine's job; ``top_k`` over ``n_candidates`` is a 422. A scoped
    ``key`` (service/keys.py) allows only what its filter does, whatever the body's own filter says."""
    n = body.n_candidates or max(engine.settings.default_candidates, body.top_k)
    if body.top_k > n:
        msg = f"top_k ({body.top_k}) exceeds n_candidates ({n})"
        raise RequestValidationError([{"loc": ("body", "top_k"), "msg": msg, "type": "value_error"}])
    if body.knowledge and not engine.pipeline.reads_knowledge:
        msg = "this bundle's reranker does not read knowledge (build one with `coreply ground train`)"
        raise RequestValidationError([{"loc": ("body", "knowledge"), "msg": msg, "type": "value_error"}])
    try:
        allow = None if body.filter is None else engine.bundle.filters.allowed(body.filter)
    except FilterError as exc:
        loc = ("body", "filter", exc.field)
        raise RequestValidationError([{"loc": loc, "msg": exc.message, "type": "value_error"}]) from None
    if key is not None and (scope := engine.scopes.get(key.name)) is not None:
        allow = scope if allow is None else allow & scope
    query = Query(
        context=tuple(body.context),
        exclude_texts=tuple(x for x in body.exclude if isinstance(x, str)),
        exclude_ids=frozenset(x for x in body.exclude if isinstance(x, int)),
        knowledge=tuple(engine.bundle.knowledge if body.knowledge is None else body.knowledge),
        allow_restatements=body.allow_restatements,
        allow=allow,
    )
    fusion = body.fusion or engine.default_fusion
    gated = body.fusion is None and engine.settings.rerank_gate
    return Job(query, body.top_k, n, fusion, deadline, body.min_retrieval_score, gated)


class ServiceState:
    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        request_model: type,
        engine_factory: Callable[[Settings, Metrics], Engine],
    ) -> None:
        self.settings, self.metrics = settings, metrics
        self.request_model, self.engine_factory = request_model, engine_factory
        self.engine: Engine | None = None
        self.ready = False
        self.draining = False
        self.admission = Admission()  # each API key's requests in flight, against its limit
        self._reloading = asyncio.Lock()

    async def _warm(self, engine: Engine) -> None:
        golden = self.request_model(context=GOLDEN, min_retrieval_score=None)  # the model, not the threshold
        answer = await engine.respond(make_job(golden, engine))
        if not answer["responses"] or not all(math.isfinite(r["score"]) for r in answer["responses"]):
            raise RuntimeError(f"bundle {engine.bundle.version} gave no usable answer to the golden query")

    async def _open(self) -> Engine:
        """Load, verify (hashes, dimension, count, models), start and warm an engine."""
        loop = asyncio.get_running_loop()
        engine = await loop.run_in_executor(
            None, on_own_thread, self.engine_factory, self.settings, self.metrics
        )
        await engine.start()
        try:
            await self._warm(engine)
        except BaseException:
            await engine.stop()
            raise
        return engine

    def _publish(self, engine: Engine, old: Engine | None = None) -> None:
        """The loaded bundle in the metrics: its version, and its pool's answerable and withdrawn counts."""
        if old is not None:
            self.metrics.bundle.remove(old.bundle.version)
        bundle = engine.bundle
        self.metrics.bundle.labels(bundle.version).set(1)
        self.metrics.pool.labels("answerable").set(len(bundle.texts) - len(bundle.withdrawn))
        self.metrics.pool.labels("withdrawn").set(len(bundle.withdrawn))
        if engine.scopes:  # what each scoped API key may be answered with in this pool
            allowed = {name: int(mask.sum()) for name, mask in engine.scopes.items()}
            LOG.info("API key scopes", extra={"fields": {"bundle": bundle.version, "responses": allowed}})
            if none := sorted(name for name, n in allowed.items() if not n):
                LOG.warning(
                    "API keys whose filter allows no response of this pool: their answers are the fallback",
                    extra={"fields": {"bundle": bundle.version, "keys": none}},
                )

    async def start(self) -> None:
        self.engine = await self._open()
        self._publish(self.engine)
        self.ready = True
        self.metrics.ready.set(0 if self.draining else 1)

    async def stop(self) -> None:
        self.ready = False
        self.metrics.ready.set(0)
        if self.engine is not None:
            await self.engine.stop()

    def begin_drain(self) -> None:
        """``/readyz`` answers 503 from now on; requests already admitted are still served."""
        self.draining = True
        self.metrics.ready.set(0)

    async def reload(self) -> bool:
        """Swap in the configured bundle if it loads, verifies and warms; else keep the live one. True
        when the configured bundle is served afterwards (swapped in, or already the live one)."""
        async with self._reloading:
            old = self.engine
            assert old is not None
            loop = asyncio.get_running_loop()
            try:
                if await loop.run_in_executor(None, is_version, self.settings.bundle, old.bundle.version):
                    self.metrics.reloads.labels("unchanged").inc()
                    LOG.info(
                        "reload: the bundle is the one serving",
                        extra={"fields": {"serving": old.bundle.version}},
                    )
                    return True
                new = await self._open()
            except Exception as exc:
                self.metrics.reloads.labels("failed").inc()
                fields = {"error": f"{type(exc).__name__}: {exc}", "serving": old.bundle.version}
                LOG.error("reload failed, still serving the previous bundle", extra={"fields": fields})
                return False
            self.engine = new
            self._publish(new, old)
            self.metrics.reloads.labels("ok").inc()
            LOG.info("reloaded", extra={"fields": {"old": old.bundle.version, "new": new.bundle.version}})
            await old.retire(self.settings.drain_seconds)
            return True

    def deadline(self, timeout_ms: int | None) -> float | None:
        """The request's deadline (``time.perf_counter()``) from its header or the default; None = none."""
        budget_ms = timeout_ms or self.settings.request_timeout_ms
        return time.perf_counter() + budget_ms / 1000 if budget_ms else None


def is_version(root: Path, version: str) -> bool:
    """Whether the bundle at ``root`` is ``version``, its files verified (a BundleError if they are not):
    its manifest is read first without hashing, so a new version costs no second pass over its files."""
    if read_manifest(root, verify=False)["bundle_version"] != version:
        return False
    read_manifest(root)
    return True
