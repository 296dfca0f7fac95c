"""Structured logs: one JSON object per line on stderr, for uvicorn's own messages and for coreply's
access log (one line per request, with its request id, the caller's W3C trace context when it sends one,
and stage timings; dialogue text only when ``COREPLY_LOG_TEXT`` is on)."""

from __future__ import annotations

import json
import logging
import re
import uuid
from datetime import datetime, timezone
from typing import Any

ACCESS = logging.getLogger("coreply.access")
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# W3C Trace Context, version-traceid-parentid-flags; a later version may append fields after a dash.
TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def request_id(given: str | None) -> str:
    """The client's ``X-Request-Id`` if it is a sane token, else a fresh one (never echo arbitrary bytes)."""
    return given if given and REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def trace_context(traceparent: str | None) -> dict[str, str]:
    """``trace_id`` and ``parent_id`` (the caller's span) from a W3C ``traceparent`` header, so that the
    access log joins the caller's trace; empty when the header is missing or invalid (never an error:
    a tracing bug upstream must not fail requests)."""
    match = TRACEPARENT.fullmatch(traceparent or "")
    if match is None:
        return {}
    version, trace_id, parent_id, _, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(parent_id) == {"0"}:
        return {}
    return {"trace_id": trace_id, "parent_id": parent_id}


def log_config() -> dict[str, Any]:
    """``logging.config.dictConfig`` for uvicorn: everything as JSON on stderr; uvicorn's own access
    log is off because coreply's carries more (request id, route label, stage timings)."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"default": handler},
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
            "coreply": {"handlers": ["default"], "level": "INFO", "propagate": False},
        },
    }
