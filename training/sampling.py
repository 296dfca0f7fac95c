"""Candidate lists for training: the positive first, then random and (optionally) retriever-mined hard
negatives. Everything is a pure function of (seed, epoch, step), so a resumed or multi-process run draws
exactly the same lists as an uninterrupted single-process one."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.nn import functional as F

from coreply.corpus import Pair
from coreply.text import normalize


def epoch_order(size: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(size)


def step_rng(seed: int, epoch: int, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, step, 7])


def own_turn_negatives(pair: Pair, count: int) -> list[str]:
    """Up to ``count`` of the context's own turns, latest first, none equal to the gold: restatements of
    what was just said, which a reply must not be."""
    gold = normalize(pair.response)
    out: list[str] = []
    seen = {gold}
    for turn in reversed(pair.context):
        key = normalize(turn)
        if key and key not in seen and len(out) < count:
            seen.add(key)
            out.append(turn)
    return out


class HardNegativeMiner:
    """Negatives mined by the retriever from a fixed sample of the training pool.

    Every ``refresh_every`` steps the response tower re-embeds the sample and, given the pairs of the
    steps ahead, each of their queries, so that a step's mining is a table look-up: no retriever pass
    and no wait for the GPU, and the next step can be prepared while this one trains. Both sides are
    thus as old as the last refresh. Two kinds are mined:

    * ``by="context"``: the pool entries the retriever ranks highest for the context (its own top
      ``top_k``, of which ``count`` are drawn at random): what it would wrongly answer.
    * ``by="last_turn"``: the pool entries nearest the context's *last turn* in the response space (the
      nearest ``2 * count + 1``, ``count`` drawn): paraphrases of what the user just said. In a pool of
      chit-chat most of them are on-topic replies instead (docs/results.md 28); ``floor`` > 0 keeps only
      those whose cosine with the last turn is at least ``floor``, so a pair may get fewer, or none."""

    def __init__(
        self,
        pool: Sequence[str],
        count: int,
        refresh_every: int,
        sample_size: int,
        top_k: int,
        seed: int,
        floor: float = 0.0,
    ) -> None:
        rng = np.random.default_rng([seed, 11])
        take = min(sample_size, len(pool))
        self.pool = [pool[i] for i in sorted(rng.choice(len(pool), size=take, replace=False))]
        self.keys = [normalize(t) for t in self.pool]
        self.count, self.refresh_every, self.top_k, self.floor = count, refresh_every, top_k, floor
        self.embeddings: torch.Tensor | None = None  # [P, D]
        self.refreshed_at = -1
        self._rows: dict[tuple, list[int]] = {}  # (by, k, query key) -> the pool's top k for it

    def due(self, step: int) -> bool:
        return self.embeddings is None or step - self.refreshed_at >= self.refresh_every

    def maybe_refresh(
        self,
        bi,
        step: int,
        ahead: Sequence[Pair] = (),
        kinds: dict[str, int] | None = None,
    ) -> bool:
        """Re-embed the sample when due (a frozen retriever's, nothing of which trains, only the first
        time: its vectors cannot change), and look up the top rows of every pair in ``ahead`` for each
        ``kinds`` entry (by -> count). Returns whether it refreshed."""
        if not self.due(step):
            return False
        if self.embeddings is None or any(p.requires_grad for p in bi.parameters()):
            was_training = bi.training
            bi.eval()
            self.embeddings = bi.embed_responses(self.pool)
            bi.train(was_training)
        self._rows = {}
        for by, count in (kinds or {}).items():
            self._rows.update(self._search(bi, ahead, by, count))
        self.refreshed_at = step
        return True

    def _k(self, by: str, count: int) -> int:
        if by not in ("context", "last_turn"):
            raise ValueError(f"by must be 'context' or 'last_turn', got {by!r}")
        return min(self.top_k if by == "context" else 2 * count + 1, len(self.pool))

    @staticmethod
    def _query(pair: Pair, by: str) -> tuple:
        return tuple(pair.context) if by == "context" else (pair.context[-1],)

    @torch.no_grad()
    def _search(self, bi, pairs: Sequence[Pair], by: str, count: int) -> dict[tuple, list[int]]:
        """The pool's top rows for each distinct query of ``pairs`` (one retriever pass, without dropout)."""
        assert self.embeddings is not None, "call maybe_refresh first"
        k = self._k(by, count)
        queries = list(dict.fromkeys(self._query(p, by) for p in pairs))
        if not queries:
            return {}
        was_training = bi.training
        bi.eval()
        if by == "context":
            vectors = bi.embed_contexts([list(q) for q in queries])  # [Q, D]
        else:
            vectors = bi.embed_responses([q[0] for q in queries])  # [Q, D]
        bi.train(was_training)
        device = next(bi.parameters()).device
        pool = self.embeddings.to(device)  # [P, D]
        rows: list[list[int]] = []
        for chunk in torch.split(vectors.to(device), 4096):  # [<=4096, D]
            top = torch.topk(chunk @ pool.T, k=k, dim=1).indices  # [c, k]
            if by == "last_turn" and self.floor > 0:  # a paraphrase only if it is one by cosine
                cos = torch.einsum("cd,ckd->ck", F.normalize(chunk, dim=-1), F.normalize(pool[top], dim=-1))
                top = top.masked_fill(cos < self.floor, -1)  # -1: not one
            rows += [[j for j in row if j >= 0] for row in top.tolist()]
        return {(by, k, q): row for q, row in zip(queries, rows, strict=True)}

    def neighbours(self, pair: Pair, by: str, count: int) -> list[str]:
        """The pool entries that :meth:`mine` draws ``count`` from for ``pair`` (looked up by the last
        refresh, or by an earlier ``mine``)."""
        return [self.pool[j] for j in self._rows[(by, self._k(by, count), self._query(pair, by))]]

    def mine(
        self,
        bi,
        pairs: Sequence[Pair],
        rng: np.random.Generator,
        count: int | None = None,
        by: str = "context",
        avoid: Sequence[set[str]] | None = None,
    ) -> list[list[str]]:
        """``count`` (default: the miner's) negatives per pair, never the gold nor a key in ``avoid[i]``.
        Pairs the last refresh did not look up are searched now (a retriever pass)."""
        assert self.embeddings is not None, "call maybe_refresh first"
        count = self.count if count is None else count
        if count == 0:
            return [[] for _ in pairs]
        k = self._k(by, count)
        keys = [(by, k, self._query(p, by)) for p in pairs]
        missing = [p for p, key in zip(pairs, keys, strict=True) if key not in self._rows]
        if missing:
            self._rows.update(self._search(bi, missing, by, count))
        out = []
        for i, (pair, key) in enumerate(zip(pairs, keys, strict=True)):
            taken = {normalize(pair.response)} | (avoid[i] if avoid is not None else set())
            choices = [j for j in self._rows[key] if self.keys[j] not in taken]
            picked = rng.choice(len(choices), size=min(count, len(choices)), replace=False)
            out.append([self.pool[choices[j]] for j in sorted(picked)])
        return out
