"""The one ranking path (coreply/ranking.py): filtering, over-fetch, fusion, ordering, pair scoring."""

import numpy as np
import pytest

from coreply.gate import confident, gated, lead, reach
from coreply.ranking import Candidates, Hits, Pipeline, Query, fuse, order, score_lists
from coreply.text import normalize

POOL = ["a", "b", "c", "Hello", "d", "e"]
KEYS = [normalize(t) for t in POOL]


def test_fusion_math():
    r, g = np.array([1.0, 2.0, 3.0]), np.array([3.0, 0.0, 0.0])
    assert fuse("sum", r, g).tolist() == [4.0, 2.0, 3.0]
    assert fuse("rerank", r, g) is g and fuse("retrieval", r, g) is r
    z = fuse("zscore", r, g, weight=0.5)
    by_hand = 0.5 * (r - 2) / r.std() + 0.5 * (g - 1) / g.std()
    np.testing.assert_allclose(z, by_hand, atol=1e-5)
    with pytest.raises(ValueError, match="unknown fusion"):
        fuse("max", r, g)


def test_the_first_stages_lead_and_the_gate():
    hybrid = Candidates(np.array([0, 1, 2]), np.array([0.0, 9.0, 1.0]), hybrid=np.array([2.0, 3.5, 0.0]))
    assert lead(hybrid) == 1.5  # the scores it is ordered by (with a lexical stage: the hybrid ones)
    assert confident(hybrid, 1.5) and not confident(hybrid, 1.6) and not confident(hybrid, None)
    lone = Candidates(np.array([4]), np.array([1.0]))
    assert lead(lone) == float("inf") and confident(lone, 100.0)  # nothing a reranker could reorder


def test_the_reach_is_the_candidates_before_the_first_the_first_stage_rules_out():
    c = Candidates(np.arange(5), np.array([5.0, 4.5, 4.0, 2.0, 4.75]))  # 4.75 after 2.0: not read
    assert reach(c, None) == 5  # no reach: every candidate
    assert reach(c, 1.0) == 2  # 4.0 trails the first by 1.0: it and all after it are left out
    assert reach(c, 1.01) == 3 and reach(c, 3.01) == 5
    assert reach(c, 0.1) == 1 and reach(c, 0.1, floor=3) == 3 and reach(c, 100.0, floor=9) == 5
    assert reach(Candidates(np.zeros(0, dtype=int), np.zeros(0)), 1.0) == 0
    assert gated(c, "sum", gate=0.25, margin=1.0) == ("retrieval", 0)  # leads 4.75 by 0.25: skipped
    assert gated(c, "sum", gate=0.3, margin=1.0) == ("sum", 2)
    assert gated(c, "sum", gate=0.3, margin=1.0, top_k=3) == ("sum", 3)  # at least the answers asked for
    assert gated(c, "zscore", gate=None, margin=None) == ("zscore", 5)
    assert gated(c, "retrieval", gate=None, margin=None) == ("retrieval", 0)


def test_order_fuses_the_reranked_prefix_and_keeps_the_rest_in_first_stage_order():
    c = Candidates(np.array([7, 8, 9, 6]), np.array([3.0, 2.0, 1.0, 0.5]), np.array([0.0, 4.0]))
    positions, final = order(c, "sum", 4, reranked=2)
    assert positions.tolist() == [1, 0, 2, 3] and final.tolist() == [6.0, 3.0, 1.0, 0.5]
    assert order(c, "sum", 1, reranked=2)[0].tolist() == [0]  # n_r still bounds the list
    assert order(c, "retrieval", 4, reranked=0)[0].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="rerank scores"):
        order(c, "sum", 4, reranked=3)  # only two were scored


def test_keep_drops_padding_echoes_and_exclusions_by_text_and_id():
    query = Query(context=("HELLO ",), exclude_texts=(" c",), exclude_ids={1})
    assert query.keep(np.array([3, -1, 0, 1, 2, 4]), KEYS) == [2, 5]
    assert query.depth(2) == 2 + 1 + 1 + 1


def test_order_fuses_the_first_n_r_and_keeps_retrieval_order_on_ties():
    c = Candidates(np.array([7, 8, 9]), np.array([3.0, 2.0, 1.0]), np.array([0.0, 0.0, 5.0]))
    positions, final = order(c, "rerank", 3)
    assert positions.tolist() == [2, 0, 1] and final.tolist() == [5.0, 0.0, 0.0]
    assert order(c, "rerank", 2)[0].tolist() == [0, 1]  # the third is beyond n_r
    assert order(c, "retrieval", 3)[0].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="rerank scores"):
        order(Candidates(c.ids, c.retrieval), "sum", 3)
    empty = Candidates(np.zeros(0, dtype=int), np.zeros(0))
    assert order(empty, "zscore", 5)[0].tolist() == []


def test_score_lists_splits_one_flat_call_back_per_context():
    calls = []

    def score(contexts, responses):
        calls.append(len(responses))
        return np.array([len(c) * 10 + len(r) for c, r in zip(contexts, responses, strict=True)])

    got = score_lists(score, [["x"], ["x", "y"], ["z"]], [["aa", "b"], [], ["ccc"]])
    assert calls == [3]
    assert [g.tolist() for g in got] == [[12.0, 11.0], [], [13.0]]


def test_pipeline_over_fetches_so_filtered_hits_do_not_shorten_the_list():
    asked = []

    def retrieve(contexts, k):  # every context gets the pool in order, echo first
        asked.append(k)
        ids = np.array([[3, 0, 1, 2, 4, 5][:k]] * len(contexts))
        return Hits(ids, -np.arange(k, dtype=float)[None].repeat(len(contexts), 0))

    def rank(n_r):
        got = ranking.recall(queries, [3, 3])
        ranking.rerank(queries, got, n_r)
        return got

    ranking = Pipeline(retrieve, POOL, KEYS, lambda c, r: np.array([float(t == "c") for t in r]))
    queries = [Query(("hello",)), Query(("x",), exclude_ids={0})]
    got = rank(2)
    assert asked == [3 + 2]  # one call, deep enough for the query with two blocked entries
    assert [c.ids.tolist() for c in got] == [[0, 1, 2], [3, 1, 2]]
    assert [c.rerank.tolist() for c in got] == [[0.0, 0.0], [0.0, 0.0]]  # only the first n_r = 2
    got = rank(3)
    assert [c.ids[order(c, "rerank", 3)[0]].tolist() for c in got] == [[2, 0, 1], [2, 3, 1]]


def test_passed_over_ids_are_never_candidates_and_the_search_is_not_widened_for_them():
    """Unlike a withdrawn id, a passed-over one (a reply that says nothing) costs no deeper search, which
    would let the response prior reorder the tail (results.md §73): the same k is asked for, and the
    other candidates keep their order."""
    asked = []

    def retrieve(contexts, k):
        asked.append(k)
        return Hits(np.array([[0, 1, 2, 3, 4, 5][:k]]), -np.arange(k, dtype=float)[None])

    plain = Pipeline(retrieve, POOL, KEYS).recall([Query(("x",))], [4])[0]
    passing = Pipeline(retrieve, POOL, KEYS, passed_over={1}).recall([Query(("x",))], [4])[0]
    assert asked[0] == asked[1] and plain.ids.tolist() == [0, 1, 2, 3]
    assert passing.ids.tolist() == [0, 2, 3, 4]
