"""Every error the service answers with, and its HTTP status, in one table.

Routes and dependencies raise domain errors; :func:`install` maps them to JSON bodies
``{"error": "..."}`` (validation errors also carry ``detail``, one entry per field). An exception that
is not in the table is a bug: 500, said as such, and the service keeps serving."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from service.batching import DeadlineExceeded, Overloaded
from service.keys import TooManyRequests


class NotReady(Exception):
    """The bundle is still loading."""


class ShuttingDown(Exception):
    """Shutdown has begun; load balancers should stop sending."""


class Unauthorized(Exception):
    """No API key, or not one of the configured ones."""


class NeedsReranker(Exception):
    """A fusion that needs a reranker, asked of a bundle that has none."""


class BodyTooLarge(Exception):
    """The request body is over the configured limit."""


class CorsRefused(Exception):
    """A browser's preflight for a page, method or header that COREPLY_CORS_ORIGINS does not allow."""


RETRY = {"Retry-After": "1"}

STATUS: dict[type[Exception], tuple[int, str, dict[str, str]]] = {
    # error: (status, message prefix, headers)
    NotReady: (503, "not ready", RETRY),
    ShuttingDown: (503, "shutting down", {}),
    Overloaded: (503, "overloaded", RETRY),
    DeadlineExceeded: (504, "deadline exceeded", {}),
    Unauthorized: (401, "missing or invalid API key", {"WWW-Authenticate": "Bearer"}),
    TooManyRequests: (429, "too many requests", RETRY),
    NeedsReranker: (422, "fusion", {}),
    BodyTooLarge: (413, "request body too large", {}),
    CorsRefused: (403, "cross-origin request refused", {}),
}


def error_response(
    status: int, message: str, detail: list[dict] | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = {"error": message} if detail is None else {"error": message, "detail": detail}
    return JSONResponse(body, status_code=status, headers=headers or None)


def for_exception(exc: Exception) -> JSONResponse:
    """The response for a domain error in :data:`STATUS`: ``"<prefix>: <message>"`` (or the prefix)."""
    status, prefix, headers = STATUS[type(exc)]
    message = f"{prefix}: {exc}" if str(exc) else prefix
    return error_response(status, message, headers=headers)


def _field(loc: tuple | list) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


def invalid(errors: list[dict]) -> JSONResponse:
    """422 naming the first offending field, with every error in ``detail``."""
    detail = [
        {
            "field": "body" if e.get("type") == "json_invalid" else _field(e.get("loc", ())),
            "message": e.get("msg", ""),
            "type": e.get("type", ""),
        }
        for e in errors
    ]
    first = detail[0] if detail else {"field": "body", "message": "invalid request"}
    return error_response(422, f"{first['field']}: {first['message']}", detail)


def unparsed(cause: BaseException) -> str:
    """Why the JSON parser gave up on a body, in words."""
    if isinstance(cause, UnicodeDecodeError):
        return f"body: not UTF-8 (byte {cause.start}); send the JSON as UTF-8"
    if isinstance(cause, RecursionError):
        return "body: JSON nested too deeply"
    return "body: could not be parsed"


def install(app: FastAPI) -> None:
    """Register the handlers: the table, validation errors, the framework's HTTP errors, and the 500
    fallback."""

    async def domain(request: Request, exc: Exception) -> JSONResponse:
        return for_exception(exc)

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return invalid(list(exc.errors()))

    async def http(request: Request, exc: Exception) -> JSONResponse:
        # the framework's own: no route (404), not its method (405, with Allow), a body its JSON parser
        # gave up on (400, raised from the parser's error); answered in the same shape as the rest
        assert isinstance(exc, HTTPException)
        cause = exc.__cause__
        message = unparsed(cause) if exc.status_code == 400 and cause else str(exc.detail)
        return error_response(exc.status_code, message, headers=exc.headers)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug: say so, keep serving
        return error_response(500, f"internal error ({type(exc).__name__}); this is a bug, please report it")

    for error in STATUS:
        app.add_exception_handler(error, domain)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http)
    app.add_exception_handler(Exception, unexpected)
