"""bench/query_feedback.py's chosen feedback as served: ``bench/restatement_guard.py`` (every flag of it
passes through) with the bundle's retriever moving each context's vector by ``--beta`` times the
centroid of its first ``--k`` hits (echoes of the context's turns left out), through the code the
service runs otherwise: guard, lexical stage, prior, a reranker if the bundle has one. Not a served
option (docs/results.md section 47): the retriever is replaced here, for this measurement only.

``--second-search`` searches the pool again from the moved vector; by default the first search's
hits (the prior's depth, 100) are rescored from it, which costs no second search.

    python bench/query_feedback_served.py --k 10 --beta -0.2 -- --split test --limit 2000 --single 0 \\
        --against docs/restate-guard-recipe11-test.json --out docs/query-feedback-served-test.json
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from coreply import bundle
from coreply.prior import DEPTH
from coreply.ranking import Hits
from coreply.text import normalize


def moved_retriever(k: int, beta: float, second_search: bool):
    """An ``IndexRetriever.__call__`` that moves the queries before its final ranking (a bundle with a
    prior, as the default; echoes matched by :func:`normalize`d text, as the service drops them)."""
    keys: dict[str, int] = {}

    def call(self, contexts: Sequence[Sequence[str]], n: int) -> Hits:
        if self.prior is None:
            raise SystemExit("--bundle: this measurement needs a bundle with a response prior (the default)")
        if not keys:
            keys.update({normalize(text): i for text, i in self.rows.items()})
        start = time.perf_counter()
        queries = np.ascontiguousarray(self.backend.encode_contexts(contexts), dtype="float32")  # [B, D]
        encoded = time.perf_counter()
        size = self.index.ntotal
        scores, ids = self.prior.search(self.index.search, queries, max(n, DEPTH), size)  # [B, m] x2
        moved = np.empty_like(queries)  # [B, D], each of its query's norm (the retriever's scale)
        for b, context in enumerate(contexts):
            echoes = {keys.get(normalize(turn), -2) for turn in context}
            first = [i for i in ids[b] if i >= 0 and i not in echoes][:k]
            norm = np.linalg.norm(queries[b])
            to = queries[b] / norm + beta * self.vectors(np.array(first)).mean(0)
            moved[b] = to / np.linalg.norm(to) * norm
        if second_search:
            scores, ids = self.prior.search(self.index.search, moved, n, size)
        else:
            held = np.maximum(ids, 0)  # [B, m]
            vectors = self.vectors(held.ravel()).reshape(*ids.shape, -1)  # [B, m, D]
            rescored = np.einsum("bmd,bd->bm", vectors, moved) - self.prior.alpha * self.prior.values[held]
            rescored = np.where(ids >= 0, rescored, -np.inf)
            order = np.argsort(-rescored, axis=1, kind="stable")[:, :n]  # [B, n]
            scores, ids = np.take_along_axis(rescored, order, 1), np.take_along_axis(ids, order, 1)
        self.timings = {"encode": encoded - start, "search": time.perf_counter() - encoded}
        return Hits(ids, scores, None)

    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=10, help="first hits averaged")
    p.add_argument("--beta", type=float, default=-0.2, help="the centroid's weight (negative: taken out)")
    p.add_argument("--second-search", action="store_true", help="search again instead of rescoring")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then bench/restatement_guard.py's flags")
    args = p.parse_args()
    if args.k < 1 or args.k > DEPTH:
        raise SystemExit(f"--k: give 1 to {DEPTH} first hits, got {args.k}")
    if not args.beta:
        raise SystemExit("--beta: 0 is the served retriever; measure it with bench/restatement_guard.py")
    bundle.IndexRetriever.__call__ = moved_retriever(args.k, args.beta, args.second_search)
    script = Path(__file__).with_name("restatement_guard.py")
    sys.argv = [str(script), *[a for a in args.rest if a != "--"]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
