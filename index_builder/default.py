"""The built-in default bundle: what ``make serve`` builds on first start, offline, from PyPI packages
plus the compact retriever shipped in this repository.

Recipe: the bi-encoder in ``coreply/weights/default-bi`` (low-rank adapters over all-MiniLM-L6-v2,
scaled cosine, separate context and response towers, trained by CORE beside a reranker on a GPU;
provenance and measured metrics in its ``checkpoint.json`` and in ``coreply/weights/README.md``) as the
retriever over every distinct response of the chitchat corpus (124,141), int8 ONNX (one scale per
output channel, 7-bit weights), exact inner-product search, the restatement guard calibrated on the
validation split at its 0.98 quantile, its word-overlap threshold at 0.995 (:mod:`coreply.restatement`;
docs/results.md §41), the response prior measured on 20,000 training contexts, weighted by hits@1 on
the whole validation split (:mod:`coreply.prior`), and the lexical stage (BM25 reordering the first
100 candidates, :mod:`coreply.lexical`) at the weight with the best hits@1 on the first 2,000
validation pairs. The stricter guard and the lexical stage come together: BM25 favours the context's
own words, and the guard's 0.995 quantile let its restatements through (docs/results.md §34, §35).

Since recipe 12 the default is two-stage: the reranker in ``coreply/weights/default-cross`` (rank-32
adapters over the same base, made by ``coreply compact`` from the 6-layer cross-encoder CORE trained
with mined negatives in the seventh GPU lease, docs/results.md §39) reorders the first stage's
candidates, fused as calibrated on the first 2,000 validation pairs (the sum, unless the z-score at its
best weight is significantly better there), behind the rerank gate chosen on the same pairs
(:mod:`coreply.gate`). It lifts hits@1 from 5.76 to 6.06 % over the 11,445 held-out pairs no choice was
made on (p = 0.006, docs/results.md §48–§49), at about twice a lone request's CPU latency. Since
recipe 13 its int8 graph is smoothed first (:mod:`coreply.smoothing`, as every int8 export of a reranker
now is), which keeps it closer to the reranker as trained (docs/results.md §53). Since recipe 14, where
the gate lets the reranker run it reads only the candidates within the bundle's rerank reach of the first
stage's best, chosen on the same pairs (:mod:`coreply.gate`; docs/results.md §55). Shipping other
weights under either name, or changing the recipe, rebuilds an existing default bundle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import coreply
from coreply import lexical

RECALL_QUERIES = 500
RECIPE = "default bundle, recipe 14 (recipe 13 with a rerank reach)"
"""Recorded as the bundle's build command; a default bundle built by another recipe is rebuilt."""
DEFAULT_BI = Path(coreply.__file__).parent / "weights" / "default-bi"
DEFAULT_CROSS = Path(coreply.__file__).parent / "weights" / "default-cross"
CALIBRATION_PAIRS = lexical.PAIRS
"""The reranker's fusion and gate are chosen on the validation pairs the lexical stage's weight is chosen on,
leaving the rest (2,000-6,621) to measure the bundle on."""
GUARD_QUANTILE = 0.98


def shipped_cross() -> Path | None:
    """The shipped reranker (None in a checkout that leaves it out: the default is then retrieval only)."""
    return DEFAULT_CROSS if (DEFAULT_CROSS / "checkpoint.json").is_file() else None


def build_default_bundle(out: str | Path, progress: bool = True) -> dict[str, Any]:
    from coreply.corpus import load_chitchat, responses_of
    from index_builder.build import build_bundle

    splits = load_chitchat()
    cross = shipped_cross()
    return build_bundle(
        out,
        responses_of(splits),
        bi=str(DEFAULT_BI),
        cross=str(cross) if cross else None,
        calibration=splits["valid"][:CALIBRATION_PAIRS] if cross else (),
        onnx="int8",
        queries=[p.context for p in splits["valid"][:RECALL_QUERIES]],
        pool_source="chitchat-dataset 0.9.0, all splits",
        progress=progress,
        command=RECIPE,
        guard_pairs=splits["valid"],
        guard_quantile=GUARD_QUANTILE,
        prior_pairs=splits["train"],
        lexical_pairs=splits["valid"][: lexical.PAIRS],
    )


def ensure_default_bundle(path: Path) -> None:
    """Build the default bundle at ``path`` when it is missing, or rebuild it when it was built from
    other shipped weights or by another recipe than this checkout's (so pulling either takes effect)."""
    from coreply.bundle import MANIFEST, read_manifest
    from coreply.checkpoint import read_meta

    if (path / MANIFEST).is_file():
        manifest = read_manifest(path, verify=False)
        built = [(manifest["models"].get(k) or {}).get("content_hash") for k in ("bi", "cross")]
        cross = shipped_cross()
        shipped = [read_meta(DEFAULT_BI)["content_hash"], read_meta(cross)["content_hash"] if cross else None]
        if built == shipped and manifest.get("build", {}).get("command") == RECIPE:
            return  # the server verifies every file when it loads the bundle
        why = "the shipped weights or the recipe changed since it was built"
    else:
        why = "first start only"
    print(f"building the default bundle in {path} ({why}; a few minutes)", flush=True)
    build_default_bundle(path)
