"""Pseudo-relevance feedback on the dense stage: does moving a context's vector towards (or away from)
the centroid of its own first hits lift a bundle's top-1, with no training?

The bundle's retriever (as served, its int8 ONNX graph) encodes the contexts; the pool is scored as
served, ``scale * cos(q, r) - alpha * rho(r)`` (the bundle's prior, if any), the context's own turns
(echoes, which the service drops) at -inf. Its ``k`` best hits' unit vectors average to ``c`` and the
pool is scored again from ``q' = normalise(q + beta * c)``: ``beta > 0`` is Rocchio's feedback (more of
what the first hits share), ``beta < 0`` takes the shared part out (what sets a hit apart from its
neighbours counts more). ``(k, beta)`` is chosen on validation ``[0:--select)`` and measured, beside the
served scores, on validation ``[--select:]`` and the first ``--limit`` test pairs: dense hits@1 over the
full pool, no guard or lexical stage, one-sided paired bootstrap p against the served scores.

    python bench/query_feedback.py --bundle artifacts/default-bundle \\
        --out docs/query-feedback.json      # ~2 min encoding + ~25 s a grid point here
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from pool_projection import (  # bench/pool_projection.py, beside this script
    Split,
    choose,
    served_pool,
    spans,
    top1_hits,
)
from torch.nn import functional as F

from bench import (  # bench/bench.py: this script's directory is on sys.path
    provenance,
    refuse_below,
    responder,
)
from coreply.artifacts import write_json_atomic
from coreply.corpus import load_chitchat


def feedback(
    split: Split, pool: torch.Tensor, bias: torch.Tensor, k: int, beta: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``score(rows)`` [B] -> [B, N] for ``split`` with feedback from the ``k`` best hits; ``beta == 0``:
    the served scores."""

    def score(rows: torch.Tensor) -> torch.Tensor:
        q = split.q[rows]  # [B, D]
        served = q @ pool.T * split.scale + bias  # [B, N]
        if not beta:
            return served
        top = split.masked(served, rows).topk(k, dim=1).indices  # [B, k]
        moved = F.normalize(q + beta * pool[top].mean(1), dim=1)  # [B, D]
        return moved @ pool.T * split.scale + bias

    return score


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle", help="a bundle over the chitchat pool")
    p.add_argument("--k", type=int, nargs="+", default=[10, 20, 50, 100], help="first hits averaged")
    p.add_argument("--beta", type=float, nargs="+", default=[-0.3, -0.2, -0.1, 0.1, 0.2],
                   help="the centroid's weights (non-zero; negative: taken out)")  # fmt: skip
    p.add_argument("--select", type=int, default=2000, help="validation pairs [0:N) the grid is chosen on")
    p.add_argument("--limit", type=int, default=2000, help="test pairs [0:N)")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = p.parse_args()
    refuse_below(args, select=1, limit=1)
    if min(args.k) < 1:
        raise SystemExit(f"--k: give counts of at least 1, got {args.k}")
    if 0 in args.beta:
        raise SystemExit("--beta: 0 is the served scores, measured anyway; give non-zero weights")
    bot = responder(args.bundle)
    ids = {key: i for i, key in enumerate(bot.pipeline.keys)}  # the pool holds each normalised text once
    chitchat = load_chitchat()
    start = time.perf_counter()
    valid, test = Split(bot, chitchat["valid"], ids), Split(bot, chitchat["test"][: args.limit], ids)
    if args.select >= len(valid.q):
        raise SystemExit(f"--select: give fewer than the {len(valid.q)} validation pairs in the pool")
    print(f"encoded {len(valid.q) + len(test.q)} contexts, {time.perf_counter() - start:.0f} s", flush=True)
    pool, bias = served_pool(bot)
    if max(args.k) > len(pool):
        raise SystemExit(f"--k: give at most the {len(pool)} responses of the pool, got {max(args.k)}")

    def hits(split: Split, mix: tuple[int, float], lo: int, hi: int) -> np.ndarray:
        return top1_hits(split, feedback(split, pool, bias, *mix), lo, hi)

    parts = spans(valid, test, args.select, (len(valid.q), len(test.q)))
    best, rows, grid = choose(
        hits, parts, (args.k[0], 0.0), itertools.product(args.k, args.beta),
        lambda mix: {"k": mix[0], "beta": mix[1]},
    )  # fmt: skip
    print(f"chose {best}, {time.perf_counter() - start:.0f} s", flush=True)
    result = provenance() | {"bundle": args.bundle, "rows": rows, "chosen": {"k": best[0], "beta": best[1]},
                             "grid": grid}  # fmt: skip
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
