"""What a metadata filter costs a request, and what searching within the allowed responses buys over
filtering an unfiltered answer afterwards.

The bundle's pool is given synthetic fields, each a response's id modulo 1,000, 10 and 2 (``shard``,
``tenth``, ``half``), so the filters of :data:`FILTERS` allow 0.1 % to all of the pool, spread evenly
over it, with at most 10 values a field. For each filter, lone requests
(chitchat contexts, one after another, the bundle's default fusion and ``--candidates``) are timed
through :class:`~coreply.responder.Responder` (the service's ranking path, in process) with the filter,
each beside the same context unfiltered: whole requests and their search stage. The alternative a team
would otherwise write around a service without filters, asking for the top ``--candidates`` and keeping
the allowed ones, is counted too: how many of its requests come back with fewer than ``--top-k``
answers, or none.

``--factory`` searches the bundle's own vectors through an approximate FAISS index made here instead
(``IVF1024,Flat`` with ``--search-params nprobe=32``), as a bundle built with that factory would: a
filter allowing more than :data:`coreply.bundle.EXACT_WITHIN` responses is then searched by the index
itself, restricted to them, and each such request is also answered by the exact search within them
(over the stored vectors, as a narrower filter is), to count how often the top answer differs.

    python bench/filtered.py --bundle artifacts/default-bundle --limit 300 \\
        --out docs/filtered-cpu-2026-12-07.json
    python bench/filtered.py --bundle artifacts/default-bundle --limit 300 --factory IVF1024,Flat \\
        --search-params nprobe=32 --out docs/filtered-2026-12-07b/filtered-ivf.json
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from functools import partial

import numpy as np

import coreply.bundle
from bench import add_pairs_args, chosen_pairs, provenance, refuse_below, responder
from coreply.artifacts import write_json_atomic
from coreply.responder import Responder

FILTERS = (
    {"shard": 0},
    {"shard": list(range(10))},
    {"tenth": 0},
    {"half": 0},
    {"half": [0, 1]},
)
"""Filters allowing 0.1 %, 1 %, 10 %, 50 % and 100 % of the pool."""


def timed(call) -> tuple[float, object]:
    start = time.perf_counter()
    out = call()
    return 1000 * (time.perf_counter() - start), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle")
    p.add_argument("--candidates", type=int, default=10, help="n_r of every request")
    p.add_argument("--top-k", type=int, default=3, help="answers a request asks for")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of the backend")
    p.add_argument(
        "--factory", help="an approximate FAISS index over the bundle's vectors, e.g. IVF1024,Flat"
    )
    p.add_argument("--search-params", default="", help="for --factory, e.g. nprobe=32")
    p.add_argument(
        "--exact-within",
        type=int,
        default=coreply.bundle.EXACT_WITHIN,
        help="for --factory: the most responses a filter may allow and be searched exactly (default: "
        "coreply's)",
    )
    add_pairs_args(p, "test", 0, 200)
    args = p.parse_args()
    refuse_below(args, candidates=1, top_k=1, threads=1, exact_within=0)
    if args.top_k > args.candidates:
        raise SystemExit(f"--top-k {args.top_k}: more than --candidates {args.candidates}; give fewer")
    pairs = chosen_pairs(args)
    bot = responder(args.bundle, threads=args.threads)
    metadata = [{"shard": i % 1000, "tenth": i % 10, "half": i % 2} for i in range(len(bot.bundle.texts))]
    bundle = replace(bot.bundle, metadata=metadata)
    if args.factory:
        bundle = replace(bundle, index=approximate(bundle, args.factory, args.search_params))
        coreply.bundle.EXACT_WITHIN = args.exact_within
    bot = Responder(bundle, bot.backend)
    options = {"top_k": args.top_k, "n_candidates": args.candidates}
    for pair in pairs[:5]:  # warm up
        bot.respond(pair.context, **options)
    rows = []
    for where in FILTERS:
        allowed = bot.bundle.filters.allowed(where)
        ms, plain, search, plain_search, short, empty, after_short, after_empty = [], [], [], [], 0, 0, 0, 0
        reranked, plain_reranked = 0, 0  # requests the reranker read (the rerank gate skipped the rest)
        by_index = args.factory and allowed.sum() > coreply.bundle.EXACT_WITHIN
        other_top = 0  # requests whose top answer the exact search within the filter would change
        for pair in pairs:  # each context unfiltered, then filtered: the same cache state for both
            took, got = timed(partial(bot.respond, pair.context, **options))
            plain.append(took)
            plain_search.append(1000 * bot.pipeline.timings["search"])
            plain_reranked += bool(got) and got[0].rerank_score is not None
            took, got = timed(partial(bot.respond, pair.context, filter=where, **options))
            search.append(1000 * bot.pipeline.timings["search"])
            reranked += bool(got) and got[0].rerank_score is not None
            assert all(allowed[r.id] for r in got)
            ms.append(took)
            short, empty = short + (len(got) < args.top_k), empty + (not got)
            if by_index:
                other_top += [r.id for r in got[:1]] != exactly_within(bot, pair.context, where, options)[:1]
            unfiltered = bot.respond(pair.context, top_k=args.candidates, n_candidates=args.candidates)
            kept = [r for r in unfiltered if allowed[r.id]]
            after_short, after_empty = after_short + (len(kept) < args.top_k), after_empty + (not kept)
        rows.append(
            {
                "filter": where,
                "share allowed": round(float(allowed.mean()), 4),
                "responses allowed": int(allowed.sum()),
                "p50 ms": round(float(np.median(ms)), 2),
                "p95 ms": round(float(np.percentile(ms, 95)), 2),
                "unfiltered p50 ms": round(float(np.median(plain)), 2),
                "paired difference p50 ms": round(float(np.median(np.subtract(ms, plain))), 2),
                "search p50 ms": round(float(np.median(search)), 2),
                "unfiltered search p50 ms": round(float(np.median(plain_search)), 2),
                "reranked %": round(100 * reranked / len(pairs), 1),
                "unfiltered reranked %": round(100 * plain_reranked / len(pairs), 1),
                f"short of top_k {args.top_k} %": round(100 * short / len(pairs), 1),
                "filtered after: short %": round(100 * after_short / len(pairs), 1),
                "filtered after: no answer %": round(100 * after_empty / len(pairs), 1),
                "searched by": "the index, within the filter" if by_index else "exactly, within the filter",
                **(
                    {"top answer not the exact search's %": round(100 * other_top / len(pairs), 1)}
                    if by_index
                    else {}
                ),
            }
        )
        print(rows[-1], flush=True)
    result = {
        "bundle": bot.bundle.version,
        "requests": len(pairs),
        "candidates": args.candidates,
        "top_k": args.top_k,
        "threads": args.threads,
        "index": f"{args.factory} {args.search_params}".strip() if args.factory else "the bundle's",
        "exact_within": coreply.bundle.EXACT_WITHIN,
        "filtered": rows,
        **provenance(),
    }
    if args.out:
        write_json_atomic(args.out, result)


def approximate(bundle, factory: str, params: str):
    """An approximate FAISS index over ``bundle``'s stored vectors, searched with ``params``, its vectors
    readable as a bundle's are."""
    from index_builder.faiss_index import make_index

    vectors = bundle.index.reconstruct_batch(np.arange(bundle.index.ntotal))  # [N, D]
    try:
        index = make_index(vectors, factory, gpu=False)
        coreply.bundle.apply_search_params(index, params)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    coreply.bundle.make_readable(index, bundle.root)
    return index


def exactly_within(bot: Responder, context, where, options) -> list[int]:
    """The answer's ids as the exact search within the filter gives them, whatever it allows."""
    threshold = coreply.bundle.EXACT_WITHIN
    coreply.bundle.EXACT_WITHIN = len(bot.bundle.texts)
    try:
        return [r.id for r in bot.respond(context, filter=where, **options)]
    finally:
        coreply.bundle.EXACT_WITHIN = threshold


if __name__ == "__main__":
    main()
