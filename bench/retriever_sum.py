"""Two retrievers, and their sum: does one index of both retrievers' vectors side by side (its inner
product is the sum of their scores) answer better than either alone? Given one retriever, its rows
alone (both splits over one encoding of the pool). Protocol B in the retrievers' own order: the first
``--limit`` pairs of each split over the full pool (or, with ``--pool N``, every gold plus a seeded
sample of the rest), echoes of a context's turns dropped, no restatement guard or prior. Per split:
hits@1 / hits@10 of each retriever and of the sum, and the sum's wins, losses and one-sided paired
bootstrap p against each. The JSON's protocol B rows read with ``bench/compare_evals.py``.

    python bench/retriever_sum.py --bi coreply/weights/default-bi runs/lease/core/bi --split valid test \\
        --out docs/retriever-sum-2026-11-26.json.gz      # ~35 min here: each pool encoded once, fp32
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench import provenance, refuse_below  # bench/bench.py: this script's directory is on sys.path
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_bi
from coreply.corpus import load_chitchat, responses_of
from coreply.models import BiEncoder
from evaluation.metrics import paired_bootstrap, per_case
from evaluation.protocols import evaluate_pool, pool_for_eval, recall_pool


class PoolCached:
    """A retriever whose pool vectors are computed once (every split searches the same pool)."""

    def __init__(self, bi: BiEncoder, pool: Sequence[str]) -> None:
        self.bi, self.pool, self.device = bi, pool, bi.device
        self._pool_vectors: torch.Tensor | None = None

    def embed_responses(self, texts: Sequence[str]) -> torch.Tensor:
        if texts is not self.pool:
            return self.bi.embed_responses(texts)
        if self._pool_vectors is None:
            self._pool_vectors = self.bi.embed_responses(texts)  # [P, D]
        return self._pool_vectors

    def embed_contexts(self, contexts: Sequence[Sequence[str]]) -> torch.Tensor:
        return self.bi.embed_contexts(contexts)  # [N, D]


class Sum:
    """Two retrievers as one: vectors side by side, so an inner product is the sum of their scores."""

    def __init__(self, a: PoolCached, b: PoolCached) -> None:
        self.a, self.b, self.device = a, b, a.device

    def embed_responses(self, texts: Sequence[str]) -> torch.Tensor:
        return torch.cat([self.a.embed_responses(texts), self.b.embed_responses(texts)], 1)  # [P, Da + Db]

    def embed_contexts(self, contexts: Sequence[Sequence[str]]) -> torch.Tensor:
        both = [self.a.embed_contexts(contexts), self.b.embed_contexts(contexts)]
        return torch.cat(both, 1)  # [N, Da + Db]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bi", nargs="+", required=True, metavar="CHECKPOINT", help="one retriever, or two")
    p.add_argument("--split", nargs="+", default=["valid", "test"], choices=["valid", "test"])
    p.add_argument("--limit", type=int, default=2000, help="first N pairs of each split")
    p.add_argument("--pool", type=int, default=0, help="a sub-pool of N responses (0: the full pool)")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = p.parse_args()
    if len(args.bi) > 2 or len(set(args.bi)) < len(args.bi):
        raise SystemExit("--bi: name one retriever, or two different ones")
    refuse_below(args, limit=1, pool=0)  # and --out: found now, not after half an hour of encoding
    splits = load_chitchat()
    golds = [pair for s in args.split for pair in splits[s][: args.limit]]
    pool = pool_for_eval(responses_of(splits), golds, args.pool or None, 0)
    if args.pool and len(pool) > args.pool:
        raise SystemExit(f"--pool: the golds alone are {len(pool)} responses; give at least that many")
    try:
        models = [PoolCached(load_bi(path), pool) for path in args.bi]
    except (OSError, ValueError) as exc:  # a CheckpointError too
        raise SystemExit(f"--bi: {exc}") from None
    systems: dict[str, PoolCached | Sum] = dict(zip(args.bi, models, strict=True))
    if len(models) == 2:
        systems["sum"] = Sum(*models)
    rows: list[dict] = []
    result = provenance() | {"bi": args.bi, "pool_size": len(pool), "limit": args.limit, "B": rows}
    for split in args.split:
        pairs = splits[split][: args.limit]
        ranks = {}
        for name, model in systems.items():
            start = time.perf_counter()
            got = evaluate_pool(pairs, pool, recall_pool(pairs, pool, model))["bi_pool"]
            ranks[name] = got["ranks"]
            rows.append({"system": f"{split}: {name}", "split": split, **got})
            m = got["metrics"]
            print(f"{split:5} {name:30} hits@1 {m['hits@1']:5.2f} hits@10 {m['hits@10']:5.2f}"
                  f"  ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
        if "sum" not in systems:
            continue
        total = per_case(ranks["sum"], "hits@1")
        for name in args.bi:
            one = per_case(ranks[name], "hits@1")
            versus = {"wins": int((total > one).sum()), "losses": int((total < one).sum())}
            versus["p"] = round(paired_bootstrap(total, one), 4)
            rows[-1].setdefault("against", {})[name] = versus
            print(f"{split:5} sum against {name}: {versus}", flush=True)
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
