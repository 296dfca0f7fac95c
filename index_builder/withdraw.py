"""``coreply index withdraw``: take responses out of what a bundle answers, or put them back, in place."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coreply.artifacts import changes, link_or_copy, staging
from coreply.bundle import (
    MANIFEST,
    MAX_WITHDRAWN,
    RESPONSES,
    WITHDRAWN,
    finish,
    load_bundle,
    read_manifest,
    read_responses,
    read_withdrawn,
    write_withdrawn,
)
from coreply.filters import Filter
from coreply.text import normalize

LOG = logging.getLogger(__name__)


@changes("coreply index withdraw", MANIFEST)
def withdraw(
    path: str | Path,
    ids: Sequence[int] = (),
    texts: Sequence[str] = (),
    restore: bool = False,
    where: Filter | None = None,
) -> tuple[dict[str, Any], int, list[str]]:
    """Withdraw responses from what a bundle answers, by id, by text (matched as the pool holds it,
    normalised) or by metadata (``where``, as a request's filter reads it; a
    :class:`~coreply.filters.FilterError` where it cannot match as meant), or with ``restore`` put them
    back: no row moves and nothing is re-encoded, so the ids a client holds stay valid. The BM25
    statistics still count a withdrawn response (a lexical stage only reorders candidates). The bundle is
    rewritten atomically. Returns (the manifest, how many changed, the given texts the pool does not
    hold)."""
    root = Path(path)
    bundle = load_bundle(root)
    count = len(bundle.texts)
    for i in ids:
        if not 0 <= i < count:
            raise ValueError(f"--ids: {i} is not a response of this bundle (its ids are 0 to {count - 1})")
    found = _rows_of(bundle.keys, texts)
    unknown = [t for t, i in zip(texts, found, strict=True) if i is None]
    matched = [] if where is None else np.flatnonzero(bundle.filters.allowed(where)).tolist()
    chosen = {*ids, *(i for i in found if i is not None), *matched}
    now = bundle.withdrawn - chosen if restore else bundle.withdrawn | chosen
    if len(now) > MAX_WITHDRAWN:
        raise ValueError(
            f"{len(now)} responses withdrawn, more than {MAX_WITHDRAWN} (each costs every request a hit "
            "fetched): build the bundle again from a pool without them (`coreply index build`)"
        )
    changed = len(now ^ bundle.withdrawn)
    if not changed:
        return bundle.manifest, 0, unknown
    history = [
        *bundle.manifest.get("withdrawn", {}).get("history", []),
        {"restored" if restore else "withdrawn": changed, "at": _now()},
    ]
    entry = {"count": len(now), "history": history}
    manifest = {**bundle.manifest, "withdrawn": entry}  # finish() writes its files and version anew
    with staging(root, MANIFEST) as tmp:
        for name in bundle.manifest["files"]:
            if name != WITHDRAWN:
                link_or_copy(root / name, tmp / name)
        write_withdrawn(tmp, now)
        return finish(tmp, root, manifest), changed, unknown


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _rows_of(keys: Sequence[str], texts: Sequence[str]) -> list[int | None]:
    """The id of each of ``texts`` in a pool of normalised ``keys``, matched normalised (None: not held)."""
    rows = {key: i for i, key in enumerate(keys)}
    return [rows.get(normalize(t)) for t in texts]


def withdrawn_of(root: Path) -> tuple[str, list[tuple[int, str]]]:
    """The version of the bundle at ``root`` and its withdrawn responses as (id, text), read without
    loading its index (a BundleError where there is no bundle)."""
    manifest = read_manifest(root, verify=False)
    if not manifest.get("withdrawn"):
        return manifest["bundle_version"], []
    texts = read_responses(root / RESPONSES)[0]
    return manifest["bundle_version"], [
        (i, texts[i]) for i in sorted(read_withdrawn(root, manifest, len(texts)))
    ]


def carry_over(old: Path, keys: Sequence[str], tmp: Path) -> dict[str, Any] | None:
    """A bundle built again at ``old``'s path (a new model or recipe, the default bundle after an upgrade)
    keeps withdrawn what the one it replaces had withdrawn, matched by normalised text among ``keys``
    (the new pool's), so a rebuild never serves them again: writes withdrawn.json into ``tmp`` and
    returns the manifest's entry (None where nothing stays withdrawn)."""
    if not (old / MANIFEST).is_file():  # a first build
        return None
    try:
        version, gone = withdrawn_of(old)
    except (OSError, ValueError) as exc:  # a BundleError too
        LOG.warning(
            "note: %s: the bundle this build replaces is unreadable (%s); no withdrawal carried over",
            old,
            exc,
        )
        return None
    if not gone:
        return None
    ids = frozenset(i for i in _rows_of(keys, [text for _, text in gone]) if i is not None)
    LOG.warning(
        "note: %d responses withdrawn from the bundle this build replaces stay withdrawn (%d of its %d are "
        "not in the new pool); `coreply index withdraw --restore` serves them again",
        len(ids),
        len(gone) - len(ids),
        len(gone),
    )
    if not ids:
        return None
    write_withdrawn(tmp, ids)
    return {"count": len(ids), "history": [{"carried": len(ids), "from": version, "at": _now()}]}
