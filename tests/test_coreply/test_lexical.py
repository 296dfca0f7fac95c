"""The lexical stage's BM25 (coreply/lexical.py): the scores bm25s gives, statistics that add up and
refuse nonsense, and a pipeline that reorders its candidates by them."""

import json
import os
import subprocess
import sys

import bm25s
import numpy as np
import pytest
from bm25s.stopwords import STOPWORDS_EN

from coreply.lexical import BM25, Stage
from coreply.ranking import Hits, Pipeline, Query, order
from coreply.text import normalize

POOL = [
    "I love hiking in the mountains, the mountains are my home.",
    "Do you like pizza? Pizza with olives is the best pizza.",
    "I am",  # stopwords only: no terms at all
    "My dog loves the beach; we go to the beach every weekend.",
    "Hiking? Never. I prefer the beach and a good book.",
    "What is your favourite book?",
    "ok",  # one letter short of a term: nothing either
    "Mountains, beaches, books: I like them all. Café au lait too.",
]
QUERIES = [
    "do you like hiking in the mountains? mountains!",  # a repeated term counts twice
    "beach or book",
    "the a of",  # stopwords only
    "zebra quantum",  # no term of the pool
    "CAFÉ au lait",  # case and accents
]


def test_scores_are_those_of_bm25s_over_the_whole_pool():
    mine = BM25.fit(POOL, STOPWORDS_EN)
    ref = bm25s.BM25()  # its defaults: Lucene's variant, k1 1.5, b 0.75; English stopwords by default
    ref.index(bm25s.tokenize(POOL, show_progress=False), show_progress=False)
    for query in QUERIES:
        terms = [t for t in bm25s.tokenize([query], return_ids=False)[0] if t in ref.vocab_dict]
        expected = ref.get_scores(terms) if terms else np.zeros(len(POOL))  # [P]
        np.testing.assert_allclose(mine.scores(query, POOL), expected, rtol=1e-5, atol=1e-6)
    assert mine.scores(QUERIES[0], POOL)[0] > mine.scores(QUERIES[0], POOL)[4] > 0  # both hike, one twice


def test_the_pool_index_scores_candidates_by_id_bit_for_bit_as_their_texts_do():
    """A request scores its candidates from the pool's term counts, counted once: the same floats as
    tokenising their texts, in any order and subset (a repeated id too), and none for no candidates."""
    bm25 = BM25.fit(POOL, STOPWORDS_EN)
    index = bm25.index(POOL)
    for ids in (np.arange(len(POOL)), np.array([7, 0, 3, 3, 2]), np.array([], dtype=int)):
        for query in QUERIES:
            want = bm25.scores(query, [POOL[i] for i in ids])
            np.testing.assert_array_equal(bm25.scores_at(query, index, ids), want)
    assert bm25.scores_at(QUERIES[0], index, np.arange(len(POOL)))[0] > 0


def test_adding_responses_counts_them_as_fitting_all_of_them_would():
    assert BM25.fit(POOL[:3], STOPWORDS_EN).add(POOL[3:]) == BM25.fit(POOL, STOPWORDS_EN)
    assert BM25.from_json(BM25.fit(POOL, STOPWORDS_EN).to_json()) == BM25.fit(POOL, STOPWORDS_EN)


def test_one_pool_writes_the_same_statistics_whatever_the_processs_string_hashing():
    """A bundle's version is the hash of its files, so two builds of one pool must write the same bytes:
    the terms' order may not follow set iteration, which changes with each process's hash seed."""
    code = (
        "import json, sys; from coreply.lexical import BM25; "
        "print(json.dumps(BM25.fit(json.loads(sys.argv[1]), json.loads(sys.argv[2])).to_json()))"
    )
    args = [json.dumps(POOL), json.dumps(sorted(STOPWORDS_EN))]
    written = {
        subprocess.run(
            [sys.executable, "-c", code, *args],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(written) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "other/1"}, "format"),
        ({"docs": -1}, "counts"),
        ({"df": {"beach": 99}}, "document count"),
        ({"df": {"beach": 0}}, "document count"),
        ({"stopwords": "english"}, "stopwords"),
        ({"k1": 0}, "k1"),
        ({"b": 2}, "k1"),
    ],
)
def test_statistics_that_do_not_add_up_are_refused(change, message):
    data = BM25.fit(POOL, STOPWORDS_EN).to_json() | change
    with pytest.raises(ValueError, match=message):
        BM25.from_json(data)


class FixedRetriever:
    """Hits in a fixed order with fixed scores, whatever the context."""

    def __init__(self, scores: list[float]) -> None:
        self.scores = np.array(scores)

    def __call__(self, contexts, k):
        ids = np.argsort(-self.scores, kind="stable")[:k]
        return Hits(np.tile(ids, (len(contexts), 1)), np.tile(self.scores[ids], (len(contexts), 1)))


def test_the_pipeline_reorders_its_first_depth_candidates_by_fused_scores_then_keeps_n():
    dense = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]  # pool order
    bm25 = BM25.fit(POOL, STOPWORDS_EN)
    stage = Stage(bm25, weight=0.3, depth=6, turns=1)
    pipe = Pipeline(FixedRetriever(dense), POOL, [normalize(t) for t in POOL], lexical=stage)
    context = ("tell me about the mountains", "I like the beach and books")  # turns=1: the last only
    (got,) = pipe.recall([Query(context)], [3])
    first = np.arange(6)  # the first six by dense score; the last two are beyond the depth
    lexical = bm25.scores(context[-1], [POOL[i] for i in first])
    z = lambda x: (x - x.mean()) / (x.std() + 1e-6)  # noqa: E731
    fused = 0.3 * z(np.array(dense[:6])) + 0.7 * z(lexical)
    best = np.argsort(-fused, kind="stable")[:3]
    assert got.ids.tolist() == first[best].tolist() and got.ids[0] == 3  # the beach, twice
    np.testing.assert_allclose(got.hybrid, fused[best])
    np.testing.assert_allclose(got.lexical, lexical[best])
    assert got.retrieval.tolist() == [dense[i] for i in got.ids]  # dense scores stay the retriever's
    assert order(got, "retrieval", 3)[0].tolist() == [0, 1, 2]  # "retrieval" keeps the first stage's order
    assert "lexical" in pipe.timings
    plain = Pipeline(FixedRetriever(dense), POOL, [normalize(t) for t in POOL])
    assert plain.recall([Query(context)], [3])[0].ids.tolist() == [0, 1, 2]  # without the stage
