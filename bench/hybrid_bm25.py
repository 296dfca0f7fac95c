"""Dense retrieval reordered by BM25: does the lexical match of a candidate with the context add to the
retriever's own order? Protocol B over the full pool (or, with ``--pool N``, every gold and a seeded
sample of the rest), echoes of a context's turns dropped, no restatement guard or prior: the retriever's
first ``--depth`` candidates per context, each also scored by BM25 against the context's turns
(``evaluation.protocols.BM25Retriever``'s index and tokenisation), fused as the service fuses a
reranker's scores (``zscore``: weight * z(dense) + (1 - weight) * z(BM25) per context). Every
``--weights`` value on each split; the weight is chosen on the first split named (validation), and each
split reports every weight against dense alone: hits@1 / hits@10, wins, losses and a one-sided paired
bootstrap p. The JSON's protocol B rows read with ``bench/compare_evals.py``.

    python bench/hybrid_bm25.py --bi coreply/weights/default-bi --split valid test \\
        --out docs/hybrid-bm25-2026-11-26.json                  # ~15 min here: the pool encoded once, fp32
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench import provenance  # bench/bench.py: this script's directory is on sys.path
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_bi
from coreply.corpus import load_chitchat, normalize, responses_of
from coreply.ranking import Pipeline
from evaluation.metrics import paired_bootstrap, per_case, summarize
from evaluation.protocols import BM25Retriever, DenseRetriever, pool_for_eval, ranks_for, retrieve_and_rerank


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bi", default="coreply/weights/default-bi", help="the retriever's checkpoint")
    p.add_argument("--split", nargs="+", default=["valid", "test"], choices=["valid", "test"])
    p.add_argument("--limit", type=int, default=2000, help="first N pairs of each split")
    p.add_argument("--pool", type=int, default=0, help="a sub-pool of N responses (0: the full pool)")
    p.add_argument("--depth", type=int, default=100, help="dense candidates BM25 reorders")
    p.add_argument("--weights", type=float, nargs="+", default=[0.9, 0.8, 0.7, 0.6, 0.5])
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = p.parse_args()
    for flag, least in (("limit", 1), ("depth", 2), ("pool", 0)):
        if (value := getattr(args, flag)) < least:
            raise SystemExit(f"--{flag}: give at least {least}, got {value}")
    if not all(0 <= w < 1 for w in args.weights):
        raise SystemExit("--weights: each in [0, 1) (1 is dense alone, always measured)")
    if not args.out.parent.is_dir():  # found now, not after the pool's encoding
        raise SystemExit(f"--out: {args.out.parent} is not a folder; create it or name another")
    try:
        bi = load_bi(args.bi)
    except (OSError, ValueError) as exc:  # a CheckpointError too
        raise SystemExit(f"--bi: {exc}") from None
    splits = load_chitchat()
    golds = [pair for s in args.split for pair in splits[s][: args.limit]]
    pool = pool_for_eval(responses_of(splits), golds, args.pool or None, 0)
    if args.pool and len(pool) > args.pool:
        raise SystemExit(f"--pool: the golds alone are {len(pool)} responses; give at least that many")
    keys = [normalize(t) for t in pool]
    start = time.perf_counter()
    dense = Pipeline(DenseRetriever(bi, pool), pool, keys)  # the pool encoded once for every split
    bm25 = BM25Retriever(pool)
    print(f"pool of {len(pool)} encoded and indexed in {time.perf_counter() - start:.0f} s", flush=True)
    rows: list[dict] = []
    result = provenance() | {"bi": args.bi, "pool_size": len(pool), "depth": args.depth, "B": rows}
    for split in args.split:
        pairs = splits[split][: args.limit]
        got = retrieve_and_rerank(pairs, dense, args.depth, 0)
        queries = bm25.tokens([" ".join(p.context) for p in pairs])
        got = replace(
            got,
            candidates=[
                replace(c, rerank=bm25.scores(q)[c.ids[: args.depth]].astype(np.float64))
                for c, q in zip(got.candidates, queries, strict=True)
            ],
        )
        alone = ranks_for(pairs, keys, got, "retrieval", args.depth)
        m = summarize(alone)
        rows.append({"system": f"{split}: dense", "split": split, "metrics": m, "ranks": alone})
        print(f"{split:5} dense alone hits@1 {m['hits@1']:5.2f} hits@10 {m['hits@10']:5.2f}", flush=True)
        base = per_case(alone, "hits@1")
        fused = {}
        for w in args.weights:
            ranks = ranks_for(pairs, keys, got, "zscore", args.depth, w)
            mine = per_case(ranks, "hits@1")
            versus = {"wins": int((mine > base).sum()), "losses": int((mine < base).sum())}
            versus["p"] = round(paired_bootstrap(mine, base), 4)
            m = fused[w] = summarize(ranks)
            rows.append({"system": f"{split}: dense + BM25, w={w}", "split": split, "weight": w,
                         "metrics": m, "ranks": ranks, "against_dense": versus})  # fmt: skip
            line = f"{split:5} w={w:.2f} hits@1 {m['hits@1']:5.2f} hits@10 {m['hits@10']:5.2f}"
            print(line, versus, flush=True)
        if "chosen_weight" not in result:  # the first split's best (ties: the weight named first)
            chosen = max(args.weights, key=lambda w: fused[w]["hits@1"])
            result["chosen_weight"] = {"weight": chosen, "on": split}
    write_json_atomic(args.out, result)
    print(f"wrote {args.out} (weight chosen on {args.split[0]}: {result['chosen_weight']['weight']})")


if __name__ == "__main__":
    main()
