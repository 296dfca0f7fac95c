"""Dense retrieval reordered by BM25: does the lexical match of a candidate with the context add to the
retriever's own order? Protocol B: the retriever's first ``--depth`` candidates per context, each also
scored by BM25 against the context's turns (the service's lexical stage's scorer, ``coreply.lexical``,
over the same pool; tests hold it equal to bm25s's, which section 34 measured with), fused as the
service fuses a reranker's scores (``zscore``: weight * z(dense) +
(1 - weight) * z(BM25) per context). The dense stage is either a retriever (``--bi``: raw, over the full
pool or, with ``--pool N``, every gold and a seeded sample of the rest; echoes of a context's turns
dropped, no restatement guard or prior) or a bundle as it serves (``--bundle``: its own pool, index,
ONNX graphs, echo filter, restatement guard and response prior, but not its own lexical stage, which
this script re-measures; ``--guard-quantile Q`` re-calibrates the guard at Q on the validation split, as
``coreply index build --restatement-quantile`` would).
Every ``--weights`` value at every BM25 setting (``--k1`` x ``--b``; default bm25s's and the service's,
1.5 and 0.75) on each split (``--start`` and ``--limit`` say which pairs), against dense alone: hits@1 /
hits@10, wins, losses, a one-sided paired bootstrap p, and how often the top answer restates the last
turn (``restatement_guard.py``'s two judges; people's own rate beside). ``--query`` says which turns
BM25 reads: ``all`` (the service's lexical stage), ``last`` or ``earlier`` (every turn but the last). The
weight (and setting) with the best hits@1 on the first split named (validation) is the choice. The
JSON's protocol B rows read with ``bench/compare_evals.py``.

    python bench/hybrid_bm25.py --bi coreply/weights/default-bi --split valid test \\
        --out docs/hybrid-bm25-2026-11-26.json.gz               # ~15 min here: the pool encoded once, fp32
    python bench/hybrid_bm25.py --bundle artifacts/default-bundle --split valid test \\
        --out docs/hybrid-bm25-served-2026-11-26.json.gz
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from bm25s.stopwords import STOPWORDS_EN

from bench import provenance, refuse_below  # bench/bench.py: this script's directory is on sys.path
from coreply import restatement
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_bi
from coreply.config import ZERO_SHOT
from coreply.corpus import load_chitchat, normalize, responses_of
from coreply.lexical import BM25, TermIndex
from coreply.ranking import Pipeline
from coreply.responder import Responder
from evaluation.metrics import paired_bootstrap, per_case, summarize
from evaluation.protocols import (
    DenseRetriever,
    Retrieved,
    pool_for_eval,
    ranked_ids,
    ranks_for,
    retrieve_and_rerank,
)
from evaluation.restatement import RestatementJudge, words_rate

QUERIES = {
    "all": lambda turns: turns,  # as the service's lexical stage reads them (the pairs hold <= 5 turns)
    "last": lambda turns: turns[-1:],
    "earlier": lambda turns: turns[:-1],  # the topic, not the words a restatement repeats
}


def dense_stage(args: argparse.Namespace, splits: dict) -> Pipeline:
    """The first stage: a bundle's pipeline as it serves, or a retriever's raw exact search."""
    try:
        if args.bundle:
            bot = Responder.load(args.bundle)
        else:
            bi = load_bi(args.bi)
    except (OSError, ValueError) as exc:  # a CheckpointError or BundleError too
        raise SystemExit(f"--{'bundle' if args.bundle else 'bi'}: {exc}") from None
    if args.bundle:
        if args.guard_quantile is not None:  # calibrated as the builder does, on the validation split
            if bot.pipeline.guard is None:
                raise SystemExit(f"--guard-quantile: {args.bundle} has no restatement guard (rebuild it)")
            entry = restatement.calibrate(bot.backend.encode_responses, splits["valid"], args.guard_quantile)
            bot.pipeline.guard = restatement.Guard.of(entry)
            print("guard", entry, flush=True)
        bot.pipeline.lexical = None  # the dense stage alone: the rows below are BM25 over it
        return bot.pipeline
    golds = [pair for s in args.split for pair in splits[s][args.start : args.start + args.limit]]
    pool = pool_for_eval(responses_of(splits), golds, args.pool or None, 0)
    if args.pool and len(pool) > args.pool:
        raise SystemExit(f"--pool: the golds alone are {len(pool)} responses; give at least that many")
    return Pipeline(DenseRetriever(bi, pool), pool, [normalize(t) for t in pool])  # the pool encoded once


def measure(split: str, pairs: list, dense: Pipeline, bm25s: list[BM25], terms: TermIndex,
            judge: RestatementJudge, args: argparse.Namespace) -> list[dict]:  # fmt: skip
    """One split's rows: dense alone, then dense + BM25 at each setting of BM25 (k1, b) and each weight
    against it; the dense candidates are searched once, the pool's ``terms`` counted once, for them all."""
    contexts = [p.context for p in pairs]
    dense_only = retrieve_and_rerank(pairs, dense, args.depth, 0)
    queries = [" ".join(QUERIES[args.query](context)) for context in contexts]

    def row(got: Retrieved, name: str, weight: float | None, dense_ranks: list | None = None) -> dict:
        """A row; a weighted one is paired with ``dense_ranks``, dense alone's."""
        fusion, w = ("retrieval", 0.0) if weight is None else ("zscore", weight)
        ranks = ranks_for(pairs, dense.keys, got, fusion, args.depth, w)
        top = [dense.texts[ids[0]] if len(ids) else None for ids in ranked_ids(got, fusion, args.depth, w)]
        restates = {"judge": round(judge.rate(contexts, top), 2), "words": words_rate(contexts, top)}
        out = {"system": f"{split}: {name}", "split": split, "metrics": summarize(ranks), "ranks": ranks,
               "restates": restates}  # fmt: skip
        if weight is not None:
            mine, theirs = per_case(ranks, "hits@1"), per_case(dense_ranks, "hits@1")
            versus = {"wins": int((mine > theirs).sum()), "losses": int((mine < theirs).sum()),
                      "p": round(paired_bootstrap(mine, theirs), 4)}  # fmt: skip
            out |= {"weight": weight, "against_dense": versus}
        m = out["metrics"]
        line = f"{split:5} {name:44} hits@1 {m['hits@1']:5.2f} hits@10 {m['hits@10']:5.2f}"
        print(line, out["restates"], out.get("against_dense", ""), flush=True)
        return out

    rows = [row(dense_only, "dense", None)]
    for bm25 in bm25s:
        got = replace(
            dense_only,
            candidates=[
                replace(c, rerank=bm25.scores_at(q, terms, c.ids))
                for q, c in zip(queries, dense_only.candidates, strict=True)
            ],
        )
        for weight in args.weights:
            name = f"dense + BM25 (k1={bm25.k1:g}, b={bm25.b:g}), w={weight}"
            rows.append(row(got, name, weight, rows[0]["ranks"]) | {"k1": bm25.k1, "b": bm25.b})
    gold = [p.response for p in pairs]
    people = {"judge": round(judge.rate(contexts, gold), 2), "words": words_rate(contexts, gold)}
    rows[0]["people_restate"] = people
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    first = p.add_mutually_exclusive_group()
    first.add_argument("--bi", default="coreply/weights/default-bi", help="a retriever's checkpoint (raw)")
    first.add_argument("--bundle", help="a bundle, as it serves (instead of --bi)")
    p.add_argument("--split", nargs="+", default=["valid", "test"], choices=["valid", "test"])
    p.add_argument("--limit", type=int, default=2000, help="N pairs of each split, from --start")
    p.add_argument("--start", type=int, default=0, help="skip the first pairs of each split")
    p.add_argument("--pool", type=int, default=0, help="with --bi: a sub-pool of N responses (0: all)")
    p.add_argument("--depth", type=int, default=100, help="dense candidates BM25 reorders")
    p.add_argument("--guard-quantile", type=float, help="with --bundle: its restatement guard re-calibrated")
    p.add_argument("--query", choices=list(QUERIES), default="all", help="the context turns BM25 reads")
    p.add_argument("--weights", type=float, nargs="+", default=[0.9, 0.8, 0.7, 0.6, 0.5])
    p.add_argument("--k1", type=float, nargs="+", default=[1.5], help="BM25's term saturation (each > 0)")
    p.add_argument("--b", type=float, nargs="+", default=[0.75], help="BM25's length norm (each in [0, 1])")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = p.parse_args()
    refuse_below(args, limit=1, start=0, depth=2, pool=0)  # and --out, found before encoding
    if args.pool and args.bundle:
        raise SystemExit("--pool: a bundle searches its own pool; give --pool with --bi only")
    if args.guard_quantile is not None and not (args.bundle and 0.5 <= args.guard_quantile < 1):
        raise SystemExit("--guard-quantile: give one in [0.5, 1), with --bundle")
    if not all(0 <= w < 1 for w in args.weights):
        raise SystemExit("--weights: each in [0, 1) (1 is dense alone, always measured)")
    if not all(k1 > 0 for k1 in args.k1):
        raise SystemExit("--k1: each must be > 0")
    if not all(0 <= b <= 1 for b in args.b):
        raise SystemExit("--b: each must be in [0, 1]")
    splits = load_chitchat()
    start = time.perf_counter()
    dense = dense_stage(args, splits)
    fitted = BM25.fit(dense.texts, STOPWORDS_EN)
    bm25s = [replace(fitted, k1=k1, b=b) for k1 in args.k1 for b in args.b]
    terms = fitted.index(dense.texts)  # the service's term counts: every setting scores from them
    judge = RestatementJudge(load_bi(ZERO_SHOT))
    print(f"pool of {len(dense.texts)} ready in {time.perf_counter() - start:.0f} s", flush=True)
    rows: list[dict] = []
    for split in args.split:
        rows += measure(
            split, splits[split][args.start : args.start + args.limit], dense, bm25s, terms, judge, args
        )
    weighted = [r for r in rows if r["split"] == args.split[0] and "weight" in r]
    best = max(weighted, key=lambda r: r["metrics"]["hits@1"])  # ties: the setting named first
    chosen = {"weight": best["weight"], "k1": best["k1"], "b": best["b"]}
    result = provenance() | {"first_stage": args.bundle or args.bi, "served": bool(args.bundle),
                             "guard_quantile": args.guard_quantile, "query": args.query,
                             "pool_size": len(dense.texts), "depth": args.depth,
                             "pairs": f"[{args.start}:{args.start + args.limit}]",
                             "chosen_weight": chosen | {"on": args.split[0]}, "B": rows}  # fmt: skip
    write_json_atomic(args.out, result)
    print(f"wrote {args.out} (chosen on {args.split[0]}: {chosen})")


if __name__ == "__main__":
    main()
