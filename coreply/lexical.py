"""The lexical stage: the dense stage's first ``depth`` answerable candidates, each scored by BM25 against
the words of the context's last turns, and reordered by ``weight * z(dense) + (1 - weight) * z(BM25)``
(per query, over those candidates). Dense retrieval ranks by meaning; BM25 adds the exact words a reply
shares with the conversation (names, places, the topic's nouns), and on the chitchat corpus lifted
hits@1 of the served retriever significantly (docs/results.md §34).

BM25 here is Lucene's variant as ``bm25s`` scores it (``bench/hybrid_bm25.py`` measured with bm25s;
``tests`` hold the two equal): terms are lower-cased ``\\w\\w+`` runs less the stopwords; a term's idf is
``log(1 + (N - df + 0.5) / (df + 0.5))`` over the N pool responses; a candidate's score is the sum, over the
query's terms (repeats counted), of ``idf * tf / (tf + k1 * (1 - b + b * length / mean length))``.

Its statistics (document frequencies, pool size and length, stopwords, parameters) are a bundle's
``lexical.json``; the pool's term counts are counted once, when a pipeline is made
(:class:`TermIndex`), so a request tokenises only its query.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMAT = "coreply-lexical/1"
WORD = re.compile(r"(?u)\b\w\w+\b")
DEPTH = 100
"""Dense candidates the stage reorders (as measured in docs/results.md §34)."""
TURNS = 5
"""Context turns whose words make the query: the evaluation's contexts hold at most five."""
PAIRS = 2000
"""Held-out pairs on which a builder chooses the stage's weight (``coreply index build --lexical auto``)."""


@dataclass(frozen=True)
class BM25:
    """BM25 statistics of a pool: document frequency per term, the pool's size and total length."""

    df: dict[str, int]
    docs: int
    length: int  # terms in the whole pool
    stopwords: frozenset[str] = frozenset()
    k1: float = 1.5
    b: float = 0.75

    def terms(self, text: str) -> list[str]:
        return [t for t in WORD.findall(text.lower()) if t not in self.stopwords]

    @classmethod
    def fit(cls, texts: Sequence[str], stopwords: Sequence[str] = ()) -> BM25:
        return cls({}, 0, 0, frozenset(stopwords)).add(texts)

    def add(self, texts: Sequence[str]) -> BM25:
        """These statistics with ``texts`` added to the pool."""
        df = Counter(self.df)
        length = self.length
        for text in texts:
            terms = self.terms(text)
            df.update(set(terms))
            length += len(terms)
        return BM25(dict(df), self.docs + len(texts), length, self.stopwords, self.k1, self.b)

    def scores(self, query: str, texts: Sequence[str]) -> np.ndarray:
        """[n] the BM25 score of each text (a pool response) for ``query``."""
        mean = self.length / max(self.docs, 1)
        weights = Counter(self.terms(query))  # a repeated query term counts each time
        idf = {t: math.log(1 + (self.docs - d + 0.5) / (d + 0.5)) for t in weights if (d := self.df.get(t))}
        out = np.zeros(len(texts))
        for i, text in enumerate(texts):
            terms = self.terms(text)
            norm = self.k1 * (1 - self.b + self.b * len(terms) / mean) if mean else self.k1
            for term, tf in Counter(t for t in terms if t in idf).items():
                out[i] += weights[term] * idf[term] * tf / (tf + norm)
        return out

    def index(self, texts: Sequence[str]) -> TermIndex:
        """The term counts of ``texts`` (a pool, row i = id i), for :meth:`scores_at`."""
        vocab: dict[str, int] = {}
        starts, terms, counts, lengths = [0], [], [], []
        for text in texts:
            words = self.terms(text)
            tf = Counter(words)  # first occurrences first, as :meth:`scores` sums them
            terms += [vocab.setdefault(t, len(vocab)) for t in tf]
            counts += tf.values()
            starts.append(len(terms))
            lengths.append(len(words))
        columns = (np.array(x, dtype=np.int32) for x in (terms, counts, lengths))
        return TermIndex(vocab, np.array(starts, dtype=np.int64), *columns)

    def scores_at(self, query: str, index: TermIndex, ids: np.ndarray) -> np.ndarray:
        """[n] :meth:`scores` of the pool responses ``ids`` [n] (bit for bit), from their ``index``."""
        ids = np.asarray(ids, dtype=np.int64)
        mean = self.length / max(self.docs, 1) or 1.0  # (a pool without terms has nothing to score)
        weights = np.zeros(len(index.vocab))  # per term id: its count in the query times its idf
        for term, count in Counter(self.terms(query)).items():
            if (d := self.df.get(term)) and term in index.vocab:
                weights[index.vocab[term]] = count * math.log(1 + (self.docs - d + 0.5) / (d + 0.5))
        lo, size = index.starts[ids], index.starts[ids + 1] - index.starts[ids]  # [n] each one's run of terms
        row = np.repeat(np.arange(len(ids)), size)  # [m] the candidate of each term entry
        at = np.arange(len(row)) + np.repeat(lo - (np.cumsum(size) - size), size)  # [m] where it is
        w, tf = weights[index.terms[at]], index.counts[at]  # [m] x2
        norm = self.k1 * (1 - self.b + self.b * index.lengths[ids] / mean)  # [n]
        hit = w > 0
        return np.bincount(row[hit], w[hit] * tf[hit] / (tf[hit] + norm[row[hit]]), minlength=len(ids))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "k1": self.k1,
            "b": self.b,
            "docs": self.docs,
            "length": self.length,
            "stopwords": sorted(self.stopwords),
            "df": dict(sorted(self.df.items())),  # not set order: the same bytes from any process
        }

    @classmethod
    def from_json(cls, data: Any) -> BM25:
        """Statistics as :meth:`to_json` wrote them; ``ValueError`` says what does not fit."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"expected format {FORMAT!r}")
        df, docs, length = data.get("df"), data.get("docs"), data.get("length")
        if not (isinstance(docs, int) and isinstance(length, int) and docs >= 0 and length >= 0):
            raise ValueError("'docs' and 'length' must be counts")
        if not isinstance(df, dict) or not all(isinstance(d, int) and 0 < d <= docs for d in df.values()):
            raise ValueError("'df' must map each term to a document count in [1, docs]")
        stopwords = data.get("stopwords")
        if not isinstance(stopwords, list) or not all(isinstance(w, str) for w in stopwords):
            raise ValueError("'stopwords' must be a list of words")
        k1, b = data.get("k1"), data.get("b")
        if not (isinstance(k1, (int, float)) and k1 > 0 and isinstance(b, (int, float)) and 0 <= b <= 1):
            raise ValueError("'k1' must be > 0 and 'b' in [0, 1]")
        return cls(df, docs, length, frozenset(stopwords), float(k1), float(b))


@dataclass(frozen=True)
class TermIndex:
    """A pool's term counts by response id, compressed rows: response i's terms are
    ``terms[starts[i]:starts[i + 1]]`` (ids into ``vocab``), each counted ``counts`` times."""

    vocab: dict[str, int]
    starts: np.ndarray  # [N + 1] int64
    terms: np.ndarray  # [nnz] int32
    counts: np.ndarray  # [nnz] int32
    lengths: np.ndarray  # [N] int32, terms in each response (stopwords out)


@dataclass(frozen=True)
class Stage:
    """The lexical stage of a pipeline: ``bm25`` statistics of its pool, the weight of the dense score in
    the fusion, the candidates it reorders and the context turns its query reads."""

    bm25: BM25
    weight: float
    depth: int = DEPTH
    turns: int = TURNS

    def query(self, context: Sequence[str]) -> str:
        """The words the stage searches with: the last :attr:`turns` turns of ``context``."""
        return " ".join(context[-self.turns :])

    def scores(self, context: Sequence[str], texts: Sequence[str]) -> np.ndarray:
        """[n] BM25 scores of ``texts`` for ``context``."""
        return self.bm25.scores(self.query(context), texts)
