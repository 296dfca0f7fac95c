"""Several views of one context, scored together: does a query made of the whole context and of its last
turns lift a bundle's dense stage, with no training?

The bundle's retriever (as served, its int8 ONNX graph) encodes each context from its last ``k`` turns
for each ``k`` of ``--views`` (0: all turns, as served). A mix ``w`` of the views scores the pool as
``scale * sum_k w_k cos(q_k, r) - alpha * rho(r)`` (the bundle's prior, if any), with the context's
turns (echoes, which the service drops) at -inf. The mix is chosen on validation ``[0:--select)`` over a
grid on the simplex (step ``1/--grid``) and measured, with the single served view, on validation
``[--select:]`` and the first ``--limit`` test pairs: dense hits@1 over the full pool, no guard or lexical
stage, one-sided paired bootstrap p against the served view.

    python bench/context_views.py --bundle artifacts/default-bundle --views 0 1 2 3 \\
        --out docs/context-views.json      # ~3 min encoding + ~6 s a mix on 2,000 contexts: 20 min here
"""

from __future__ import annotations

import argparse
import itertools
import time
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

from bench import (  # bench/bench.py: this script's directory is on sys.path
    provenance,
    refuse_below,
    responder,
)
from coreply.artifacts import write_json_atomic
from coreply.corpus import load_chitchat


def simplex(views: int, steps: int) -> list[tuple[float, ...]]:
    """Every mix of ``views`` weights in multiples of ``1 / steps`` that sums to 1."""
    return [tuple(c / steps for c in combo) for combo in itertools.product(range(steps + 1), repeat=views)
            if sum(combo) == steps]  # fmt: skip


def hits(splits: list[Split], mix: tuple[float, ...], pool: torch.Tensor, bias: torch.Tensor,
         lo: int, hi: int) -> np.ndarray:  # fmt: skip
    """Per pair of ``[lo, hi)``: 1 where the gold leads the pool under ``mix`` of the views ``splits``."""

    def score(rows: torch.Tensor) -> torch.Tensor:  # [B] -> [B, N]
        q = sum(w * s.q[rows] for w, s in zip(mix, splits, strict=True) if w)  # [B, D], not unit
        return q @ pool.T * splits[0].scale + bias

    return top1_hits(splits[0], score, lo, hi)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle", help="a bundle over the chitchat pool")
    p.add_argument("--views", type=int, nargs="+", default=[0, 1, 2, 3], help="last N turns, 0: all")
    p.add_argument("--grid", type=int, default=8, help="mixes in steps of 1/N")
    p.add_argument("--select", type=int, default=2000, help="validation pairs [0:N) the mix is chosen on")
    p.add_argument("--limit", type=int, default=2000, help="test pairs [0:N)")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = p.parse_args()
    refuse_below(args, grid=1, select=1, limit=1)
    if min(args.views) < 0 or len(set(args.views)) < len(args.views) or args.views[0] != 0:
        raise SystemExit(f"--views: distinct turn counts >= 0, the served view 0 first, got {args.views}")
    bot = responder(args.bundle)
    ids = {key: i for i, key in enumerate(bot.pipeline.keys)}  # the pool holds each normalised text once
    chitchat = load_chitchat()
    start = time.perf_counter()
    valid = [Split(bot, chitchat["valid"], ids, k) for k in args.views]
    test = [Split(bot, chitchat["test"][: args.limit], ids, k) for k in args.views]
    if args.select >= len(valid[0].q):
        raise SystemExit(f"--select: give fewer than the {len(valid[0].q)} validation pairs in the pool")
    print(f"encoded {len(args.views)} views, {time.perf_counter() - start:.0f} s", flush=True)
    pool, bias = served_pool(bot)  # [N, D], [N]

    parts = spans(valid, test, args.select, (len(valid[0].q), len(test[0].q)))
    best, rows, grid = choose(
        lambda splits, mix, lo, hi: hits(splits, mix, pool, bias, lo, hi), parts,
        (1.0,) + (0.0,) * (len(args.views) - 1), simplex(len(args.views), args.grid),
        lambda mix: {"mix": mix},
    )  # fmt: skip
    print(f"chose {best} of {len(grid)} mixes, {time.perf_counter() - start:.0f} s", flush=True)
    result = provenance() | {"bundle": args.bundle, "views": args.views, "mixes": len(grid),
                             "chosen": best, "rows": rows, "top_mixes": grid[:10]}  # fmt: skip
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
