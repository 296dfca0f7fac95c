"""The restatement guard: an answer is a reply, not a rewording of what was just said.

A retriever that starts as a sentence-similarity model ranks paraphrases of the context high ("what's
your favorite movie?" -> "What is your favorite movie?"), and training on replies makes it do so more
(docs/results.md §9.2). The echo filter drops only exact copies of context turns. The guard also drops a
candidate too close to the context's last turn, or to one of the turns before it, all texts embedded as
*responses* by the bundle's own retriever (the guard encodes turns it has not seen, a few short texts
per request, and reads the candidates' vectors back from the index). Each of the two thresholds is
calibrated on held-out (context, human reply) pairs: the ``quantile`` of the same cosine between the
reply a person actually gave and the last turn (resp. the closest earlier turn). With the default 0.995
each would drop one human reply in 200. A third threshold drops a candidate that shares too many of the
last turn's words (F1 of their sets of distinct words, :class:`WordSets`, at :data:`WORDS_QUANTILE` of
the human replies', whatever the cosine quantile: "i just got a new puppy!" -> "Yep a new puppy!"); the
manifest records the share of human replies that any of the three drops.

A conversation's short first turn (an *opener*, :func:`is_opener`: "hello", "hey there!") is answered in
kind: people greet back ("Hello" -> "Hi", "Hey!" -> "Hi! Hi! Hi!"), and thresholds calibrated on all
replies drop about half of the replies people gave to openers (docs/results.md §72). An opener's
last-turn cosine threshold is therefore calibrated on the held-out openers alone, where there are at
least :data:`MIN_OPENERS` of them; the words threshold stays (a greeting back shares no word: "hello" ->
"Hi"; an answer that does is most often an echo: "Hello world" -> "world").

Calibration runs where a bundle is built and where ``coreply eval`` evaluates, from one function, so the
guard that serves is the guard that was measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coreply.text import words
from coreply.vectors import TextVectors, unit

DEFAULT_QUANTILE = 0.995
"""Share of held-out human replies each threshold lets through."""
WORDS_QUANTILE = 0.995
"""The word-overlap threshold's quantile (docs/results.md §41: at the 0.98 cosine quantile it drops
the restatements that share the last turn's words for no measurable hits@1)."""
MAX_PAIRS = 5000
"""Held-out pairs the thresholds are calibrated on, at most."""
OPENER_WORDS = 3
"""A context of one turn of at most this many words is an opener (:func:`is_opener`)."""
MIN_OPENERS = 50
"""Held-out openers needed to calibrate a threshold of their own (fewer: openers are guarded as the rest)."""
TURNS = 5
"""Context turns (the last ones) a candidate must not restate; the built-in corpus's contexts hold 5."""
MARGIN = 5
"""Extra hits a guarded recall fetches at first, so that ``n`` usually survive the guard."""
DEEPEN = 8
"""A guarded query left with fewer than ``n`` candidates is searched again this many times deeper..."""
MAX_DEPTH = 1000
"""...up to this many hits (a paraphrase-rich pool can hold dozens of restatements of one question)."""

EncodeResponses = Callable[[Sequence[str]], np.ndarray]
"""texts [N] -> response vectors [N, D] (the retriever's response tower)."""


def is_opener(context: Sequence[str]) -> bool:
    """Whether ``context`` is a conversation's first turn of at most :data:`OPENER_WORDS` words."""
    return len(context) == 1 and len(words(context[0])) <= OPENER_WORDS


@dataclass(frozen=True)
class Guard:
    """A candidate restates its context when its cosine is at least ``last`` with the last turn or at
    least ``earlier`` with one of the turns before it, or when its distinct words overlap the last
    turn's with an F1 (:meth:`WordSets.overlap`) of at least ``words`` (infinite: not checked, as in
    bundles built before the words threshold). An opener's context is held to ``opener`` instead of
    ``last``, where the guard has one (bundles built before it do not)."""

    last: float
    earlier: float
    words: float = float("inf")
    opener: float | None = None

    @classmethod
    def of(cls, entry: dict[str, Any]) -> Guard:
        """From a manifest entry written by :func:`calibrate`."""
        words = float(entry.get("words_last_turn", "inf"))
        opener = entry.get("openers")
        opener = None if opener is None else float(opener["last_turn"])
        return cls(float(entry["last_turn"]), float(entry["earlier_turns"]), words, opener)

    def flags(
        self, last: np.ndarray, earlier: np.ndarray, overlap: np.ndarray, opener: bool | np.ndarray = False
    ) -> np.ndarray:
        """Where candidates of these :func:`closeness` and :meth:`WordSets.overlap` ([k] each) restate;
        ``opener``: of an opener's context (one bool, or [k]). One that shares no word never does by
        words (when most human replies share none, the threshold can be 0)."""
        last_at = self.last if self.opener is None else np.where(opener, self.opener, self.last)
        return (last >= last_at) | (earlier >= self.earlier) | ((overlap >= self.words) & (overlap > 0))


def closeness(
    turn_vectors: Callable[[Sequence[str]], np.ndarray],
    contexts: Sequence[Sequence[str]],
    candidates: Sequence[np.ndarray],
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per context, each candidate's cosine with the last turn and its highest with the (up to
    :data:`TURNS` - 1) turns before it (-1 when there are none): candidate vectors [k_i, D] -> ([k_i],
    [k_i]). ``turn_vectors`` gives unit vectors of all contexts' turns in one call."""
    turns = [list(c)[-TURNS:] for c in contexts]
    embedded = turn_vectors([t for ts in turns for t in ts])  # [sum turns, D]
    out = []
    for v, e in zip(candidates, np.split(embedded, np.cumsum([len(ts) for ts in turns])[:-1]), strict=True):
        if not len(v):
            out.append((np.zeros(0), np.zeros(0)))
            continue
        cosine = unit(v) @ e.T  # [k_i, turns]
        earlier = cosine[:, :-1].max(axis=1) if cosine.shape[1] > 1 else np.full(len(v), -1.0)
        out.append((cosine[:, -1], earlier))
    return out


def check_quantile(quantile: float) -> float:
    """``quantile`` when the guard can be calibrated at it, [0.5, 1); else a ValueError (NaN too)."""
    if not 0.5 <= quantile < 1.0:
        raise ValueError(f"the restatement quantile must be in [0.5, 1), got {quantile}")
    return quantile


class WordSets:
    """The distinct words of each of ``texts`` (:func:`coreply.text.words`), hashed into one flat array,
    so that a request measures its candidates' overlap with its last turn without reading their texts
    again (0.9 s and 16 MB for the built-in pool of 124,141, once; 0.05 ms for 105 candidates)."""

    def __init__(self, texts: Sequence[str]) -> None:
        flat: list[int] = []
        sizes = np.zeros(len(texts), dtype="int64")
        for i, text in enumerate(texts):
            distinct = set(words(text))
            flat.extend(map(hash, distinct))
            sizes[i] = len(distinct)
        self.flat = np.array(flat, dtype="int64")  # [sum sizes] word hashes, text by text
        self.sizes = sizes  # [T]
        self.starts = np.cumsum(sizes) - sizes  # [T]

    def overlap(self, turn: str, ids: np.ndarray) -> np.ndarray:
        """F1 of the distinct words of each text ``ids`` [k] with those of ``turn``: 2 * shared / (the
        two counts), 0 when either has none: [k]."""
        ids = np.asarray(ids, dtype="int64")
        mine = np.array([hash(w) for w in set(words(turn))], dtype="int64")
        sizes = self.sizes[ids]  # [k]
        total = int(sizes.sum())
        rows = np.repeat(np.arange(len(ids)), sizes)  # [total] which candidate each word is of
        at = np.repeat(self.starts[ids] - np.cumsum(sizes) + sizes, sizes) + np.arange(total)  # [total]
        shared = np.bincount(rows, weights=np.isin(self.flat[at], mine), minlength=len(ids))  # [k]
        both = sizes + len(mine)
        return np.divide(2 * shared, both, out=np.zeros(len(ids)), where=both > 0)


def human_closeness(
    encode_responses: EncodeResponses, pairs: Sequence[Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The human reply's :func:`closeness` to the last turn and to the earlier turns, its
    :meth:`WordSets.overlap` with the last turn, and whether its context is an opener (:func:`is_opener`)
    ([N] each), over (at most :data:`MAX_PAIRS` of) held-out ``pairs`` (objects with ``context`` and
    ``response``): :func:`guard_entry`'s arguments."""
    pairs = list(pairs)[:MAX_PAIRS]
    if not pairs:
        raise ValueError("calibrating the restatement guard needs held-out pairs")
    gold = encode_responses([p.response for p in pairs])  # [N, D]
    turns = TextVectors(lambda texts: unit(encode_responses(texts)))
    near = closeness(turns, [p.context for p in pairs], gold[:, None])
    last, earlier = (np.concatenate(x) for x in zip(*near, strict=True))  # [N] x2
    replies = WordSets([p.response for p in pairs])
    overlap = np.array([replies.overlap(p.context[-1], np.array([i]))[0] for i, p in enumerate(pairs)])  # [N]
    return last, earlier, overlap, np.array([is_opener(p.context) for p in pairs], dtype=bool)


def guard_entry(
    last: np.ndarray,
    earlier: np.ndarray,
    overlap: np.ndarray,
    quantile: float,
    openers: np.ndarray | None = None,
) -> dict[str, Any]:
    """The guard's manifest entry from :func:`human_closeness`: the ``quantile`` of each closeness and
    the :data:`WORDS_QUANTILE` of the word overlap, and the share of those replies that any drops. With
    ``openers`` ([N] bool: which pairs' contexts are openers) and at least :data:`MIN_OPENERS` of them,
    also the openers' own last-turn threshold, the same quantile of their replies' cosines alone, and the
    share of their replies that the common thresholds would have dropped."""
    check_quantile(quantile)
    guard = Guard(
        float(np.quantile(last, quantile)),
        float(np.quantile(earlier, quantile)),
        float(np.quantile(overlap, WORDS_QUANTILE)),
    )
    entry: dict[str, Any] = {
        "last_turn": round(guard.last, 4),
        "earlier_turns": round(guard.earlier, 4),
        "words_last_turn": round(guard.words, 4),
        "quantile": quantile,
        "words_quantile": WORDS_QUANTILE,
    }
    mine = np.zeros(len(last), dtype=bool) if openers is None else openers
    if mine.sum() >= MIN_OPENERS:
        entry["openers"] = {
            "last_turn": round(float(np.quantile(last[mine], quantile)), 4),
            "pairs": int(mine.sum()),
            "dropped_by_the_others": round(float(np.mean(guard.flags(last, earlier, overlap)[mine])), 4),
        }
        guard = Guard.of(entry)
    dropped = guard.flags(last, earlier, overlap, mine)
    entry["human_replies_dropped"] = round(float(np.mean(dropped)), 4)
    entry["calibrated_on"] = f"{len(last)} held-out pairs"
    return entry


def calibrate(encode_responses: EncodeResponses, pairs: Sequence[Any], quantile: float) -> dict[str, Any]:
    """The guard's manifest entry at ``quantile``, calibrated on held-out ``pairs`` (the openers' own
    threshold among them)."""
    check_quantile(quantile)  # before the encoding
    last, earlier, overlap, openers = human_closeness(encode_responses, pairs)
    return guard_entry(last, earlier, overlap, quantile, openers)


def restating(
    turn_vectors: Callable[[Sequence[str]], np.ndarray],
    vectors: Callable[[np.ndarray], np.ndarray],
    word_sets: Callable[[], WordSets],
    contexts: Sequence[Sequence[str]],
    ids: Sequence[np.ndarray],
    guard: Guard,
) -> list[np.ndarray]:
    """Per context, a boolean mask over its candidate ``ids`` [k_i]: True where the candidate restates
    the context under ``guard``. ``vectors(ids [n]) -> [n, D]`` reads the pool's vectors, ``word_sets()``
    gives the pool's :class:`WordSets` (asked only when the guard counts words)."""
    if not contexts:
        return []
    flat = np.concatenate([np.asarray(i, dtype="int64") for i in ids])  # [sum k_i]
    pool = vectors(flat) if len(flat) else np.zeros((0, 1), dtype="float32")  # [sum k_i, D]
    candidates = np.split(pool, np.cumsum([len(i) for i in ids])[:-1])
    near = closeness(turn_vectors, contexts, candidates)
    words_of = word_sets() if guard.words != float("inf") else None  # older bundles' guards count none
    return [
        guard.flags(
            last, earlier, np.zeros(len(i)) if words_of is None else words_of.overlap(c[-1], i), is_opener(c)
        )
        for (last, earlier), c, i in zip(near, contexts, ids, strict=True)
    ]
