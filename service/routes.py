"""The routes: ``POST /respond``, ``GET /healthz``, ``GET /readyz``, ``GET /metrics``. Thin: validation
is the request model's, errors are raised as domain errors (service/errors.py), the work is the
engine's. (No ``from __future__ import annotations``: FastAPI must see the body model, built
per settings, as a class.)"""

from typing import Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client.exposition import choose_encoder

from service.deps import EngineDep, StateDep, key_check
from service.errors import NeedsReranker, NotReady, ShuttingDown
from service.schemas import ErrorResponse, RespondResponse
from service.settings import Settings
from service.state import make_job


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` entry for these error statuses."""
    return {code: {"model": ErrorResponse} for code in codes}


def build_router(settings: Settings, request_model: type) -> APIRouter:
    """The routes for these settings (the request model carries their limits)."""
    router = APIRouter()

    @router.post(
        "/respond",
        response_model=RespondResponse,
        responses=_errors(400, 401, 413, 422, 429, 503, 504),
        dependencies=[Depends(key_check(settings, "/respond"))],
    )
    async def respond(
        body: request_model,  # type: ignore[valid-type]
        request: Request,
        engine: EngineDep,
        state: StateDep,
        timeout_ms: int | None = Header(
            None,
            alias="X-Request-Timeout-Ms",
            ge=1,
            le=600_000,
            description="drop the request with 504 if it is still queued after this many ms",
        ),
    ) -> Any:
        # The engine serving now: a hot reload may have retired the one resolved before the body was read.
        # Nothing awaits between this read and respond() counting the request, so retire() waits for it.
        engine = state.engine or engine
        note = request.state.log  # the access-log line's extra fields
        if settings.log_text:
            note["context"] = body.context
        if body.fusion in ("rerank", "sum", "zscore") and not engine.pipeline.reranker:
            raise NeedsReranker(f"{body.fusion!r} needs a reranker and this bundle has none")
        key = getattr(request.state, "key", None)  # the API key that matched, if keys are on
        job = make_job(body, engine, state.deadline(timeout_ms), key)
        with state.admission.hold(key):
            result = await engine.respond(job)
        note["timings_ms"] = result["timings_ms"]
        if settings.log_text:
            note["responses"] = [r["text"] for r in result["responses"]]
        return result

    @router.get("/healthz", dependencies=[Depends(key_check(settings, "/healthz"))])
    async def healthz() -> dict:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @router.get("/readyz", responses=_errors(503), dependencies=[Depends(key_check(settings, "/readyz"))])
    async def readyz(state: StateDep) -> Any:
        """Readiness: the bundle is loaded, verified and warmed up, and the server is not shutting down."""
        if state.draining:
            raise ShuttingDown()
        engine = state.engine
        if not state.ready or engine is None:
            raise NotReady()
        return {"status": "ready", **engine.describe()}

    @router.get(
        "/metrics", response_class=PlainTextResponse, dependencies=[Depends(key_check(settings, "/metrics"))]
    )
    async def prometheus_metrics(request: Request, state: StateDep) -> Response:
        """Prometheus text format, or OpenMetrics (with trace-id exemplars) when the scraper asks for it."""
        encode, media_type = choose_encoder(request.headers.get("accept"))
        return Response(encode(state.metrics.registry), media_type=media_type)

    return router
