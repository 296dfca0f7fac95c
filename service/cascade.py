"""Load-adaptive cascade: when requests keep queueing, do less work per request instead of letting the
queue grow, and go back to full work when the queue empties.

The signal is an exponentially weighted mean of the time requests wait for a micro-batch. Above
``high_ms`` the level steps up, below ``low_ms`` it steps down, at most one step per ``step_s`` (so
one slow batch does not flip it). Level 0 is full work; each level halves n_r (never below the floor);
the top level also skips the reranker when that is allowed. Bundles without a reranker are not
degraded: n_r costs them almost nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

MAX_LEVEL = 3


@dataclass(frozen=True)
class Plan:
    n_candidates: int
    skip_rerank: bool
    level: int


class Cascade:
    def __init__(
        self,
        high_ms: float,
        low_ms: float,
        floor: int,
        skip_rerank: bool,
        step_s: float = 1.0,
        smoothing: float = 0.2,
    ) -> None:
        self.high_s, self.low_s, self.floor = high_ms / 1000, low_ms / 1000, floor
        self.allow_skip, self.step_s, self.smoothing = skip_rerank, step_s, smoothing
        self.level, self.wait_s, self.changed = 0, 0.0, float("-inf")

    def observe(self, queue_s: float, now: float | None = None) -> None:
        """Feed one request's queue wait (seconds); may move the level by one."""
        now = time.monotonic() if now is None else now
        self.wait_s += self.smoothing * (queue_s - self.wait_s)
        if now - self.changed < self.step_s:
            return
        if self.wait_s > self.high_s and self.level < MAX_LEVEL:
            self.level, self.changed = self.level + 1, now
        elif self.wait_s < self.low_s and self.level > 0:
            self.level, self.changed = self.level - 1, now

    def plan(self, n_candidates: int, reranks: bool, top_k: int = 1) -> Plan:
        """What a request asking for ``n_candidates`` (and a rerank, if ``reranks``) gets now; never
        fewer candidates than the floor or the ``top_k`` it wants back, nor more than it asked for."""
        if not reranks or self.level == 0:
            return Plan(n_candidates, False, 0)
        n = min(n_candidates, max(self.floor, top_k, n_candidates >> self.level))
        return Plan(n, self.allow_skip and self.level == MAX_LEVEL, self.level)
