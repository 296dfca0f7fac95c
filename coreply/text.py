"""Text normalisation shared by the pool de-duplication, hit matching and the echo filter."""

from __future__ import annotations

import re

_WS = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Lowercase and collapse whitespace: two responses are 'the same' iff this is equal."""
    return _WS.sub(" ", text).strip().lower()
