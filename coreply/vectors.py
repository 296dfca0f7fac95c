"""Vectors of texts, each text encoded once: the knowledge selector's sentences, the restatement guard's
context turns and the restatement judge's answers all repeat across calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1: [N, D] -> [N, D]."""
    x = np.asarray(x, dtype="float32")
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class TextVectors:
    """``encode(texts [n]) -> [n, D]``, run only on texts not seen before; the cache starts again (keeping
    the call's own texts) when it would outgrow ``size`` texts. Not thread-safe (each user calls it from
    one thread)."""

    def __init__(self, encode: Callable[[Sequence[str]], np.ndarray], size: int = 50_000) -> None:
        self.encode, self.size = encode, size
        self._cache: dict[str, np.ndarray] = {}

    def warm(self, texts: Sequence[str]) -> None:
        """Encode the texts not yet cached, in one call."""
        wanted = dict.fromkeys(texts)
        new = [t for t in wanted if t not in self._cache]
        if new:
            if len(self._cache) + len(new) > self.size:
                self._cache = {t: self._cache[t] for t in wanted if t in self._cache}
            self._cache.update(zip(new, np.asarray(self.encode(new)), strict=True))

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        """[n] texts -> [n, D] (``[0, 0]`` for none)."""
        self.warm(texts)
        return np.stack([self._cache[t] for t in texts]) if len(texts) else np.zeros((0, 0), dtype="float32")
