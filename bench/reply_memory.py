"""The replies people gave to similar contexts as a second opinion: does a memory of the training pairs
lift a bundle's dense stage, with no training?

The bundle's retriever (as served, its int8 ONNX graph) encodes every training context. A context's
``k`` nearest training contexts (cosine), weighted ``w = softmax(cos / tau)``, vote for each response
``r`` of the pool by how close it is to their gold replies: ``vote(r) = sum_j w_j cos(r, gold_j)``,
with a reply's vote for itself left out (``--self-vote``: kept), since the held-out gold is never one
of them. The pool is scored ``scale * (cos(q, r) + lam * vote(r)) - alpha * rho(r)`` (the bundle's
prior, if any), the context's own turns (echoes, which the service drops) at -inf. Since the vote is a
dot product with one vector, ``sum_j w_j gold_j``, it could be served as a moved query vector and a
correction of the few replies in the memory. ``(k, tau, lam)`` is chosen on validation
``[0:--select)`` and measured, beside the served scores, on validation ``[--select:]`` and the first
``--limit`` test pairs: dense hits@1 over the full pool, no guard or lexical stage, one-sided paired
bootstrap p against the served scores.

    python bench/reply_memory.py --bundle artifacts/default-bundle \\
        --out docs/reply-memory.json      # ~15 min encoding + ~10 min the grid here
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

from bench import (  # bench/bench.py: this script's directory is on sys.path
    provenance,
    refuse_below,
    responder,
)
from coreply.artifacts import write_json_atomic
from coreply.corpus import load_chitchat


class Memory:
    """The training contexts [M, D] (unit) and their gold ids [M], with each split context's nearest
    ``most`` of them computed once."""

    def __init__(self, train: Split, pool: torch.Tensor, bias: torch.Tensor, most: int) -> None:
        keep = train.answerable  # a gold that repeats its context is an echo, not a reply to learn from
        self.q, self.gold, self.most = train.q[keep], train.gold[keep], most
        self.pool, self.bias, self.scale = pool, bias, train.scale  # [N, D], [N]
        self.near: dict[int, tuple[torch.Tensor, ...]] = {}

    @torch.no_grad()
    def score(self, split: Split, k: int, tau: float, lam: float,
              self_vote: bool) -> Callable[[torch.Tensor], torch.Tensor]:  # fmt: skip
        """``score(rows)`` [B] -> [B, N] for ``split``; ``lam == 0``: the served scores."""
        if id(split) not in self.near:
            tops = [(split.q[a : a + 1024] @ self.q.T).topk(self.most, dim=1)  # of [B, M]
                    for a in range(0, len(split.q), 1024)]  # fmt: skip
            self.near[id(split)] = tuple(torch.cat(t) for t in zip(*tops, strict=True))
        values, indices = self.near[id(split)]  # [Q, most] each

        def score(rows: torch.Tensor) -> torch.Tensor:
            dense = split.q[rows] @ self.pool.T  # [B, N]
            if lam:
                w = torch.softmax(values[rows, :k] / tau, dim=1)  # [B, k]
                gold = self.gold[indices[rows, :k]]  # [B, k]
                vote = torch.einsum("bk,bkd->bd", w, self.pool[gold]) @ self.pool.T  # [B, N]
                if not self_vote:
                    vote.scatter_add_(1, gold, -w)  # cos(gold_j, gold_j) = 1
                dense += lam * vote
            return dense * self.scale + self.bias

        return score


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle", help="a bundle over the chitchat pool")
    p.add_argument("--train", type=int, default=0, help="training pairs in the memory, 0 for all")
    p.add_argument("--k", type=int, nargs="+", default=[8, 32, 128], help="nearest training contexts")
    p.add_argument("--tau", type=float, nargs="+", default=[0.02, 0.05, 0.1], help="softmax temperatures")
    p.add_argument("--lam", type=float, nargs="+", default=[0.025, 0.05, 0.1, 0.2, 0.4],
                   help="the vote's weights against the cosine")  # fmt: skip
    p.add_argument("--self-vote", action="store_true", help="a reply in the memory votes for itself too")
    p.add_argument("--select", type=int, default=2000, help="validation pairs [0:N) the grid is chosen on")
    p.add_argument("--limit", type=int, default=2000, help="test pairs [0:N)")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = p.parse_args()
    refuse_below(args, train=0, select=1, limit=1)
    for flag in ("k", "tau", "lam"):
        if min(getattr(args, flag)) <= 0:
            raise SystemExit(f"--{flag}: give positive values, got {getattr(args, flag)}")
    bot = responder(args.bundle)
    ids = {key: i for i, key in enumerate(bot.pipeline.keys)}  # the pool holds each normalised text once
    chitchat = load_chitchat()
    if max(args.k) > len(chitchat["train"][: args.train or None]):  # before 15 minutes of encoding
        raise SystemExit(f"--k: give at most the training pairs in the memory, got {max(args.k)}")
    start = time.perf_counter()
    train, valid, test = (Split(bot, pairs, ids) for pairs in (
        chitchat["train"][: args.train or None], chitchat["valid"], chitchat["test"][: args.limit]
    ))  # fmt: skip
    if args.select >= len(valid.q):
        raise SystemExit(f"--select: give fewer than the {len(valid.q)} validation pairs in the pool")
    if max(args.k) > int(train.answerable.sum()):
        raise SystemExit(f"--k: give at most the {int(train.answerable.sum())} training pairs in the memory")
    encoded = len(train.q) + len(valid.q) + len(test.q)
    print(f"encoded {encoded} contexts, {time.perf_counter() - start:.0f} s", flush=True)
    memory = Memory(train, *served_pool(bot), max(args.k))

    def hits(split: Split, mix: tuple[int, float, float], lo: int, hi: int) -> np.ndarray:
        return top1_hits(split, memory.score(split, *mix, args.self_vote), lo, hi)

    parts = spans(valid, test, args.select, (len(valid.q), len(test.q)))
    best, rows, grid = choose(
        hits, parts, (args.k[0], args.tau[0], 0.0), itertools.product(args.k, args.tau, args.lam),
        lambda mix: {"k": mix[0], "tau": mix[1], "lam": mix[2]},
    )  # fmt: skip
    print(f"chose {best}, {time.perf_counter() - start:.0f} s", flush=True)
    result = provenance() | {"bundle": args.bundle, "memory_pairs": len(memory.q),
                             "self_vote": args.self_vote, "rows": rows, "grid": grid,
                             "chosen": {"k": best[0], "tau": best[1], "lam": best[2]}}  # fmt: skip
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
