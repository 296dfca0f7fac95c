"""The restatement guard (coreply/restatement.py): calibration on human replies, and guarded recall."""

import numpy as np
import pytest

from coreply import restatement
from coreply.corpus import Pair
from coreply.ranking import Hits, Pipeline, Query
from coreply.text import normalize

# Pool texts as 2-d unit vectors at an angle: "ask" restates the query "question" (angle 5 degrees);
# the replies sit at 60+ degrees from it.
ANGLES = {"question": 0, "ask": 5, "reply one": 60, "reply two": 70, "reply three": 80, "reply four": 90}
ANGLES |= {f"filler {i}": 120 + 10 * i for i in range(8)}
POOL = list(ANGLES)[1:]


def vector(text: str) -> np.ndarray:
    a = np.radians(ANGLES[text])
    return np.array([np.cos(a), np.sin(a)], dtype="float32")


class ToyRetriever:
    """Returns the pool in a fixed order, restatement first; vectors from ANGLES."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def __call__(self, contexts, k):
        self.asked.append(k)
        ids = np.array([list(range(len(POOL)))[:k]] * len(contexts))
        return Hits(ids, -np.arange(ids.shape[1], dtype=float)[None].repeat(len(contexts), 0))

    def vectors(self, ids):
        return np.stack([vector(POOL[i]) for i in ids])

    def encode_responses(self, texts):
        return np.stack([2.0 * vector(t) for t in texts])  # not unit length: the guard normalises


def test_calibration_takes_the_quantile_of_human_replies_and_refuses_nonsense():
    pairs = [Pair(("hi", "question"), r, str(i)) for i, r in enumerate(POOL[1:5])]  # replies: 60-90 deg
    guard = restatement.calibrate(ToyRetriever().encode_responses, pairs, 0.5)
    median = (np.cos(np.radians(70)) + np.cos(np.radians(80))) / 2  # of the cosines at 60, 70, 80, 90 deg
    assert guard["threshold"] == pytest.approx(median, abs=1e-4)
    assert guard["quantile"] == 0.5 and guard["calibrated_on"] == "4 held-out pairs"
    with pytest.raises(ValueError, match="quantile"):
        restatement.calibrate(ToyRetriever().encode_responses, pairs, 1.0)
    with pytest.raises(ValueError, match="held-out pairs"):
        restatement.calibrate(ToyRetriever().encode_responses, [], 0.9)


def test_guarded_recall_drops_restatements_of_the_last_turn_only_and_fetches_past_them():
    retriever = ToyRetriever()
    threshold = float(np.cos(np.radians(25)))
    guarded = Pipeline(retriever, POOL, [normalize(t) for t in POOL], restatement=threshold)
    queries = [
        Query(("hi", "question")),
        Query(("hi", "question"), allow_restatements=True),
        Query(("question", "reply four")),  # the restatement is of an earlier turn: kept
    ]
    got = guarded.recall(queries, [2, 2, 2])
    assert [c.ids.tolist() for c in got] == [[1, 2], [0, 1], [0, 1]]
    assert got[0].retrieval.tolist() == [-1.0, -2.0]  # scores stay with their ids
    assert retriever.asked == [2 + 2 + restatement.MARGIN]
    plain = Pipeline(retriever, POOL, [normalize(t) for t in POOL])
    assert plain.recall(queries[:1], [2])[0].ids.tolist() == [0, 1]


def test_the_guard_needs_response_vectors():
    def bm25_like(contexts, k):
        return Hits(np.zeros((len(contexts), k), dtype=int), np.zeros((len(contexts), k)))

    with pytest.raises(ValueError, match="dense retriever"):
        Pipeline(bm25_like, POOL, POOL, restatement=0.9)
