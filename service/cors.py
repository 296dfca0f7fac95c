"""Calls from web pages on other origins (CORS): which pages may read the API's answers.

``COREPLY_CORS_ORIGINS`` names them: ``https://chat.example.com``, ``https://*.example.com`` (any
subdomain), or ``*`` (any page). Empty, the default: no page on another origin can read an answer, as
before. Starlette's :class:`CORSMiddleware` does the work; a preflight it refuses is answered as every
other error is, ``{"error": ...}`` naming what was refused (403). Keys travel in headers, never cookies,
so credentialed requests are not allowed."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp

from service.errors import CorsRefused, for_exception

METHODS = ("GET", "POST")
# Request headers a page may send (content-type always): keys, request id, timeout, W3C trace context.
HEADERS = ("authorization", "x-api-key", "x-request-id", "x-request-timeout-ms", "traceparent", "tracestate")
EXPOSED = ("x-request-id", "retry-after")
MAX_AGE_S = 600  # how long a browser may keep a preflight's answer

_ORIGIN = re.compile(r"(https?)://(\*\.)?([a-z0-9-]+(?:\.[a-z0-9-]+)*|\[[0-9a-f:.]+\])(?::([0-9]{1,5}))?")
_DEFAULT_PORT = {"http": "80", "https": "443"}


@dataclass(frozen=True)
class Origins:
    """The pages allowed: ``exact`` origins as browsers send them, ``pattern`` a regular expression for the
    wildcard ones (None without), ``any`` for ``*``."""

    exact: tuple[str, ...] = ()
    pattern: str | None = None
    any: bool = False

    def __bool__(self) -> bool:
        return self.any or bool(self.exact) or self.pattern is not None


def parse_origins(text: str) -> Origins:
    """``COREPLY_CORS_ORIGINS`` read: comma-separated origins written as browsers send them. A ValueError
    names an entry that no browser's ``Origin`` header could ever equal, and what to write instead."""
    exact: list[str] = []
    wild: list[str] = []
    any_origin = False
    for entry in (e.strip() for e in text.split(",")):
        if entry == "*":
            any_origin = True
            continue
        if not entry:
            continue
        match = _ORIGIN.fullmatch(entry)
        if match is None:
            lowered = _ORIGIN.fullmatch(entry.lower())
            hint = (
                "browsers send it in lower case"
                if lowered
                else "write scheme://host[:port], no path, no trailing /"
                if "://" in entry
                else "write scheme://host[:port], e.g. https://chat.example.com"
            )
            raise ValueError(f"{entry!r} is not an origin: {hint}")
        scheme, star, host, port = match.groups()
        if port is not None and not 1 <= int(port) <= 65535:
            raise ValueError(f"{entry!r}: port {port} is out of range")
        if port == _DEFAULT_PORT[scheme]:
            bare = f"{scheme}://{star or ''}{host}"
            raise ValueError(f"{entry!r}: browsers send it without :{port}; write {bare}")
        if star:
            suffix = re.escape(f".{host}") + (f":{port}" if port else "")
            wild.append(rf"{scheme}://[a-z0-9-]+(?:\.[a-z0-9-]+)*{suffix}")
        else:
            exact.append(entry)
    return Origins(tuple(dict.fromkeys(exact)), "|".join(wild) or None, any_origin)


class _Cors(CORSMiddleware):
    """Starlette's CORS layer, its refused preflights said as the service's errors are."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        origin = request_headers["origin"]
        method = request_headers["access-control-request-method"]
        asked = request_headers.get("access-control-request-headers", "").lower().split(",")
        if not self.is_allowed_origin(origin):
            why = f"origin {origin!r} is not one of COREPLY_CORS_ORIGINS"
        elif method not in self.allow_methods:
            why = f"method {method!r} (the API takes {' and '.join(METHODS)})"
        elif refused := [h.strip() for h in asked if h.strip() not in ("", *self.allow_headers)]:
            why = f"header {refused[0]!r} (allowed: {', '.join(self.allow_headers)})"
        else:
            why = "private network access (a public page calling a private address)"
        refusal = for_exception(CorsRefused(why))
        refusal.headers["vary"] = response.headers["vary"]
        return refusal


def cors_layer(origins: Origins) -> Callable[[ASGIApp], ASGIApp]:
    """What wraps an ASGI app so that the pages ``origins`` allows may read its answers (as it is when
    none are allowed)."""
    if not origins:
        return lambda app: app

    def wrap(app: ASGIApp) -> ASGIApp:
        return _Cors(
            app,
            allow_origins=("*",) if origins.any else origins.exact,
            allow_origin_regex=origins.pattern,
            allow_methods=METHODS,
            allow_headers=HEADERS,
            expose_headers=EXPOSED,
            max_age=MAX_AGE_S,
        )

    return wrap
