"""``coreply index withdraw``: take responses out of what a bundle answers, or put them back, in place."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coreply.artifacts import changes, link_or_copy, staging
from coreply.bundle import MAX_WITHDRAWN, WITHDRAWN, finish, load_bundle, write_withdrawn
from coreply.text import normalize


@changes("coreply index withdraw")
def withdraw(
    path: str | Path, ids: Sequence[int] = (), texts: Sequence[str] = (), restore: bool = False
) -> tuple[dict[str, Any], int, list[str]]:
    """Withdraw responses from what a bundle answers, by id or by text (matched as the pool holds it,
    normalised), or with ``restore`` put them back: no row moves and nothing is re-encoded, so the ids a
    client holds stay valid. The BM25 statistics still count a withdrawn response (a lexical stage only
    reorders candidates). The bundle is rewritten atomically. Returns (the manifest, how many changed,
    the given texts the pool does not hold)."""
    root = Path(path)
    bundle = load_bundle(root)
    count = len(bundle.texts)
    for i in ids:
        if not 0 <= i < count:
            raise ValueError(f"--ids: {i} is not a response of this bundle (its ids are 0 to {count - 1})")
    rows = {key: i for i, key in enumerate(bundle.keys)}
    found = [rows.get(normalize(t)) for t in texts]
    unknown = [t for t, i in zip(texts, found, strict=True) if i is None]
    chosen = {*ids, *(i for i in found if i is not None)}
    now = bundle.withdrawn - chosen if restore else bundle.withdrawn | chosen
    if len(now) > MAX_WITHDRAWN:
        raise ValueError(
            f"{len(now)} responses withdrawn, more than {MAX_WITHDRAWN} (each costs every request a hit "
            "fetched): build the bundle again from a pool without them (`coreply index build`)"
        )
    changed = len(now ^ bundle.withdrawn)
    if not changed:
        return bundle.manifest, 0, unknown
    at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    history = [
        *bundle.manifest.get("withdrawn", {}).get("history", []),
        {"restored" if restore else "withdrawn": changed, "at": at},
    ]
    entry = {"count": len(now), "history": history}
    manifest = {**bundle.manifest, "withdrawn": entry}  # finish() writes its files and version anew
    with staging(root) as tmp:
        for name in bundle.manifest["files"]:
            if name != WITHDRAWN:
                link_or_copy(root / name, tmp / name)
        write_withdrawn(tmp, now)
        return finish(tmp, root, manifest), changed, unknown
