"""Reply or restatement: how often an answer restates what the user just said.

A retriever trained as a similarity model answers "what's your favorite movie?" with "What is your
favorite movie?". The echo filter removes only exact copies; this metric catches the near ones. An
answer *restates* the context's last turn when their cosine similarity under a fixed judge (zero-shot
all-MiniLM-L6-v2, the same for every system, so rates compare) reaches :data:`THRESHOLD`, a value that
human replies rarely reach (docs/results.md gives the share of gold replies above it). The rate of the
gold replies themselves is the reference: a system should restate about as rarely as people do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coreply.models import BiEncoder
from coreply.text import unigram_f1
from coreply.vectors import TextVectors, unit

THRESHOLD = 0.8
"""Judge cosine at and above which an answer counts as a restatement of the last turn."""

WORDS_THRESHOLD = 0.6
"""Unigram F1 with the last turn at and above which an answer restates it by its words: the second,
model-free judge."""


class RestatementJudge:
    """Cosine similarity of (last turn, answer) under one fixed bi-encoder's response tower."""

    def __init__(self, judge: BiEncoder, threshold: float = THRESHOLD) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"the restatement threshold must be in (0, 1], got {threshold}")
        self.judge = judge.eval()
        self.threshold = threshold
        # embed(texts) -> unit vectors [N, D]; every text is embedded once per judge
        self.embed = TextVectors(lambda texts: unit(self.judge.embed_responses(texts).numpy()))

    def similarity(self, contexts: Sequence[Sequence[str]], answers: Sequence[str]) -> np.ndarray:
        """Cosine of each answer with its context's last turn: [N]."""
        if len(contexts) != len(answers):
            raise ValueError("similarity() needs one answer per context")
        last = self.embed([c[-1] for c in contexts])
        return np.einsum("nd,nd->n", last, self.embed(list(answers)))

    def flags(self, contexts: Sequence[Sequence[str]], answers: Sequence[str | None]) -> np.ndarray:
        """1.0 where the answer restates the last turn, 0.0 otherwise or where there is no answer: [N]."""
        have = [i for i, a in enumerate(answers) if a is not None]
        out = np.zeros(len(answers))
        if have:
            sims = self.similarity([contexts[i] for i in have], [answers[i] for i in have])  # type: ignore[misc]
            out[have] = (sims >= self.threshold).astype(float)
        return out

    def rate(self, contexts: Sequence[Sequence[str]], answers: Sequence[str | None]) -> float:
        """Percentage of answers that restate their context's last turn."""
        return float(100 * self.flags(contexts, answers).mean()) if len(answers) else 0.0


def words_rate(contexts: list, answers: list[str | None]) -> float:
    """% of answers whose unigram F1 with their context's last turn reaches :data:`WORDS_THRESHOLD`."""
    flags = [
        a is not None and unigram_f1(c[-1], a) >= WORDS_THRESHOLD
        for c, a in zip(contexts, answers, strict=True)
    ]
    return round(100 * float(np.mean(flags)), 2)
