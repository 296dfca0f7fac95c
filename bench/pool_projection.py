"""A context-side linear map learned on the CPU with a softmax over the whole pool: does it lift a
bundle's dense stage where a GPU lease is not at hand?

The bundle's retriever encodes the training contexts once as served (its int8 ONNX graph), and a map
``q -> normalise(q + q @ delta.T)`` (``delta`` [D, D], starting at zero, so step 0 is the bundle) is
trained by cross-entropy of each context's gold against every response of the pool, scored as served:
``scale * cos - alpha * rho`` with the bundle's prior (if any), the context's own turns (echoes, which the
service drops) masked out. The response side is untouched, so the index and the prior stay valid. The
map is linear and bias-free, so it is what a ``projection_dim`` context head of the same retriever would
compute (:class:`coreply.models.BiEncoder`). Measured: dense hits@1 over the full pool, echoes dropped,
no guard or lexical stage, on validation ``[0:--select)`` (where the epoch is chosen), validation
``[--select:]`` and the first ``--limit`` test pairs, with one-sided paired bootstrap p against step 0.

    python bench/pool_projection.py --bundle artifacts/default-bundle --epochs 1 \\
        --out docs/pool-projection.json      # ~19 min encoding + ~9 min an epoch here
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from bench import (  # bench/bench.py: this script's directory is on sys.path
    provenance,
    refuse_below,
    responder,
)
from coreply.artifacts import write_json_atomic
from coreply.corpus import Pair, load_chitchat
from coreply.responder import Responder
from coreply.text import normalize
from evaluation.metrics import paired_bootstrap


class Split:
    """A split's served context vectors (unit) [Q, D], gold ids [Q] and echo ids as (row, id) [E, 2];
    pairs whose gold is not in the pool are left out. A gold that repeats a context turn is an echo
    too, a miss as the service would have it, and such pairs are not ``answerable`` (not trained on).
    ``turns``: the contexts are encoded from their last N turns only (0: as served, all of them); the
    echoes are those of the whole context still."""

    def __init__(self, bot: Responder, pairs: list[Pair], ids: dict[str, int], turns: int = 0) -> None:
        retrieve = bot.pipeline.retrieve
        pairs = [p for p in pairs if normalize(p.response) in ids]
        if not pairs:
            raise SystemExit("--bundle: its pool holds none of the chitchat replies; give a chitchat bundle")
        chunks = [retrieve.backend.encode_contexts([p.context[-turns:] for p in pairs[a : a + 1024]])  # type: ignore[attr-defined]
                  for a in range(0, len(pairs), 1024)]  # fmt: skip
        raw = torch.from_numpy(np.concatenate(chunks))  # [Q, D], the retriever's scale as their norm
        self.q, self.scale = F.normalize(raw, dim=1), float(raw.norm(dim=1).mean())
        gold = [ids[normalize(p.response)] for p in pairs]
        self.gold = torch.tensor(gold)
        echoes = [(r, ids[key]) for r, p in enumerate(pairs) for key in {normalize(t) for t in p.context}
                  if key in ids]  # fmt: skip
        self.echoes = torch.tensor(echoes, dtype=torch.long).reshape(-1, 2)
        self.answerable = torch.ones(len(pairs), dtype=torch.bool)
        self.answerable[[r for r, j in echoes if j == gold[r]]] = False

    def masked(self, scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``scores`` [B, N] of ``rows`` [B] with each row's echoes at -inf."""
        at = torch.full((len(self.q),), -1, dtype=torch.long)
        at[rows] = torch.arange(len(rows))
        hit = at[self.echoes[:, 0]] >= 0
        return scores.index_put((at[self.echoes[hit, 0]], self.echoes[hit, 1]), torch.tensor(float("-inf")))


def served_pool(bot: Responder) -> tuple[torch.Tensor, torch.Tensor]:
    """The bundle's pool as unit vectors [N, D] and the bias its prior adds to each score,
    ``-alpha * rho`` [N] (zeros where it has none)."""
    retrieve = bot.pipeline.retrieve
    pool = torch.from_numpy(retrieve.vectors(np.arange(retrieve.index.ntotal)))  # [N, D], unit
    prior = retrieve.prior  # type: ignore[attr-defined]
    bias = -prior.alpha * torch.from_numpy(prior.values).float() if prior else torch.zeros(len(pool))  # [N]
    return pool, bias


@torch.no_grad()
def top1_hits(split: Split, score: Callable[[torch.Tensor], torch.Tensor], lo: int, hi: int) -> np.ndarray:
    """Per pair of ``[lo, hi)``: 1 where the gold leads the pool, ``score(rows)`` [B, N] with the rows'
    echoes masked."""
    out = []
    for a in range(lo, hi, 1024):
        rows = torch.arange(a, min(a + 1024, hi))
        out.append((split.masked(score(rows), rows).argmax(1) == split.gold[rows]).numpy())
    return np.concatenate(out).astype(float)


def spans(valid: Any, test: Any, select: int, sizes: tuple[int, int]) -> dict[str, tuple[Any, int, int]]:
    """The spans every script here reports, as (split, lo, hi): validation ``[0:select)``, where its
    choice is made, validation ``[select:]`` and the test pairs; ``sizes``: the two splits' pairs."""
    return {"select": (valid, 0, select), "valid": (valid, select, sizes[0]), "test": (test, 0, sizes[1])}


def against(now: np.ndarray, base: np.ndarray, name: str) -> dict[str, Any]:
    """A span's hits@1 (per-pair hits ``now``) and its one-sided paired bootstrap p against ``base``."""
    p = paired_bootstrap(now, base)
    return {"pairs": len(now), "hits@1": round(float(100 * now.mean()), 2), f"p_vs_{name}": round(p, 4)}


def choose(
    hits: Callable[[Any, Any, int, int], np.ndarray],
    parts: dict[str, tuple[Any, int, int]],
    served: Any,
    grid: Iterable[Any],
    describe: Callable[[Any], dict[str, Any]],
) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]:
    """A setting chosen on the ``select`` span of :func:`spans` and reported beside the served one.

    ``hits(split, mix, lo, hi)`` gives per-pair hits@1 of a setting ``mix`` (hashable); every mix of
    ``grid`` is scored on ``select`` and the best kept, the served one winning a tie. Returns it, one
    row per setting (served, then the chosen one if it differs: ``describe(mix)`` and every span's
    hits@1 with its paired p against the served), and every mix with its hits@1 on ``select``, best
    first."""
    base = {name: hits(split, served, lo, hi) for name, (split, lo, hi) in parts.items()}
    split, lo, hi = parts["select"]
    chosen = {served: float(base["select"].mean())}
    for mix in grid:
        if mix not in chosen:
            chosen[mix] = float(hits(split, mix, lo, hi).mean())
            print(f"{describe(mix)}: select {100 * chosen[mix]:.2f}", flush=True)
    best = max(chosen, key=lambda mix: (chosen[mix], mix == served))
    rows = []
    for mix in dict.fromkeys([served, best]):
        row = describe(mix)
        for name, (split, lo, hi) in parts.items():
            now = base[name] if mix == served else hits(split, mix, lo, hi)
            row[name] = against(now, base[name], "served")
        print(row, flush=True)
        rows.append(row)
    ranked = sorted(chosen.items(), key=lambda kv: -kv[1])
    return best, rows, [describe(mix) | {"select_hits@1": round(100 * v, 2)} for mix, v in ranked]


class Scorer:
    """Served scores of mapped contexts against the pool: ``scale * cos(q', r) - alpha * rho(r)``."""

    def __init__(self, pool: torch.Tensor, bias: torch.Tensor, scale: float) -> None:
        self.pool, self.bias, self.scale = pool, bias, scale  # [N, D], [N]
        self.delta = torch.zeros(pool.shape[1], pool.shape[1], requires_grad=True)  # [D, D]

    def __call__(self, q: torch.Tensor) -> torch.Tensor:  # [B, D] -> [B, N]
        return F.normalize(q + q @ self.delta.T, dim=1) @ self.pool.T * self.scale + self.bias


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle", help="a bundle over the chitchat pool")
    p.add_argument("--train", type=int, default=0, help="training pairs used, 0 for all")
    p.add_argument("--select", type=int, default=2000, help="validation pairs [0:N) the epoch is chosen on")
    p.add_argument("--limit", type=int, default=2000, help="test pairs [0:N)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = p.parse_args()
    refuse_below(args, train=0, select=1, limit=1, epochs=1, batch_size=1)
    if not args.lr > 0:
        raise SystemExit(f"--lr: give a positive learning rate, got {args.lr}")
    bot = responder(args.bundle)
    splits = load_chitchat()
    ids = {key: i for i, key in enumerate(bot.pipeline.keys)}  # the pool holds each normalised text once
    start = time.perf_counter()
    train, valid, test = (Split(bot, pairs, ids) for pairs in (
        splits["train"][: args.train or None], splits["valid"], splits["test"][: args.limit]))  # fmt: skip
    if args.select >= len(valid.q):
        raise SystemExit(f"--select: give fewer than the {len(valid.q)} validation pairs in the pool")
    encoded = len(train.q) + len(valid.q) + len(test.q)
    print(f"encoded {encoded} contexts, {time.perf_counter() - start:.0f} s", flush=True)
    scorer = Scorer(*served_pool(bot), train.scale)
    opt = torch.optim.AdamW([scorer.delta], lr=args.lr, weight_decay=0.0)

    def measure(epoch: int) -> dict:
        row = {"epoch": epoch, "delta_norm": round(float(scorer.delta.detach().norm()), 3)}
        for name, (split, lo, hi) in spans(valid, test, args.select, (len(valid.q), len(test.q))).items():
            row[name] = top1_hits(split, lambda rows, split=split: scorer(split.q[rows]), lo, hi)
        return row

    rows = [measure(0)]
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(train.q), generator=torch.Generator().manual_seed(epoch))
        order = order[train.answerable[order]]  # [Q'], a gold at -inf has no loss to learn from
        for a in range(0, len(order), args.batch_size):
            rows_ = order[a : a + args.batch_size]
            loss = F.cross_entropy(train.masked(scorer(train.q[rows_]), rows_), train.gold[rows_])
            opt.zero_grad()
            loss.backward()
            opt.step()
        rows.append(measure(epoch))
        print(f"epoch {epoch}: loss {loss.item():.3f}, select {100 * rows[-1]['select'].mean():.2f}, "
              f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    best = max(rows, key=lambda r: r["select"].mean())
    result = provenance() | {"bundle": args.bundle, "train_pairs": len(train.q), "lr": args.lr,
                             "batch_size": args.batch_size, "chosen_epoch": best["epoch"],
                             "epochs": []}  # fmt: skip
    for row in rows:
        out = {"epoch": row["epoch"], "delta_norm": row["delta_norm"]}
        for name in ("select", "valid", "test"):
            out[name] = against(row[name], rows[0][name], "step_0")
        print(out, flush=True)
        result["epochs"].append(out)
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
