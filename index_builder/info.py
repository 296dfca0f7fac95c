"""``coreply index info``: what a bundle holds, read from its manifest and its files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from coreply.bundle import (
    CALIBRATED,
    RESPONSES,
    default_fusion,
    pool_filters,
    read_manifest,
    read_responses,
    rerank_stage,
)
from coreply.filters import Filter, MetadataIndex


def _size(path: Path) -> int:
    return (
        sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if path.is_dir()
        else path.stat().st_size
    )


def _model(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "none (retrieval only)"
    training = entry.get("training", {})
    config = training.get("train_config", {})
    parts = [f"sha256 {entry['content_hash'][:12]}"]
    if config:
        parts.append(f"{config.get('mode')} mode, step {training.get('step')}")
    valid = training.get("valid", {})
    scores = {k: v["hits@1"] for k, v in valid.items() if isinstance(v, dict) and "hits@1" in v}
    if scores:
        parts.append("validation hits@1 " + ", ".join(f"{k} {v:.1f}" for k, v in scores.items()))
    return f"{entry['source']} ({'; '.join(parts)})"


def _lexical(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "none"
    hits = entry.get("hits@1")
    measured = f": hits@1 {hits['dense']} dense alone, {hits['with lexical']} with it" if hits else ""
    return (
        f"BM25 reorders the first {entry['depth']} candidates, z-score weight {entry['weight']} of the dense "
        f"score ({_on(entry)}{measured})"
    )


def _fusion(m: dict[str, Any]) -> str:
    """What a request gets unless it names a fusion, and the z-score weight."""
    if rerank_stage(m) is None:
        return "retrieval (no rerank stage)"
    fusion = m.get("fusion", {})
    calibrated = "calibrated_on" in fusion
    weight = f"{fusion['zscore_weight']} ({_on(fusion)})" if calibrated else "not calibrated"
    gate = fusion.get("gate", {})
    gated = (
        f"; reranks only where the first stage leads by less than {gate['margin']:.4g} "
        f"({gate['skipped_%']} % of the calibration contexts skipped it)"
        if gate.get("margin") is not None
        else ""
    )
    return f"{default_fusion(m)} by default, z-score weight {weight}{gated}"


def _on(entry: dict[str, Any], key: str = "calibrated_on") -> str:
    """What a stage's choice was made on; 'pinned: ' before it where another build made it (named on the
    ``choices`` line)."""
    return ("pinned: " if "pinned" in entry else "") + entry[key]


def _measured(entry: dict[str, Any]) -> str:
    """': {hits@1 per setting}' where the entry was chosen by them ('' where it was given)."""
    return f": {entry['hits@1']}" if "hits@1" in entry else ""


def _guard(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "none (restatements of the context are not dropped)"
    words = (
        f", or F1 of distinct words >= {entry['words_last_turn']} with the last turn "
        f"(its {entry['words_quantile']} quantile)"
        if "words_last_turn" in entry
        else ""
    )
    return (
        f"drops answers restating the context: cosine >= {entry['last_turn']} with the last turn or "
        f">= {entry['earlier_turns']} with an earlier one (the {entry['quantile']} quantiles of human "
        f"replies){words}; {_on(entry)}, "
        f"{100 * entry['human_replies_dropped']:.2f} % of them dropped"
    )


def stages(m: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) of each stage a build chooses (fusion, guard, prior, lexical), from a manifest
    alone: what ``coreply index build`` prints of its choices, and :func:`describe` among the rest."""
    prior = m.get("prior")
    return [
        ("fusion", _fusion(m)),
        ("guard", _guard(m.get("restatement"))),
        (
            "prior",
            f"retrieval scores less {prior['alpha']} x each response's mean score against its "
            f"{prior['k']} closest of {prior['reference_contexts']:,} reference contexts "
            f"({_on(prior, 'chosen_on')}{_measured(prior)})"
            if prior
            else "none",
        ),
        ("lexical", _lexical(m.get("lexical"))),
    ]


def matching(path: str | Path, where: Filter) -> list[tuple[int, str, dict[str, Any]]]:
    """The responses of the bundle at ``path`` whose metadata meets ``where``, as (id, text, metadata),
    withdrawn ones included, read without loading its index (a :class:`~coreply.filters.FilterError`
    where the filter cannot match as meant)."""
    root = Path(path)
    read_manifest(root, verify=False)  # a bundle, said before its pool is read
    texts, metadata = read_responses(root / RESPONSES)
    ids = np.flatnonzero(MetadataIndex(metadata).allowed(where))
    return [(int(i), texts[i], metadata[i]) for i in ids]


def describe(path: str | Path) -> list[tuple[str, str]]:
    """(label, value) lines describing the bundle at ``path`` (its hashes verified first)."""
    root = Path(path)
    m = read_manifest(root)
    build, index = m["build"], m["index"]
    added = sum(a["added"] for a in m.get("additions", []))
    recall = ", ".join(f"{k} {v}" for k, v in index["recall_vs_exact"].items()) or "not measured"
    prior = m.get("prior")
    sizes = {name: _size(root / name) for name in sorted({f.split("/")[0] for f in m["files"]})}
    lines = [
        ("bundle", f"{root} (version {m['bundle_version']}, {m['format']}, built {build['created']})"),
        (
            "pool",
            f"{index['count']:,} responses from {build['pool_source'] or 'texts'} "
            f"({build['dropped_duplicates_or_blank']:,} repeats or blanks dropped; {added:,} added since; "
            f"{m.get('withdrawn', {}).get('count', 0):,} withdrawn)",
        ),
        ("filters", pool_filters(root).describe()),
        (
            "index",
            f"{index['factory']}, {index['metric']}, dim {index['dim']}, search params "
            f"{index['search_params'] or 'default'}; recall vs exact: {recall}",
        ),
        ("retriever", _model(m["models"]["bi"])),
        ("reranker", _model(m["models"].get("cross"))),
        *stages(m),
        ("encoder", f"{m['encoder']}; built on {build['host']} in {build['total_seconds']} s"),
        (
            "size",
            ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items())
            + f"; total {sum(sizes.values()) / 1e6:.1f} MB",
        ),
    ]
    pinned = {entry["pinned"] for entry in (m.get(name) or {} for name in CALIBRATED) if "pinned" in entry}
    if pinned:  # these choices were made by another build (index_builder.build.pins_of)
        rho = f"; the prior's values from {prior['rho']}" if (prior or {}).get("rho") else ""
        lines.append(("choices", "pinned from " + "; ".join(sorted(pinned)) + rho))
    if build.get("command"):
        lines.append(("built by", build["command"]))
    return lines
