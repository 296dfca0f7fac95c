"""What a metadata filter costs a request, and what searching within the allowed responses buys over
filtering an unfiltered answer afterwards.

The bundle's pool is given a synthetic field, ``shard``: a response's id modulo 1,000, so a filter
naming s shards allows s / 1,000 of the pool, spread evenly over it. For each share, lone requests
(chitchat contexts, one after another, the bundle's default fusion and ``--candidates``) are timed
through :class:`~coreply.responder.Responder` (the service's ranking path, in process) with the filter,
each beside the same context unfiltered. The alternative a team would otherwise write around a service
without filters, asking for the top ``--candidates`` and keeping the allowed ones, is counted too: how
many of its requests come back with fewer than ``--top-k`` answers, or none.

    python bench/filtered.py --bundle artifacts/default-bundle --limit 200 --out docs/filtered-cpu.json
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from functools import partial

import numpy as np

from bench import add_pairs_args, chosen_pairs, provenance, refuse_below, responder
from coreply.artifacts import write_json_atomic

SHARDS = 1000
SHARES = (0.001, 0.01, 0.1, 0.5, 1.0)


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
    add_pairs_args(p, "test", 0, 200)
    args = p.parse_args()
    refuse_below(args, candidates=1, top_k=1, threads=1)
    if args.top_k > args.candidates:
        raise SystemExit(f"--top-k {args.top_k}: more than --candidates {args.candidates}; give fewer")
    pairs = chosen_pairs(args)
    bot = responder(args.bundle, threads=args.threads)
    bot.bundle = replace(bot.bundle, metadata=[{"shard": i % SHARDS} for i in range(len(bot.bundle.texts))])
    options = {"top_k": args.top_k, "n_candidates": args.candidates}
    for pair in pairs[:5]:  # warm up
        bot.respond(pair.context, **options)
    rows = []
    for share in SHARES:
        where = {"shard": list(range(round(share * SHARDS)))}
        allowed = bot.bundle.filters.allowed(where)
        ms, plain, short, empty, after_short, after_empty = [], [], 0, 0, 0, 0
        for pair in pairs:  # each context unfiltered, then filtered: the same cache state for both
            plain.append(timed(partial(bot.respond, pair.context, **options))[0])
            took, got = timed(partial(bot.respond, pair.context, filter=where, **options))
            assert all(allowed[r.id] for r in got)
            ms.append(took)
            short, empty = short + (len(got) < args.top_k), empty + (not got)
            unfiltered = bot.respond(pair.context, top_k=args.candidates, n_candidates=args.candidates)
            kept = [r for r in unfiltered if allowed[r.id]]
            after_short, after_empty = after_short + (len(kept) < args.top_k), after_empty + (not kept)
        rows.append(
            {
                "share allowed": share,
                "responses allowed": int(allowed.sum()),
                "p50 ms": round(float(np.median(ms)), 2),
                "p95 ms": round(float(np.percentile(ms, 95)), 2),
                "unfiltered p50 ms": round(float(np.median(plain)), 2),
                f"short of top_k {args.top_k} %": round(100 * short / len(pairs), 1),
                "filtered after: short %": round(100 * after_short / len(pairs), 1),
                "filtered after: no answer %": round(100 * after_empty / len(pairs), 1),
            }
        )
        print(rows[-1], flush=True)
    result = {
        "bundle": bot.bundle.version,
        "requests": len(pairs),
        "candidates": args.candidates,
        "top_k": args.top_k,
        "threads": args.threads,
        "filtered": rows,
        **provenance(),
    }
    if args.out:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
