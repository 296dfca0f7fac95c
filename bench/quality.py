"""Retrieval quality of a bundle as served (its own encoder graph, index, echo filter and restatement
guard), on protocol B: the first N chitchat test pairs against the bundle's pool. Compares the bundle's
backend (int8 ONNX for the default bundle) with the PyTorch fp32 reference on the same pool and index
type.

    python bench/quality.py --bundle artifacts/default-bundle --limit 2000
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench import open_bundle, refuse_below  # bench/bench.py: this script's directory is on sys.path
from coreply.bundle import make_backend, pipeline
from coreply.corpus import load_chitchat
from evaluation.metrics import summarize
from evaluation.protocols import ranks_for, retrieve_and_rerank
from index_builder.build import encode_pool
from index_builder.faiss_index import make_index


def ranks(backend, index, bundle, pairs, depth: int = 100) -> list[float]:
    """Protocol-B ranks of the gold by retrieval alone, through the served pipeline (echo filter and the
    bundle's restatement guard, if it has one)."""
    got = retrieve_and_rerank(pairs, pipeline(bundle, backend, index), depth, 0)
    return ranks_for(pairs, bundle.keys, got, "retrieval", depth)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True)
    p.add_argument("--limit", type=int, default=2000)
    p.add_argument("--reference", action="store_true", help="also re-encode the pool with PyTorch fp32")
    args = p.parse_args()
    refuse_below(args, limit=1)
    bundle = open_bundle(args.bundle)
    pairs = load_chitchat()["test"][: args.limit]
    served = make_backend(bundle, threads=2)
    result = {f"served ({bundle.manifest['encoder']})": summarize(ranks(served, bundle.index, bundle, pairs))}
    if args.reference:
        torch_backend = make_backend(bundle, "torch", threads=2)
        vectors = encode_pool(torch_backend, bundle.texts)
        index = make_index(vectors, bundle.manifest["index"]["factory"])
        result["reference (torch fp32)"] = summarize(ranks(torch_backend, index, bundle, pairs))
    print(json.dumps({"bundle": bundle.version, "pairs": len(pairs), "results": result}, indent=2))


if __name__ == "__main__":
    main()
