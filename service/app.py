"""The FastAPI application, assembled: routes (service/routes.py), their dependencies (service/deps.py),
the error table (service/errors.py) and the runtime state (service/state.py), wrapped in :class:`Guard`.

The bundle is loaded in the lifespan (never at import) and must answer a golden query before
``/readyz`` turns ready; SIGHUP reloads it the same way beside the live one. No input can produce a
500: validation errors are 422 naming the field, bodies over the limit 413, a missing API key 401, a
full queue 503, a request still queued at its own deadline 504. Every request gets an
``X-Request-Id`` and one JSON access-log line; a W3C ``traceparent`` puts the caller's trace id in that
line and on the request-latency histogram as an exemplar."""

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from service import errors
from service.cors import cors_layer
from service.engine import Engine, load_engine
from service.logs import ACCESS, request_id, trace_context
from service.metrics import Metrics
from service.pages import install_pages
from service.routes import build_router
from service.schemas import respond_request_model
from service.settings import Settings
from service.state import ServiceState

ROUTES = ("/respond", "/healthz", "/readyz", "/metrics", "/docs", "/openapi.json", "/chat")


class Guard:
    """Outermost ASGI layer: refuses bodies over the limit (413) before the app reads them, counts
    requests by route and status class, times them and tracks the in-flight gauge. Whatever it answers,
    a 413 too, goes through the CORS layer (service/cors.py), so a page allowed to call the API can read
    its errors."""

    def __init__(self, app: Callable, state: ServiceState) -> None:
        self.state, self.settings, self.metrics = state, state.settings, state.metrics
        self.cors = cors_layer(self.settings.cors)
        self.app = self.cors(app)

    async def reload(self) -> bool:
        """Load the configured bundle beside the live one and swap if it verifies (service/state.py)."""
        return await self.state.reload()

    def begin_drain(self) -> None:
        """Shutdown has begun: ``/readyz`` answers 503 from now on, so load balancers stop sending;
        requests already admitted are still served while the server drains them."""
        self.state.begin_drain()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = {"code": 500}
        headers = dict(scope.get("headers", []))
        rid = request_id(headers.get(b"x-request-id", b"").decode("latin-1"))
        trace = trace_context(headers.get(b"traceparent", b"").decode("latin-1"))
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
                too_large = errors.BodyTooLarge(f"over the limit of {self.settings.max_body_bytes} bytes")
                await self.cors(errors.for_exception(too_large))(scope, receive, send_recording)
            else:
                await self.app(scope, _replay(body, receive), send_recording)
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.in_flight.dec()
            status_class = f"{status['code'] // 100}xx"
            self.metrics.requests.labels(route, status_class).inc()
            if "key" in note:  # a valid API key was presented (service/deps.py)
                self.metrics.key_requests.labels(note["key"], status_class).inc()
            exemplar = {"trace_id": trace["trace_id"]} if trace else None  # OpenMetrics scrapes only
            self.metrics.latency.labels(route).observe(elapsed, exemplar)
            fields = {"request_id": rid, "method": scope["method"], "route": route, "status": status["code"]}
            fields |= {**trace, "duration_ms": round(1000 * elapsed, 3), **note}
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


def create_app(
    settings: Settings | None = None,
    engine_factory: Callable[[Settings, Metrics], Engine] = load_engine,
) -> Guard:
    """The ASGI app (FastAPI wrapped in :class:`Guard`). The bundle loads when the server starts."""
    settings = settings or Settings()
    metrics = Metrics()
    request_model = respond_request_model(settings)
    state = ServiceState(settings, metrics, request_model, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        loop = asyncio.get_running_loop()
        no_signals = (AttributeError, NotImplementedError, RuntimeError, ValueError)
        with contextlib.suppress(*no_signals):  # main thread only (not under the test client); POSIX only
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(state.reload()))
        try:
            yield
        finally:
            with contextlib.suppress(*no_signals):
                loop.remove_signal_handler(signal.SIGHUP)
            await state.stop()

    app = FastAPI(
        title="coreply",
        summary="Response retrieval for chatbots: recall -> rerank -> fusion",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # served by install_pages from local assets
        redoc_url=None,  # ReDoc has no offline bundle on PyPI
    )
    errors.install(app)
    install_pages(app)
    app.include_router(build_router(settings, request_model))
    app.state.service = state
    return Guard(app, state)


__all__ = ["create_app"]
