"""API keys: who may call the service, and which responses each caller may be answered with.

Keys come from ``COREPLY_API_KEYS`` (comma-separated, all named ``default``: several for rotation) and
from ``COREPLY_API_KEYS_FILE``, a JSON object of named keys, each optionally scoped by a filter::

    {"support-bot": {"key": "...", "filter": {"bot": "support"}, "max_in_flight": 8},
     "ops": {"key_sha256": "<64 hex digits>"}}

An entry gives its key, or only the key's SHA-256 (``printf %s "$KEY" | sha256sum``), so that the file,
its Secret and their backups do not hold what a caller sends. Either way the service keeps and compares
only digests.

A scoped key's requests are answered only from the responses its filter allows, read as a request's
``filter`` is (coreply/filters.py), and met together with the request's own. One deployment can so
serve several bots, or several customers, from one pool without one ever seeing another's replies, and
``max_in_flight`` keeps one of them from filling the queue the others share. The names, never the
keys, go into the access log and the metrics."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coreply.filters import FilterError, MetadataIndex

ENV_NAME = "default"  # the name of every COREPLY_API_KEYS key
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
ENTRY = {"key", "key_sha256", "filter", "max_in_flight"}
ENTRY_SHAPE = '{"key": "..." or "key_sha256": "<64 hex digits>", "filter": {...}, "max_in_flight": N}'
HEX64 = re.compile(r"[0-9a-fA-F]{64}")
SHAPE = f'{{"NAME": {ENTRY_SHAPE}, ...}}'


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes = field(repr=False)  # SHA-256 of the key; the key itself is never kept
    scope: dict[str, Any] | None = None  # a filter over the pool's metadata; None: every response
    max_in_flight: int | None = None  # most of its /respond requests admitted at once; None: no limit


class TooManyRequests(Exception):
    """A key already has its ``max_in_flight`` requests admitted."""


class KeyRing:
    """The configured keys. :meth:`match` compares a presented key against every one, in constant time,
    so timing reveals neither a key nor which one matched."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self.keys = tuple(keys)
        self.scoped = tuple(k for k in self.keys if k.scope is not None)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def match(self, given: bytes) -> ApiKey | None:
        digest = sha256(given)
        hits = [hmac.compare_digest(digest, key.digest) for key in self.keys]  # every key, always
        return self.keys[hits.index(True)] if any(hits) else None


class Admission:
    """Each key's ``/respond`` requests admitted now, held against its ``max_in_flight``, so that one
    caller flooding the service is refused with 429 while the others' requests still find the queue."""

    def __init__(self) -> None:
        self.in_flight: Counter[str] = Counter()

    @contextmanager
    def hold(self, key: ApiKey | None) -> Iterator[None]:
        """One of ``key``'s places for the block; :class:`TooManyRequests` when it has none left. One
        event loop admits, so the count needs no lock."""
        if key is None or key.max_in_flight is None:
            yield
            return
        if self.in_flight[key.name] >= key.max_in_flight:
            raise TooManyRequests(f"{key.name!r} has its {key.max_in_flight} requests in flight")
        self.in_flight[key.name] += 1
        try:
            yield
        finally:
            self.in_flight[key.name] -= 1


def env_keys(value: str) -> list[ApiKey]:
    """``COREPLY_API_KEYS``: comma-separated keys, unscoped, named :data:`ENV_NAME`."""
    return [ApiKey(ENV_NAME, sha256(k.strip().encode())) for k in value.split(",") if k.strip()]


def sha256(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for name, value in pairs:
        if name in seen:
            raise ValueError(f"{name!r} is given twice")
        seen[name] = value
    return seen


def read_key_file(path: Path) -> list[ApiKey]:
    """The named keys of a key file; a ValueError names the file, the entry and what is wrong."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from None
    try:
        entries = json.loads(text, object_pairs_hook=_no_repeats)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    except ValueError as exc:  # a name given twice, at any depth
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{path}: holds no keys; write {SHAPE}")
    keys, owners = [], {}
    for name, entry in entries.items():
        at = f"{path}: {name!r}"
        if not NAME.fullmatch(name) or name == ENV_NAME:
            raise ValueError(f"{at}: a name is 1-64 letters, digits, '.', '_' or '-', and not {ENV_NAME!r}")
        if not isinstance(entry, dict) or len({"key", "key_sha256"} & set(entry)) != 1 or set(entry) - ENTRY:
            raise ValueError(f"{at}: write {ENTRY_SHAPE} (the filter and the limit optional)")
        digest = _digest(entry, at)
        if digest in owners:
            raise ValueError(f"{at}: the same key as {owners[digest]!r}; a key names one caller")
        owners[digest] = name
        scope = entry.get("filter")
        if scope is not None and not isinstance(scope, dict):
            raise ValueError(f"{at}: the filter is a JSON object, as a request's `filter` is")
        limit = entry.get("max_in_flight")
        if limit is not None and (type(limit) is not int or limit < 1):
            raise ValueError(f"{at}: max_in_flight is a whole number of requests, at least 1")
        keys.append(ApiKey(name, digest, scope or None, limit))
    return keys


def _digest(entry: dict[str, Any], at: str) -> bytes:
    """The SHA-256 of an entry's key, from its ``key`` or its ``key_sha256``."""
    if "key_sha256" in entry:
        given = entry["key_sha256"]
        if not isinstance(given, str) or not HEX64.fullmatch(given):
            raise ValueError(f"{at}: key_sha256 is the key's SHA-256 in 64 hex digits")
        return bytes.fromhex(given)
    secret = entry["key"]
    if not isinstance(secret, str) or not secret.strip() or secret != secret.strip():
        raise ValueError(f"{at}: the key is a text without spaces at either end")
    return sha256(secret.encode())


def scope_masks(ring: KeyRing, filters: MetadataIndex) -> dict[str, np.ndarray]:
    """Key name -> [N] bool: the responses of this pool each scoped key may be answered with. A scope
    this pool cannot read as meant (most often a field it lacks) is a ValueError naming the key, so a
    bundle that would serve a key everything, or nothing, by mistake is never served."""
    masks = {}
    for key in ring.scoped:
        try:
            masks[key.name] = filters.allowed(key.scope)
        except FilterError as exc:
            raise ValueError(f"API key {key.name!r}: its filter.{exc.field}: {exc.message}") from None
    return masks
