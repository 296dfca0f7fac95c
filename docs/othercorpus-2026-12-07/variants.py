"""Bundles of the built-in models over a pool with no pairs, each with a chosen subset of the default
bundle's pinned choices (docs/results.md §67). Usage: python variants.py POOL OUT NAME...

Names: ``bi-*`` retrieval only, ``two-*`` with the built-in reranker. ``bare``: no stage; ``prior``: the
response prior at the default's weight, its values measured on the pool against 20,000 of chitchat's
training contexts (what `index build --bi builtin` does with no pairs since §67); ``guard``, ``judge``,
``words``, ``lexical``: the default's restatement guard (whole, its model-judge half, its shared-words
half) or lexical stage alone; ``pins``: the guard, the lexical stage and, with the reranker, the fusion,
gate and reach (what `index build --bi builtin [--cross builtin]` did with no pairs from §65 to §67);
``zscore`` / ``sum``: the reranker's fusion, uncalibrated (the z-score at 0.5) or summed, ungated.
"""

import sys

from coreply.config import BUILTIN_WEIGHTS
from coreply.corpus import load_chitchat
from coreply.readers import read_pool
from index_builder.build import build_bundle
from index_builder.default import PINNED

GUARD, PRIOR, LEXICAL, FUSION = (PINNED[k] for k in ("restatement", "prior", "lexical", "fusion"))
JUDGE = {k: v for k, v in GUARD.items() if not k.startswith("words")}
WORDS = GUARD | {"last_turn": 9.0, "earlier_turns": 9.0}  # no cosine reaches 9
SUM = {"default": "sum", "zscore_weight": FUSION["zscore_weight"]}
VARIANTS = {  # name -> (pinned entries, with the reranker)
    "bi-bare": ({}, False),
    "bi-prior": ({"prior": PRIOR}, False),
    "bi-guard": ({"restatement": GUARD}, False),
    "bi-judge": ({"restatement": JUDGE}, False),
    "bi-words": ({"restatement": WORDS}, False),
    "bi-lexical": ({"lexical": LEXICAL}, False),
    "bi-pins": ({"restatement": GUARD, "lexical": LEXICAL}, False),
    "bi-pins-prior": ({"restatement": GUARD, "lexical": LEXICAL, "prior": PRIOR}, False),
    "two-bare": ({}, True),
    "two-prior-zscore": ({"prior": PRIOR}, True),
    "two-prior-sum": ({"prior": PRIOR, "fusion": SUM}, True),
    "two-pins": ({"restatement": GUARD, "lexical": LEXICAL, "fusion": FUSION}, True),
    "two-pins-prior": ({"restatement": GUARD, "lexical": LEXICAL, "fusion": FUSION, "prior": PRIOR}, True),
}

pool, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
texts, _ = read_pool(pool)
train = load_chitchat()["train"]
for name in names:
    pins, cross = VARIANTS[name]
    build_bundle(
        f"{out}/{name}",
        texts,
        bi=str(BUILTIN_WEIGHTS["bi"]),
        cross=str(BUILTIN_WEIGHTS["cross"]) if cross else None,
        onnx="int8",
        pinned={"source": f"docs/othercorpus-2026-12-07/variants.py {name}", **pins},
        prior_pairs=train if "prior" in pins else (),
        progress=False,
        command=f"docs/othercorpus-2026-12-07/variants.py {name}",
    )
    print(name, "built", flush=True)
