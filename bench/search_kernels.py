r"""Which matmul scores an exact search fastest on this CPU? Hosts differ from session to session (MKL
is slow on some AMD EPYCs, fast on Intel Xeons), and the served search chose by measuring one host
(docs/performance.md sections 15-16). Per batch of queries against a pool of the default bundle's shape
(random unit vectors and random queries, or with ``--bundle`` a bundle's own vectors and its encoding of
the chitchat test contexts), five ways to score and take the top k:

- ``torch``: one float32 matmul in torch (MKL), what the search was before section 15;
- ``float32-slices``: :class:`coreply.bundle.TorchExactIndex` in one float32 pass, numpy's BLAS on one
  thread per slice of the pool (section 15);
- ``served``: the same index as served: two passes, fp16 (a few queries) or bf16 (larger blocks, where
  the CPU has bf16 dot products) then float32 (section 16; with AMX tiles, a lone query in one float32
  pass: section 27), else as ``float32-slices``;
- ``bf16-pass``: two passes, bf16 then float32, at every block size (where the CPU has bf16 dot products);
- ``torch-fp16``: the vectors and queries in fp16, one torch matmul (not exact).

Back to back, the pool may stay in a large L3 between calls where, as served, the encoders and the reranker
run between two searches: ``--cold MB`` reads that many megabytes before each timed call (section 27).

Median ms per batch over ``--rounds`` calls, each on queries of its own, and the share of all those
queries whose top k is exact: in float64, the returned ids score, place by place, what a float64
search's top k scores (within float32 rounding, so tied vectors may come in either order).

    python bench/search_kernels.py --batch 1 2 4 8 16 64 --rounds 31 \
        --out docs/search-kernels-two-pass-2026-11-27.json
    python bench/search_kernels.py --bundle artifacts/default-bundle --batch 1 2 4 8 16 64 --rounds 31 \
        --out docs/search-kernels-two-pass-bundle-2026-11-27.json
    python bench/search_kernels.py --bundle artifacts/default-bundle --batch 1 2 4 8 16 24 32 64 128 \
        --rounds 11 --cold 600 --out docs/search-amx-2026-11-29/search-kernels-cold.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench import open_bundle, provenance  # bench/bench.py: this script's directory is on sys.path
from coreply.artifacts import write_json_atomic
from coreply.bundle import BF16_PASS, TorchExactIndex
from coreply.device import cpu_has_bf16_dot, set_threads


def pool_and_queries(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """([N, D], [(rounds + 1) * sum(batch), D]) float32: a bundle's response vectors and its encoding of the
    first test contexts, or seeded random unit vectors and random queries."""
    wanted = (args.rounds + 1) * sum(args.batch)
    if args.bundle:
        from coreply.bundle import make_backend
        from coreply.corpus import load_chitchat

        bundle = open_bundle(args.bundle)
        contexts = [pair.context for pair in load_chitchat()["test"][:wanted]]
        if len(contexts) < wanted:
            raise SystemExit(
                f"--rounds/--batch: (rounds + 1) x sum(batch) = {wanted} queries, but the test split has "
                f"{len(contexts)} contexts: use fewer rounds or smaller batches"
            )
        queries = make_backend(bundle, threads=args.threads).encode_contexts(contexts)
        return bundle.index.reconstruct_n(0, bundle.index.ntotal), np.asarray(queries, dtype="float32")
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((args.pool, args.dim)).astype("float32")
    queries = rng.standard_normal((wanted, args.dim)).astype("float32")
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True), queries


def timed(
    search: Callable[[np.ndarray], np.ndarray], blocks: np.ndarray, evict: np.ndarray
) -> tuple[float, np.ndarray]:
    """blocks [R + 1, B, D] -> median ms of searching blocks 1..R (block 0 warms up), each after reading
    ``evict``, and every block's ids [R + 1, B, k]."""
    ids, times = [search(blocks[0])], []
    for block in blocks[1:]:
        evict.sum()
        start = time.perf_counter()
        ids.append(search(block))
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times), np.stack(ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", help="search this bundle's response vectors (default: random ones)")
    p.add_argument("--pool", type=int, default=124_141, help="random vectors: how many")
    p.add_argument("--dim", type=int, default=384, help="random vectors: their width")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="queries per search")
    p.add_argument("--k", type=int, default=100, help="top k")
    p.add_argument("--threads", type=int, default=2, help="torch's threads (the served search's slices)")
    p.add_argument("--rounds", type=int, default=11, help="timed calls per kernel and batch size")
    p.add_argument("--cold", type=int, default=0, metavar="MB", help="read this many MB before each call")
    p.add_argument("--out", type=Path, help="write the result as JSON here too")
    args = p.parse_args()
    for flag in ("pool", "dim", "k", "threads", "rounds"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.cold < 0:
        raise SystemExit(f"--cold must be >= 0 (MB), got {args.cold}")
    if min(args.batch) < 1:
        raise SystemExit(f"--batch: every size must be >= 1, got {args.batch}")
    if args.out and not args.out.parent.is_dir():
        raise SystemExit(f"--out: {args.out.parent} is not a directory")
    set_threads(args.threads)
    pool, all_queries = pool_and_queries(args)  # [N, D], [(rounds + 1) * sum(batch), D]
    pool64 = pool.astype("float64")
    k = min(args.k, len(pool))
    vectors = torch.from_numpy(pool)
    half = vectors.half()
    served, one_pass = TorchExactIndex(vectors), TorchExactIndex(vectors, passes=())
    bf16 = TorchExactIndex(vectors, passes=[BF16_PASS]) if cpu_has_bf16_dot() else None
    try:
        evict = np.ones(args.cold * 2**20 // 8)  # float64
    except MemoryError:
        raise SystemExit(f"--cold: {args.cold} MB does not fit in this host's memory; give fewer") from None
    rows = []
    with torch.inference_mode():
        for start, size in zip(np.cumsum([0, *args.batch]) * (args.rounds + 1), args.batch, strict=False):
            blocks = all_queries[start : start + (args.rounds + 1) * size].reshape(args.rounds + 1, size, -1)
            scores64 = blocks.astype("float64") @ pool64.T  # [R + 1, B, N]
            best = -np.sort(-scores64, axis=2)[..., :k]  # [R + 1, B, k]
            tolerance = 1e-5 * np.abs(best).max(axis=2, keepdims=True)  # [R + 1, B, 1]
            kernels: dict[str, Callable[[np.ndarray], np.ndarray]] = {
                "torch": lambda b: torch.topk(torch.from_numpy(b) @ vectors.T, k, dim=1).indices.numpy(),
                "float32-slices": lambda b: one_pass.search(b, k)[1],
                "served": lambda b: served.search(b, k)[1],
                **({"bf16-pass": lambda b: bf16.search(b, k)[1]} if bf16 else {}),
                "torch-fp16": lambda b: torch.topk(
                    torch.from_numpy(b).half() @ half.T, k, dim=1
                ).indices.numpy(),
            }
            row: dict = {"batch": size}
            for name, search in kernels.items():
                ms, ids = timed(search, blocks, evict)
                ranked = np.take_along_axis(scores64, ids, axis=2)  # [R + 1, B, k]
                same = float(np.mean(np.all(np.abs(ranked - best) <= tolerance, axis=2)))
                row[name] = {"ms": round(ms, 2), "exact_top_k": round(same, 4)}
            rows.append(row)
            print(row, flush=True)
    result = {**provenance(), "pool": list(pool.shape), "k": k, "threads": args.threads, "cold_mb": args.cold,
              "rows": rows}  # fmt: skip
    if args.out:
        write_json_atomic(args.out, result)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
