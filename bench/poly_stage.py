"""What the poly rerank stage costs per request: reading n_r candidates' vectors back from a FAISS
index and the Poly-encoder's code attention over them (coreply.ranking.Pipeline.rerank, the code the
service runs), for m = 16, 64 and 360 codes. The index holds a pool the size of the default bundle's
(random unit vectors of the all-MiniLM-L6-v2 width: the cost does not depend on their values).

With ``--bundle DIR`` it also times what the stage adds to a whole request in the in-process engine
(int8 ONNX, one thread, chitchat test contexts): ``fusion=retrieval`` and ``fusion=rerank`` alternate
on the same contexts at n_candidates = n_r. A missing DIR is built first from all-MiniLM-L6-v2 as a
Poly-encoder with untrained codes over the first ``--bundle-pool`` chitchat responses (latency only).

    python bench/poly_stage.py --bundle artifacts/poly-bench --out docs/poly-stage-cpu.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench import refuse_below  # bench/bench.py: this script's directory is on sys.path
from coreply.artifacts import write_json_atomic
from coreply.bundle import BundleError, IndexRetriever, read_manifest, rerank_stage
from coreply.ranking import Candidates, Pipeline, Query


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", type=int, default=100_000, help="responses in the index")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--n-r", type=int, default=100, help="candidates the stage rescores")
    p.add_argument("--codes", type=int, nargs="+", default=[16, 64, 360])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the service's default)")
    p.add_argument("--bundle", default=None, help="also time whole requests on this (poly) bundle")
    p.add_argument("--bundle-pool", type=int, default=20_000)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    refuse_below(args, pool=1, dim=1, n_r=1, requests=1, threads=1, bundle_pool=1)
    if args.n_r > args.pool:
        raise SystemExit(f"--n-r: at most --pool ({args.pool}), got {args.n_r}")
    if min(args.codes) < 1:
        raise SystemExit(f"--codes: each at least 1, got {args.codes}")
    if args.bundle and Path(args.bundle).exists():  # checked before the timing, not after it
        try:
            stage = rerank_stage(read_manifest(Path(args.bundle)))
        except BundleError as exc:
            raise SystemExit(f"--bundle: {exc}") from None
        if stage != "poly":
            raise SystemExit(
                f"--bundle {args.bundle}: its rerank stage is {stage}, not poly; name a new folder"
            )
    elif args.bundle and not Path(args.bundle).parent.is_dir():
        raise SystemExit(f"--bundle: {Path(args.bundle).parent} is not a folder; create it or name another")

    import faiss

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((args.pool, args.dim)).astype("float32")
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = faiss.IndexFlatIP(args.dim)
    index.add(vectors)
    retriever = IndexRetriever(backend=None, index=index)  # only its vector cache is used here
    texts = [""] * args.pool
    ranking = Pipeline(retriever, texts, texts, poly=True)
    rows = []
    for m in args.codes:
        times = []
        for _ in range(args.requests):
            ids = rng.choice(args.pool, size=args.n_r, replace=False)
            codes = rng.standard_normal((m, args.dim)).astype("float32")
            candidates = [Candidates(ids, np.zeros(args.n_r), codes=codes)]
            start = time.perf_counter()
            ranking.rerank([Query(("",))], candidates, args.n_r)
            times.append(time.perf_counter() - start)
        ms = 1000 * np.asarray(times[10:])  # the first calls warm the allocator
        rows.append(
            {
                "codes": m,
                "p50_ms": round(float(np.percentile(ms, 50)), 3),
                "p99_ms": round(float(np.percentile(ms, 99)), 3),
                "mean_ms": round(float(ms.mean()), 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "what": "poly rerank stage per request: index reconstruct_batch + code attention",
        "engine": engine_added_ms(args) if args.bundle else None,
        "pool": args.pool,
        "dim": args.dim,
        "n_r": args.n_r,
        "requests": args.requests,
        "threads": args.threads,
        "date": dt.date.today().isoformat(),
        "host": f"{platform.machine()}, {os.cpu_count()} vCPUs, torch {torch.__version__}",
        "command": " ".join(["python", *sys.argv]),
        "rows": rows,
    }
    if args.out:
        write_json_atomic(Path(args.out), result, sort_keys=False)


def engine_added_ms(args: argparse.Namespace) -> dict:
    """Median request time in the engine with and without the poly stage, alternating per context."""
    import asyncio

    from coreply.corpus import build_pool, load_chitchat
    from coreply.ranking import Query
    from service.engine import Job, load_engine
    from service.metrics import Metrics
    from service.settings import Settings

    splits = load_chitchat()
    if not Path(args.bundle).exists():
        make_poly_bundle(args.bundle, build_pool(p.response for p in splits["train"])[: args.bundle_pool])
    contexts = [p.context for p in splits["test"][: args.requests]]
    settings = Settings(
        bundle=Path(args.bundle), threads=args.threads, max_candidates=args.n_r, cascade=False
    )
    engine = load_engine(settings, Metrics())

    async def run() -> dict[str, list[float]]:
        await engine.start()
        times: dict[str, list[float]] = {"retrieval": [], "rerank": []}
        for i, context in enumerate(contexts):
            for fusion in ("retrieval", "rerank") if i % 2 else ("rerank", "retrieval"):
                start = time.perf_counter()
                await engine.respond(Job(Query(tuple(context)), 5, args.n_r, fusion))
                times[fusion].append(1000 * (time.perf_counter() - start))
        await engine.stop()
        return times

    times = asyncio.run(run())
    p50 = {k: float(np.percentile(v[10:], 50)) for k, v in times.items()}
    return {
        "bundle_pool": len(engine.bundle.texts),
        "requests": len(contexts),
        "p50_ms_retrieval_only": round(p50["retrieval"], 2),
        "p50_ms_with_poly_stage": round(p50["rerank"], 2),
        "p50_ms_added": round(p50["rerank"] - p50["retrieval"], 2),
    }


def make_poly_bundle(out: str, pool: list[str]) -> None:
    """all-MiniLM-L6-v2 as a Poly-encoder with 16 untrained codes, int8 ONNX, exact index."""
    import tempfile

    from coreply.checkpoint import save_checkpoint
    from coreply.config import ModelConfig
    from coreply.models import PolyEncoder
    from index_builder.build import build_bundle

    config = ModelConfig(share_towers=True, normalize=True, poly_codes=16)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(PolyEncoder.from_pretrained(config), Path(tmp) / "poly")
        build_bundle(out, pool, bi=str(Path(tmp) / "poly"), pool_source=f"chitchat train, first {len(pool)}")


if __name__ == "__main__":
    main()
