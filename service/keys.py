"""API keys: who may call the service, and which responses each caller may be answered with.

Keys come from ``COREPLY_API_KEYS`` (comma-separated, all named ``default``: several for rotation) and
from ``COREPLY_API_KEYS_FILE``, a JSON object of named keys, each optionally scoped by a filter::

    {"support-bot": {"key": "...", "filter": {"bot": "support"}},
     "ops": {"key": "..."}}

A scoped key's requests are answered only from the responses its filter allows, read as a request's
``filter`` is (coreply/filters.py), and met together with the request's own. One deployment can so
serve several bots, or several customers, from one pool without one ever seeing another's replies. The
names, never the keys, go into the access log and the metrics."""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coreply.filters import FilterError, MetadataIndex

ENV_NAME = "default"  # the name of every COREPLY_API_KEYS key
NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
ENTRY = {"key", "filter"}
SHAPE = '{"NAME": {"key": "...", "filter": {...}}, ...}'


@dataclass(frozen=True)
class ApiKey:
    name: str
    secret: bytes = field(repr=False)
    scope: dict[str, Any] | None = None  # a filter over the pool's metadata; None: every response


class KeyRing:
    """The configured keys. :meth:`match` compares a presented key against every one, in constant time,
    so timing reveals neither a key nor which one matched."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self.keys = tuple(keys)
        self.scoped = tuple(k for k in self.keys if k.scope is not None)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def match(self, given: bytes) -> ApiKey | None:
        hits = [hmac.compare_digest(given, key.secret) for key in self.keys]  # every key, always
        return self.keys[hits.index(True)] if any(hits) else None


def env_keys(value: str) -> list[ApiKey]:
    """``COREPLY_API_KEYS``: comma-separated keys, unscoped, named :data:`ENV_NAME`."""
    return [ApiKey(ENV_NAME, k.strip().encode()) for k in value.split(",") if k.strip()]


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
        if not isinstance(entry, dict) or "key" not in entry or set(entry) - ENTRY:
            raise ValueError(f'{at}: write {{"key": "...", "filter": {{...}}}} (the filter optional)')
        secret = entry["key"]
        if not isinstance(secret, str) or not secret.strip() or secret != secret.strip():
            raise ValueError(f"{at}: the key is a text without spaces at either end")
        if secret in owners:
            raise ValueError(f"{at}: the same key as {owners[secret]!r}; a key names one caller")
        owners[secret] = name
        scope = entry.get("filter")
        if scope is not None and not isinstance(scope, dict):
            raise ValueError(f"{at}: the filter is a JSON object, as a request's `filter` is")
        keys.append(ApiKey(name, secret.encode(), scope or None))
    return keys


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
