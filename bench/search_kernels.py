"""Which matmul scores an exact search fastest on this CPU? Hosts differ from session to session (MKL
is slow on some AMD EPYCs, fast on Intel Xeons), and the served search chose by measuring one host
(docs/performance.md section 15). Per batch of queries against a pool of the default bundle's shape
(random unit vectors, or a bundle's own with ``--bundle``), three ways to score and take the top k:

- ``torch``: one float32 matmul in torch (MKL), what the search was before section 15;
- ``served``: :class:`coreply.bundle.TorchExactIndex`, numpy's BLAS on one thread per slice of the pool;
- ``torch-fp16``: the vectors and queries in fp16, one torch matmul.

Median ms per batch over ``--rounds`` calls, and the share of queries whose top k is exact (the same ids
in the same order as a float64 search).

    python bench/search_kernels.py --out docs/search-kernels-2026-11-27.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench import provenance  # bench/bench.py: this script's directory is on sys.path
from coreply.artifacts import write_json_atomic
from coreply.bundle import TorchExactIndex, load_bundle
from coreply.device import set_threads


def pool_vectors(args: argparse.Namespace) -> np.ndarray:
    """[N, D] float32: the bundle's response vectors, or seeded random unit vectors."""
    if args.bundle:
        try:
            index = load_bundle(args.bundle).index
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--bundle: {exc}") from None
        return index.reconstruct_n(0, index.ntotal)
    vectors = np.random.default_rng(0).standard_normal((args.pool, args.dim)).astype("float32")
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def timed(search: Callable[[], np.ndarray], rounds: int) -> tuple[float, np.ndarray]:
    """Median ms of ``rounds`` calls after one warm-up, and the ids [B, k] of the last."""
    ids = search()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        ids = search()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times), ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", help="search this bundle's response vectors (default: random ones)")
    p.add_argument("--pool", type=int, default=124_141, help="random vectors: how many")
    p.add_argument("--dim", type=int, default=384, help="random vectors: their width")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="queries per search")
    p.add_argument("--k", type=int, default=100, help="top k")
    p.add_argument("--threads", type=int, default=2, help="torch's threads (the served search's slices)")
    p.add_argument("--rounds", type=int, default=11, help="timed calls per kernel and batch size")
    p.add_argument("--out", type=Path, help="write the result as JSON here too")
    args = p.parse_args()
    for flag in ("pool", "dim", "k", "threads", "rounds"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if min(args.batch) < 1:
        raise SystemExit(f"--batch: every size must be >= 1, got {args.batch}")
    if args.out and not args.out.parent.is_dir():
        raise SystemExit(f"--out: {args.out.parent} is not a directory")
    set_threads(args.threads)
    pool = pool_vectors(args)  # [N, D]
    k = min(args.k, len(pool))
    vectors = torch.from_numpy(pool)
    half = vectors.half()
    served = TorchExactIndex(vectors)
    rng = np.random.default_rng(1)
    rows = []
    with torch.inference_mode():
        for size in args.batch:
            queries = rng.standard_normal((size, pool.shape[1])).astype("float32")  # [B, D]
            q = torch.from_numpy(queries)
            exact = np.argsort(-(queries.astype("float64") @ pool.T.astype("float64")), axis=1)[:, :k]
            kernels = {
                "torch": lambda q=q: torch.topk(q @ vectors.T, k, dim=1).indices.numpy(),
                "served": lambda queries=queries: served.search(queries, k)[1],
                "torch-fp16": lambda q=q: torch.topk((q.half() @ half.T).float(), k, dim=1).indices.numpy(),
            }
            row: dict = {"batch": size}
            for name, search in kernels.items():
                ms, ids = timed(search, args.rounds)
                same = float(np.mean(np.all(ids == exact, axis=1)))  # share of queries ranked exactly
                row[name] = {"ms": round(ms, 2), "exact_top_k": round(same, 3)}
            rows.append(row)
            print(row, flush=True)
    result = {**provenance(), "pool": list(pool.shape), "k": k, "threads": args.threads, "rows": rows}
    if args.out:
        write_json_atomic(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
