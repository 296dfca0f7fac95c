"""Single-query search latency and recall against exact search for FAISS index types, on a bundle's
own vectors and real query embeddings (the chitchat test contexts).

    python bench/index_bench.py --bundle artifacts/default-bundle --out docs/index-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench import open_bundle, provenance, refuse_below  # bench/bench.py, beside this script
from coreply.artifacts import write_json_atomic
from coreply.bundle import apply_search_params, make_backend
from coreply.corpus import load_chitchat
from index_builder.faiss_index import make_index, recall_vs_exact

CHOICES = [
    ("Flat", ""),
    ("SQfp16", ""),
    ("SQ8", ""),
    ("HNSW32", "efSearch=64"),
    ("HNSW32", "efSearch=128"),
    ("IVF1024,Flat", "nprobe=16"),
    ("IVF1024,Flat", "nprobe=64"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    refuse_below(args, queries=1, threads=1)

    import faiss

    faiss.omp_set_num_threads(args.threads)
    bundle = open_bundle(args.bundle)
    vectors = bundle.index.reconstruct_n(0, bundle.index.ntotal)  # [N, D]
    contexts = [list(pair.context) for pair in load_chitchat()["test"][: args.queries]]
    queries = make_backend(bundle, threads=args.threads).encode_contexts(contexts)  # [Q, D]
    rows = []
    for factory, params in CHOICES:
        start = time.perf_counter()
        index = make_index(vectors, factory)
        build_s = time.perf_counter() - start
        apply_search_params(index, params)
        times = []
        for q in queries:
            t = time.perf_counter()
            index.search(q[None, :], 30)
            times.append(1000 * (time.perf_counter() - t))
        row = {
            "factory": factory,
            "search_params": params,
            "build_s": round(build_s, 1),
            "search_ms_p50": round(float(np.percentile(times, 50)), 2),
            "search_ms_p99": round(float(np.percentile(times, 99)), 2),
            **recall_vs_exact(index, vectors, queries, ks=(1, 10)),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        **provenance(),
        "count": int(bundle.index.ntotal),
        "dim": int(bundle.index.d),
        "rows": rows,
    }
    write_json_atomic(args.out, result, sort_keys=False)


if __name__ == "__main__":
    main()
