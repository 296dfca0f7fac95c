"""Candidate lists for training: the positive first, then random and (optionally) retriever-mined hard
negatives. Everything is a pure function of (seed, epoch, step), so a resumed or multi-process run draws
exactly the same lists as an uninterrupted single-process one."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

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
    """Negatives mined by the *current* retriever from a fixed sample of the training pool.

    Every ``refresh_every`` steps the response tower re-embeds the sample. Two kinds are mined:

    * ``by="context"``: the pool entries the retriever ranks highest for the context (its own top
      ``top_k``, of which ``count`` are drawn at random): what it would wrongly answer.
    * ``by="last_turn"``: the pool entries nearest the context's *last turn* in the response space (the
      nearest ``2 * count``, ``count`` drawn): paraphrases of what the user just said."""

    def __init__(
        self, pool: Sequence[str], count: int, refresh_every: int, sample_size: int, top_k: int, seed: int
    ) -> None:
        rng = np.random.default_rng([seed, 11])
        take = min(sample_size, len(pool))
        self.pool = [pool[i] for i in sorted(rng.choice(len(pool), size=take, replace=False))]
        self.keys = [normalize(t) for t in self.pool]
        self.count, self.refresh_every, self.top_k = count, refresh_every, top_k
        self.embeddings: torch.Tensor | None = None  # [P, D]
        self.refreshed_at = -1

    def maybe_refresh(self, bi, step: int) -> None:
        if self.embeddings is None or step - self.refreshed_at >= self.refresh_every:
            was_training = bi.training
            bi.eval()
            self.embeddings = bi.embed_responses(self.pool)
            bi.train(was_training)
            self.refreshed_at = step

    @torch.no_grad()
    def mine(
        self,
        bi,
        pairs: Sequence[Pair],
        rng: np.random.Generator,
        count: int | None = None,
        by: str = "context",
        avoid: Sequence[set[str]] | None = None,
    ) -> list[list[str]]:
        """``count`` (default: the miner's) negatives per pair, never the gold nor a key in ``avoid[i]``."""
        assert self.embeddings is not None, "call maybe_refresh first"
        count = self.count if count is None else count
        if count == 0:
            return [[] for _ in pairs]
        was_training = bi.training
        bi.eval()
        if by == "context":
            queries, top_k = bi.embed_contexts([p.context for p in pairs]), self.top_k  # [B, D]
        elif by == "last_turn":
            queries, top_k = bi.embed_responses([p.context[-1] for p in pairs]), 2 * count + 1  # [B, D]
        else:
            raise ValueError(f"by must be 'context' or 'last_turn', got {by!r}")
        bi.train(was_training)
        top = torch.topk(queries @ self.embeddings.T, k=min(top_k, len(self.pool)), dim=1).indices  # [B, k]
        out = []
        for i, (pair, row) in enumerate(zip(pairs, top.tolist(), strict=True)):
            taken = {normalize(pair.response)} | (avoid[i] if avoid is not None else set())
            choices = [j for j in row if self.keys[j] not in taken]
            picked = rng.choice(len(choices), size=min(count, len(choices)), replace=False)
            out.append([self.pool[choices[j]] for j in sorted(picked)])
        return out
