"""The FastAPI application: ``POST /respond``, ``GET /healthz``, ``GET /readyz``, ``GET /metrics``.

The bundle is loaded in the lifespan (never at import) and must answer a golden query before
``/readyz`` turns ready; SIGHUP reloads it the same way beside the live one (see ``reload``). No input
can produce a 500: validation errors are 422 naming the field, bodies over the limit 413, a missing
API key 401, a full queue 503, a request still queued at its own deadline 504. Every request gets an
``X-Request-Id`` and one JSON access-log line."""

import asyncio
import contextlib
import hmac
import logging
import math
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coreply.ranking import Query
from service.batching import DeadlineExceeded, Overloaded
from service.engine import Engine, Job, load_engine
from service.logs import ACCESS, request_id
from service.metrics import Metrics
from service.schemas import ErrorResponse, RespondResponse, respond_request_model
from service.settings import Settings

LOG = logging.getLogger("coreply.service")
GOLDEN = ["hello! how are you?"]  # the warm-up request; a bundle must answer it before it serves
ROUTES = ("/respond", "/healthz", "/readyz", "/metrics", "/docs", "/openapi.json")


def _error(status: int, message: str, detail: list[dict] | None = None, **headers: str) -> JSONResponse:
    body = {"error": message} if detail is None else {"error": message, "detail": detail}
    return JSONResponse(body, status_code=status, headers=headers or None)


class Guard:
    """Outermost ASGI layer: refuses bodies over the limit (413) before the app reads them, counts
    requests by route and status class, times them and tracks the in-flight gauge."""

    def __init__(self, app: Callable, settings: Settings, metrics: Metrics) -> None:
        self.app, self.settings, self.metrics = app, settings, metrics

    async def reload(self) -> bool:
        """Load the configured bundle beside the live one and swap if it verifies (see create_app)."""
        return await self.app.state.reload()

    def begin_drain(self) -> None:
        """Shutdown has begun: ``/readyz`` answers 503 from now on, so load balancers stop sending;
        requests already admitted are still served while the server drains them."""
        self.app.state.coreply["draining"] = True
        self.metrics.ready.set(0)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = {"code": 500}
        given = next((v for k, v in scope.get("headers", []) if k == b"x-request-id"), b"")
        rid = request_id(given.decode("latin-1"))
        note: dict[str, Any] = {}  # what the route adds to the access log (timings, dialogue if enabled)
        scope.setdefault("state", {})["log"] = note

        async def send_recording(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                echo = (b"x-request-id", rid.encode())
                message = {**message, "headers": [*message.get("headers", []), echo]}
            await send(message)

        started = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            if scope["method"] not in ("POST", "PUT", "PATCH"):
                await self.app(scope, receive, send_recording)
            elif (body := await self._read_body(receive)) is None:
                limit = self.settings.max_body_bytes
                await _error(413, f"request body over the limit of {limit} bytes")(
                    scope, receive, send_recording
                )
            else:
                await self.app(scope, _replay(body, receive), send_recording)
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, f"{status['code'] // 100}xx").inc()
            self.metrics.latency.labels(route).observe(elapsed)
            fields = {"request_id": rid, "method": scope["method"], "route": route, "status": status["code"]}
            fields |= {"duration_ms": round(1000 * elapsed, 3), **note}
            ACCESS.info("request", extra={"fields": fields})

    async def _read_body(self, receive: Callable) -> bytes | None:
        """The whole body, or None as soon as it exceeds the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.settings.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive: Callable) -> Callable:
    """A ``receive`` that yields the already-read body once, then the server's own messages."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class Unauthorized(Exception):
    """No API key, or not one of the configured ones (401)."""


def key_check(settings: Settings, route: str) -> Callable:
    """A dependency that enforces the API keys on ``route`` unless keys are off or the route is public.
    Every configured key is compared, in constant time, so timing reveals neither a key nor which one."""
    keys = [k.encode() for k in settings.keys]
    if not keys or route in settings.public:

        async def open_route() -> None:
            return None

        return open_route

    async def check(request: Request) -> None:
        auth = request.headers.get("authorization", "")
        given = (auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")).encode()
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise Unauthorized()

    return check


def _field(loc: tuple | list) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


def create_app(settings: Settings | None = None, engine_factory: Callable[..., Engine] = load_engine) -> Any:
    """The ASGI app (FastAPI wrapped in :class:`Guard`). The bundle loads when the server starts."""
    settings = settings or Settings()
    metrics = Metrics()
    request_model = respond_request_model(settings)
    state: dict[str, Any] = {"engine": None, "ready": False, "draining": False}

    async def warm(engine: Engine) -> None:
        """The golden query: the engine must answer it with finite scores (this also warms it up)."""
        answer = await engine.respond(_job(request_model(context=GOLDEN), engine))
        if not answer["responses"] or not all(math.isfinite(r["score"]) for r in answer["responses"]):
            raise RuntimeError(f"bundle {engine.bundle.version} gave no usable answer to the golden query")

    async def open_engine() -> Engine:
        """Load, verify (hashes, dimension, count, models), start and warm an engine."""
        loop = asyncio.get_running_loop()
        engine = await loop.run_in_executor(None, engine_factory, settings, metrics)
        await engine.start()
        try:
            await warm(engine)
        except BaseException:
            await engine.stop()
            raise
        return engine

    reloading = asyncio.Lock()

    async def reload() -> bool:
        """Hot reload: the bundle at ``settings.bundle`` (e.g. a ``current`` symlink moved to a new
        version) is loaded beside the live one, verified and warmed, then swapped in; requests already
        running finish on the old one. On any failure the old bundle keeps serving, and the metric
        ``coreply_reloads_total{result="failed"}`` and the log say why."""
        async with reloading:
            old = state["engine"]
            try:
                new = await open_engine()
            except Exception as exc:
                metrics.reloads.labels("failed").inc()
                fields = {"error": f"{type(exc).__name__}: {exc}", "serving": old.bundle.version}
                LOG.error("reload failed, still serving the previous bundle", extra={"fields": fields})
                return False
            state["engine"] = new
            metrics.bundle.remove(old.bundle.version)
            metrics.bundle.labels(new.bundle.version).set(1)
            metrics.reloads.labels("ok").inc()
            LOG.info("reloaded", extra={"fields": {"old": old.bundle.version, "new": new.bundle.version}})
            await old.retire(settings.drain_seconds)
            return True

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = await open_engine()
        state["engine"] = engine
        metrics.bundle.labels(engine.bundle.version).set(1)
        state["ready"] = True
        metrics.ready.set(0 if state["draining"] else 1)
        loop = asyncio.get_running_loop()
        no_signals = (AttributeError, NotImplementedError, RuntimeError, ValueError)
        with contextlib.suppress(*no_signals):  # main thread only (not under the test client); POSIX only
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(reload()))
        try:
            yield
        finally:
            state["ready"] = False
            metrics.ready.set(0)
            with contextlib.suppress(*no_signals):
                loop.remove_signal_handler(signal.SIGHUP)
            await state["engine"].stop()

    app = FastAPI(
        title="coreply",
        summary="Response retrieval for chatbots: recall -> rerank -> fusion",
        version="0.1.0",
        lifespan=lifespan,
    )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        detail = [
            {
                "field": "body" if e.get("type") == "json_invalid" else _field(e.get("loc", ())),
                "message": e.get("msg", ""),
                "type": e.get("type", ""),
            }
            for e in exc.errors()
        ]
        first = detail[0] if detail else {"field": "body", "message": "invalid request"}
        return _error(422, f"{first['field']}: {first['message']}", detail)

    @app.exception_handler(Unauthorized)
    async def unauthorized(request: Request, exc: Unauthorized) -> JSONResponse:
        return _error(401, "missing or invalid API key", **{"WWW-Authenticate": "Bearer"})

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug: say so, keep serving
        return _error(500, f"internal error ({type(exc).__name__}); this is a bug, please report it")

    @app.post(
        "/respond",
        response_model=RespondResponse,
        responses={
            401: {"model": ErrorResponse},
            413: {"model": ErrorResponse},
            422: {"model": ErrorResponse},
            503: {"model": ErrorResponse},
            504: {"model": ErrorResponse},
        },
        dependencies=[Depends(key_check(settings, "/respond"))],
    )
    async def respond(
        body: request_model,  # type: ignore[valid-type]
        request: Request,
        timeout_ms: int | None = Header(
            None,
            alias="X-Request-Timeout-Ms",
            ge=1,
            le=600_000,
            description="drop the request with 504 if it is still queued after this many ms",
        ),
    ) -> Any:
        budget_ms = timeout_ms or settings.request_timeout_ms
        deadline = time.perf_counter() + budget_ms / 1000 if budget_ms else None
        note = request.state.log
        if settings.log_text:
            note["context"] = body.context
        engine: Engine | None = state["engine"]
        if engine is None or not state["ready"]:
            return _error(503, "not ready: the bundle is loading", **{"Retry-After": "1"})
        if body.fusion in ("rerank", "sum", "zscore") and not engine.backend.has_reranker:
            return _error(422, f"fusion: {body.fusion!r} needs a reranker and this bundle has none")
        try:
            result = await engine.respond(_job(body, engine, deadline))
        except Overloaded as exc:
            return _error(503, f"overloaded: {exc}", **{"Retry-After": "1"})
        except DeadlineExceeded as exc:
            return _error(504, f"deadline exceeded: {exc}")
        note["timings_ms"] = result["timings_ms"]
        if settings.log_text:
            note["responses"] = [r["text"] for r in result["responses"]]
        return result

    @app.get("/healthz", dependencies=[Depends(key_check(settings, "/healthz"))])
    async def healthz() -> dict:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get(
        "/readyz",
        responses={503: {"model": ErrorResponse}},
        dependencies=[Depends(key_check(settings, "/readyz"))],
    )
    async def readyz() -> Any:
        """Readiness: the bundle is loaded, verified and warmed up, and the server is not shutting down."""
        engine = state["engine"]
        if state["draining"]:
            return _error(503, "shutting down")
        if not state["ready"] or engine is None:
            return _error(503, "not ready")
        return {
            "status": "ready",
            "bundle_version": engine.bundle.version,
            "responses": len(engine.bundle.texts),
            "backend": engine.backend.name,
            "reranker": engine.backend.has_reranker,
            "threads": engine.threads,
        }

    @app.get(
        "/metrics", response_class=PlainTextResponse, dependencies=[Depends(key_check(settings, "/metrics"))]
    )
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition format."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.coreply = state
    app.state.metrics = metrics
    app.state.reload = reload
    return Guard(app, settings, metrics)


def _job(body: Any, engine: Engine, deadline: float | None = None) -> Job:
    settings = engine.settings
    n = body.n_candidates or max(settings.default_candidates, body.top_k)
    if body.top_k > n:
        raise RequestValidationError(
            [
                {
                    "loc": ("body", "top_k"),
                    "msg": f"top_k ({body.top_k}) exceeds n_candidates ({n})",
                    "type": "value_error",
                }
            ]
        )
    query = Query(
        context=tuple(body.context),
        exclude_texts=tuple(x for x in body.exclude if isinstance(x, str)),
        exclude_ids=frozenset(x for x in body.exclude if isinstance(x, int)),
    )
    return Job(query, body.top_k, n, body.fusion or engine.default_fusion, deadline)


__all__ = ["create_app"]
