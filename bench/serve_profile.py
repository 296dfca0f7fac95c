"""Where a request's time goes (issue #14), in process: a bundle's answer path, the service's own
:class:`~coreply.ranking.Pipeline` without HTTP, queueing or micro-batching, over chitchat test
contexts in batches of the given sizes (1: a lone client; 64: what the micro-batcher builds under load).
Per stage (encode, search, filter, lexical, rerank) by the wall clock, then once more under
``torch.profiler``: host and, on CUDA, device time per operator, and how much of the wall the device was
busy. With the ONNX backend the models run outside PyTorch; ``bench/rerank_ops.py`` profiles those per
operator. ``--no-lexical`` answers without the bundle's lexical stage (its cost: the difference of two runs);
``--padded`` runs the PyTorch backend's batches with their padding, as before packing (on CUDA the backend
packs them where PyTorch has variable-length attention).

    python bench/serve_profile.py --bundle artifacts/gpu-bench --backend torch --device cuda \\
        --n-r 100 --batch 1 64 --out docs/serve-profile-gpu.json
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# bench/bench.py: this script's directory is on sys.path
from bench import device_busy_share, open_bundle, operators, provenance
from coreply.artifacts import write_json_atomic
from coreply.bundle import BACKENDS, make_backend, pipeline, search_on
from coreply.corpus import load_chitchat
from coreply.device import resolve_device
from coreply.ranking import Pipeline, Query


def answer(ranking: Pipeline, queries: list[Query], n_r: int, cuda: bool) -> dict[str, float]:
    """One batch through recall and rerank; seconds per stage."""
    start = time.perf_counter()
    candidates = ranking.recall(queries, [n_r] * len(queries))
    recalled = time.perf_counter()
    if ranking.reranker is not None:
        ranking.rerank(ranking.ground(queries), candidates, n_r)
    if cuda:
        torch.cuda.synchronize()
    done = time.perf_counter()
    encode, search, lexical = (ranking.timings.get(k, 0.0) for k in ("encode", "search", "lexical"))
    return {
        "encode": encode,
        "search": search,
        "filter": recalled - start - encode - search - lexical,  # echo and guard filtering
        "lexical": lexical,
        "rerank": done - recalled,
        "total": done - start,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True)
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the service's COREPLY_DEVICE)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (CPU)")
    p.add_argument("--n-r", type=int, default=100, help="candidates recalled and reranked per request")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="requests answered together")
    p.add_argument("--requests", type=int, default=128, help="test contexts per batch size")
    p.add_argument("--top", type=int, default=15, help="operators listed per batch size")
    p.add_argument("--no-lexical", action="store_true", help="without the bundle's lexical stage")
    p.add_argument(
        "--padded", action="store_true", help="the PyTorch backend's batches not packed (COREPLY_PACKED=0)"
    )
    p.add_argument("--out", type=Path, help="write the result as JSON here too")
    args = p.parse_args()
    if min(args.n_r, args.requests, args.top, args.threads, *args.batch) < 1:
        raise SystemExit("--n-r, --requests, --top, --threads and every --batch must be >= 1")
    try:
        cuda = resolve_device(args.device).type == "cuda"
    except ValueError as exc:
        raise SystemExit(f"--device: {exc}") from None
    bundle = search_on(open_bundle(args.bundle), args.device)
    backend = make_backend(bundle, args.backend, args.threads, args.device, packed=not args.padded)
    ranking = pipeline(bundle, backend)
    if args.no_lexical:
        ranking.lexical = None
    contexts = [p.context for p in load_chitchat()["test"][: args.requests]]
    result: dict = provenance() | {"bundle": args.bundle, "device": args.device, "n_r": args.n_r,
                                   "lexical": ranking.lexical is not None,
                                   "packed": getattr(getattr(backend, "bi", None), "packs", False),
                                   "rows": []}  # fmt: skip
    for size in args.batch:
        batches = [[Query(tuple(c)) for c in contexts[i : i + size]] for i in range(0, len(contexts), size)]
        answer(ranking, batches[0], args.n_r, cuda)  # warm-up: caches, kernels, allocator
        times = [answer(ranking, b, args.n_r, cuda) for b in batches]
        stages = {k: round(1000 * float(np.mean([t[k] for t in times])), 2) for k in times[0]}
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for b in batches:
                answer(ranking, b, args.n_r, cuda)
            wall = time.perf_counter() - start
        ops = operators(prof, cuda, len(batches), args.top)
        row = {
            "batch": size,
            "batches": len(batches),
            "ms_per_batch": stages,
            "requests_per_s": round(len(contexts) / sum(t["total"] for t in times), 1),
            "device_busy_share": device_busy_share(prof, wall) if cuda else None,
            "operators": ops,
        }
        result["rows"].append(row)
        print(f"\nbatch {size}: ms per batch {stages}, {row['requests_per_s']} requests/s", end="")
        print(f", device busy {100 * row['device_busy_share']:.0f} % of the wall" if cuda else "")
        print("| operator (per batch) | calls | self host ms | self device ms |\n|---|---|---|---|")
        for op in ops:
            print(f"| {op['op']} | {op['calls_per_batch']} | {op['self_host_ms']} | {op['self_device_ms']} |")
    if args.out:
        write_json_atomic(args.out, result, sort_keys=False)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
