"""The response prior's weight chosen on the answers as served, not on retrieval alone.

A bundle's prior weight (alpha, :mod:`coreply.prior`) is chosen where it is built by the hits@1 of the
retriever alone (docs/results.md §21). The answer a request gets also passes the lexical stage, the rerank
gate and reach and the reranker, which may want the first stage's hubs pushed down harder or less. This
answers every context of the ``--choose`` spans through the bundle's :class:`~coreply.responder.Responder`
(the path of ``bench/as_served.py``) with its prior at each of ``--alphas``, everything else as built, and
pairs each weight with the bundle's own. The best (the bundle's own on a tie) is then measured against
the bundle's own on the ``--measure`` spans, which no choice has seen: what would ship is what holds there.

    python bench/prior_served.py --bundle artifacts/default-bundle --out docs/prior-served.json.gz
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from as_served import N_R, top1  # bench/: this script's directory is on sys.path

from bench import disjoint_spans, paired_hits, provenance, refuse_below, responder, span_name, span_pairs
from coreply.artifacts import write_json_atomic
from coreply.corpus import load_chitchat
from coreply.prior import Prior
from coreply.responder import Responder


def answer_at(bot: Responder, values: np.ndarray, alpha: float, pairs: list) -> np.ndarray:
    """[N] 1.0 where the bundle's top answer, with its prior at ``alpha``, is the pair's test reply."""
    bot.pipeline.retrieve.prior = Prior(alpha, values) if alpha else None
    return top1(bot, pairs, None)[1]


def memoised(encode: Callable[[list], np.ndarray]) -> Callable[[list], np.ndarray]:
    """``encode`` (contexts -> [B, D]) that encodes each context once (requests come one at a time)."""
    seen: dict[tuple[str, ...], np.ndarray] = {}

    def cached(contexts: list) -> np.ndarray:
        for context in contexts:
            if tuple(context) not in seen:
                seen[tuple(context)] = encode([context])[0]  # [D]
        return np.stack([seen[tuple(context)] for context in contexts])  # [B, D]

    return cached


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle", help="a bundle with a response prior")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.25, 0.75, 1.0, 1.5], help="weights to try")
    p.add_argument(
        "--choose", nargs="+", default=["valid:0:6623"], help="split:start:limit, where it chooses"
    )
    p.add_argument(
        "--measure", nargs="+", default=["test:0:6823"], help="held-out spans, disjoint from those"
    )
    p.add_argument("--threads", type=int, default=2, help="intra-op threads")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = p.parse_args()
    choose = disjoint_spans("--choose", args.choose)
    measure = disjoint_spans("--measure", args.measure, tuple(choose), "--choose")
    if any(not 0 <= a <= 10 for a in args.alphas):
        raise SystemExit(f"--alphas: give weights in [0, 10], got {args.alphas}")
    refuse_below(args, threads=1)
    bot = responder(args.bundle, threads=args.threads)
    if bot.bundle.prior is None:
        raise SystemExit(f"--bundle: {args.bundle} has no response prior")
    own, values = bot.bundle.prior.alpha, bot.bundle.prior.values
    backend = bot.pipeline.retrieve.backend  # a context's vector is the same at every weight
    backend.encode_contexts = memoised(backend.encode_contexts)
    alphas = sorted({own, *args.alphas})
    splits = load_chitchat()
    pairs = {
        s: span_pairs(flag, splits, s)
        for flag, spans in (("--choose", choose), ("--measure", measure))
        for s in spans
    }
    result: dict = provenance() | {"bundle": args.bundle, "own_alpha": own, "n_r": N_R, "choose": {}}

    def run(spans: list, weights: list[float], into: dict) -> dict[float, np.ndarray]:
        """Per weight (the bundle's own first), the hits over ``spans``, paired with its own in ``into``."""
        hits: dict[float, np.ndarray] = {}
        for alpha in weights:
            began = time.perf_counter()
            hits[alpha] = np.concatenate([answer_at(bot, values, alpha, pairs[s]) for s in spans])
            row = paired_hits(hits[alpha], hits[own], "p_beats_own") if alpha != own else {}
            into[str(alpha)] = {"hits@1": round(100 * float(hits[alpha].mean()), 2)} | row
            print(f"alpha {alpha}: {into[str(alpha)]} ({time.perf_counter() - began:.0f} s)", flush=True)
        return hits

    names = ", ".join(span_name(*s) for s in choose)
    hits = run(choose, [own, *(a for a in alphas if a != own)], result["choose"])
    best = max(alphas, key=lambda a: (hits[a].mean(), a == own))
    result["chosen"], result["chosen_on"] = best, names
    print(f"chosen on {names}: alpha {best}", flush=True)
    if best != own and measure:
        result["measure"] = {"spans": [span_name(*s) for s in measure]}
        run(measure, [own, best], result["measure"])
    if args.out:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
