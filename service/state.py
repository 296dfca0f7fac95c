"""The service's runtime state: the live engine, readiness, draining, and hot reload.

An engine must answer a golden query with finite scores before it serves, at start-up and on reload.
A reload loads the configured bundle (e.g. a ``current`` symlink moved to a new version) beside the
live one, verifies and warms it, then swaps it in; requests already running finish on the old one. On
any failure the old bundle keeps serving, and ``coreply_reloads_total{result="failed"}`` and the log
say why. A bundle of the live one's version (which covers its files and choices) is verified and left
as it is: ``result="unchanged"``.

A reload reads the API keys again too (``COREPLY_API_KEYS_FILE``), so a key is added, withdrawn or
rescoped without a restart. The new keys and their scopes take effect together, with the bundle they are
checked against; a key file with any wrong entry, or a scope the bundle cannot read, fails the whole
reload and the live keys and bundle keep serving."""

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
from service.errors import Unauthorized
from service.keys import Admission, ApiKey, KeyRing, scope_masks
from service.metrics import Metrics
from service.settings import Settings
from service.tls import Certificate, expiry_warning

LOG = logging.getLogger("coreply.service")
GOLDEN = ["hello! how are you?"]  # the warm-up request; a bundle must answer it before it serves


def make_job(body: Any, engine: Engine, deadline: float | None = None, key: ApiKey | None = None) -> Job:
    """A validated request body as the engine's job; ``top_k`` over ``n_candidates`` is a 422. A scoped
    ``key`` (service/keys.py) allows only what its filter does, whatever the body's own filter says; one
    that a reload withdrew after it was checked is a 401, never an answer from the whole pool."""
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
    elif key is not None and key.scope is not None:
        raise Unauthorized(f"the API key {key.name!r} was withdrawn")
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
    return Job(query, body.top_k, n, fusion, deadline, body.min_retrieval_score, gated, body.allow_variants)


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
        self.keys: KeyRing = settings.keys  # the live API keys; a reload reads them again
        cert, key = settings.tls_cert_file, settings.tls_key_file
        self.tls = None if cert is None else Certificate(cert, key)  # HTTPS; a reload reads it again
        if self.tls is not None:
            metrics.tls_expiry.set(self.tls.not_after)
        self.ready = False
        self.draining = False
        self.admission = Admission()  # each API key's requests in flight, against its limit
        self._reloading = asyncio.Lock()

    async def _warm(self, engine: Engine) -> None:
        """The golden query through ``engine``, counted in no metric: it is not traffic, and its first pass,
        the slowest an engine makes, would reach the stage latencies at every start and reload."""
        golden = self.request_model(context=GOLDEN, min_retrieval_score=None)  # the model, not the threshold
        live, engine.metrics = engine.metrics, Metrics()  # a registry of its own, never scraped
        try:
            answer = await engine.respond(make_job(golden, engine))
        finally:
            engine.metrics = live
        if not answer["responses"] or not all(math.isfinite(r["score"]) for r in answer["responses"]):
            raise RuntimeError(f"bundle {engine.bundle.version} gave no usable answer to the golden query")

    async def _open(self, keys: KeyRing) -> Engine:
        """Load, verify (hashes, dimension, count, models), scope for ``keys``, start and warm an engine."""

        def load() -> Engine:
            engine = self.engine_factory(self.settings, self.metrics)
            engine.scopes = scope_masks(keys, engine.bundle.filters)
            return engine

        engine = await asyncio.get_running_loop().run_in_executor(None, on_own_thread, load)
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
        _log_scopes(engine)

    async def start(self) -> None:
        started = time.perf_counter()
        self.engine = await self._open(self.keys)
        self._publish(self.engine)
        self.ready = True
        self.metrics.ready.set(0 if self.draining else 1)
        fields = {"load_s": round(time.perf_counter() - started, 2), **self.engine.describe()}
        tls = None if self.tls is None else self.tls.describe()
        fields |= {"tls": tls, "api_keys": sorted({k.name for k in self.keys.keys})}  # names, never keys
        LOG.info("serving", extra={"fields": fields})
        _warn_expiry(self.tls)

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
        """Swap in the configured bundle, API keys and (with HTTPS) certificate if they load, verify and
        warm; else keep the live ones, all of them. True when the configured ones are served afterwards
        (swapped in, or already live)."""
        async with self._reloading:
            old = self.engine
            assert old is not None
            loop = asyncio.get_running_loop()
            try:
                keys = await loop.run_in_executor(None, self.settings.read_keys)
                renewal = None if self.tls is None else await loop.run_in_executor(None, self.tls.read)
                same = await loop.run_in_executor(None, is_version, self.settings.bundle, old.bundle.version)
                rekeyed = keys.keys != self.keys.keys
                if not same:
                    new = await self._open(keys)
                elif rekeyed:
                    scopes = await loop.run_in_executor(None, scope_masks, keys, old.bundle.filters)
            except Exception as exc:
                self.metrics.reloads.labels("failed").inc()
                fields = {"error": f"{type(exc).__name__}: {exc}", "serving": old.bundle.version}
                LOG.error(
                    "reload failed, still serving the bundle, API keys and certificate served before it",
                    extra={"fields": fields},
                )
                return False
            if renewal is not None and self.tls is not None:
                self.tls.use(renewal)
                self.metrics.tls_expiry.set(renewal.not_after)
                LOG.info("reloaded the TLS certificate", extra={"fields": self.tls.describe()})
            _warn_expiry(self.tls)  # renewed or not: a SIGHUP that loads no renewal is told so
            if rekeyed:
                self._swap_keys(keys)
                if same:
                    old.scopes = scopes  # no await since the swap: a request sees both or neither
                    _log_scopes(old)
            if same:
                result = "ok" if rekeyed or renewal is not None else "unchanged"
                self.metrics.reloads.labels(result).inc()
                if result == "unchanged":
                    LOG.info(
                        "reload: the bundle, the API keys and the certificate are the ones serving",
                        extra={"fields": {"serving": old.bundle.version}},
                    )
                return True
            self.engine = new
            self._publish(new, old)
            self.metrics.reloads.labels("ok").inc()
            LOG.info("reloaded", extra={"fields": {"old": old.bundle.version, **new.describe()}})
            await old.retire(self.settings.drain_seconds)
            return True

    def _swap_keys(self, keys: KeyRing) -> None:
        """Serve ``keys`` from now on, and log which names came, went or changed (never the keys)."""
        old, new = ({k.name: k for k in ring.keys} for ring in (self.keys, keys))
        fields = {
            "added": sorted(new.keys() - old.keys()),
            "withdrawn": sorted(old.keys() - new.keys()),
            "changed": sorted(n for n in new.keys() & old.keys() if new[n] != old[n]),
        }
        self.keys = keys
        LOG.info("reloaded the API keys", extra={"fields": fields})

    def deadline(self, timeout_ms: int | None) -> float | None:
        """The request's deadline (``time.perf_counter()``) from its header or the default; None = none."""
        budget_ms = timeout_ms or self.settings.request_timeout_ms
        return time.perf_counter() + budget_ms / 1000 if budget_ms else None


def _warn_expiry(tls: Certificate | None) -> None:
    """A warning in the log when the certificate served has expired or soon will (the alert may be unset)."""
    if tls is not None and (message := expiry_warning(tls.not_after, time.time())):
        LOG.warning(message, extra={"fields": tls.describe()})


def _log_scopes(engine: Engine) -> None:
    """What each scoped API key may be answered with in this engine's pool; a warning for none."""
    if not engine.scopes:
        return
    version = engine.bundle.version
    allowed = {name: int(mask.sum()) for name, mask in engine.scopes.items()}
    LOG.info("API key scopes", extra={"fields": {"bundle": version, "responses": allowed}})
    if none := sorted(name for name, n in allowed.items() if not n):
        LOG.warning(
            "API keys whose filter allows no response of this pool: their answers are the fallback",
            extra={"fields": {"bundle": version, "keys": none}},
        )


def is_version(root: Path, version: str) -> bool:
    """Whether the bundle at ``root`` is ``version``, its files verified (a BundleError if they are not):
    its manifest is read first without hashing, so a new version costs no second pass over its files."""
    if read_manifest(root, verify=False)["bundle_version"] != version:
        return False
    read_manifest(root)
    return True
