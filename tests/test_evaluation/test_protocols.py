import numpy as np
import pytest
import torch
from conftest import toy_pool

from coreply.config import ModelConfig
from coreply.corpus import Pair
from coreply.models import BiEncoder, CrossEncoder
from coreply.ranking import Candidates, Pipeline
from coreply.text import normalize
from evaluation.protocols import (
    BM25Retriever,
    DenseRetriever,
    Retrieved,
    conversation_others,
    evaluate_lists,
    evaluate_pool,
    protocol_a_lists,
    ranks_for,
    retrieve_and_rerank,
)

POOL = ["I love pizza", "i love  PIZZA", "yes i have a dog", "it is sunny", "hello", "good morning"]


def test_protocol_a_lists_are_deterministic_with_gold_first_and_distinct_negatives():
    pairs = [Pair(("what food ?",), "I love pizza"), Pair(("pet ?",), "yes i have a dog")]
    lists = protocol_a_lists(pairs, POOL, size=4, seed=1)
    assert lists == protocol_a_lists(pairs, POOL, size=4, seed=1)
    for pair, cands in zip(pairs, lists, strict=True):
        assert cands[0] == pair.response and len(cands) == 4
        assert all(normalize(c) != normalize(pair.response) for c in cands[1:])
        assert len({normalize(c) for c in cands}) == 4
    shipped = Pair(("q",), "a", negatives=("b", "c", "d", "e"))
    assert protocol_a_lists([shipped], POOL, size=3) == [["a", "b", "c"]]


def test_ranks_for_rerank_and_sum_and_retrieval():
    pool = ["a", "b", "c", "d"]
    keys = pool
    pairs = [Pair(("q",), "c"), Pair(("q",), "d")]
    ids, retrieval = np.array([0, 1, 2]), np.array([3.0, 2.0, 1.0])
    got = Retrieved(
        [Candidates(ids, retrieval, np.array([0.0, 0.0, 5.0])), Candidates(ids, retrieval, np.zeros(3))],
        retrieve_s=0.0,
        rerank_s=0.0,
    )
    assert ranks_for(pairs, keys, got, "retrieval", 3) == [3.0, float("inf")]
    assert ranks_for(pairs, keys, got, "rerank", 3) == [1.0, float("inf")]
    assert ranks_for(pairs, keys, got, "sum", 3) == [1.0, float("inf")]  # 6 vs 3, 2
    assert ranks_for(pairs, keys, got, "rerank", 2) == [float("inf"), float("inf")]  # gold beyond n_r


def test_evaluate_pool_reranks_only_the_retrievers_first_n_r():
    pool = [f"reply {i}" for i in range(12)]
    pairs = [Pair(("q",), "reply 3"), Pair(("q",), "reply 11")]  # retrieved 4th, and 12th: beyond n_r
    ids = np.arange(12)
    got = Retrieved([Candidates(ids, 0.1 * (12 - ids)) for _ in pairs], retrieve_s=0.0, rerank_s=0.0)
    seen = []

    class GoldFinder:  # a reranker that scores each context's gold 1, anything else 0
        def score_pairs(self, contexts, responses):
            seen.extend(responses)
            return torch.tensor([float(r in ("reply 3", "reply 11")) for r in responses])

    out = evaluate_pool(pairs, pool, got, GoldFinder(), n_r=10)
    assert len(seen) == 20 and "reply 11" not in seen
    assert out["bi_pool"]["ranks"] == [4.0, 12.0]
    assert out["cross_pool"]["ranks"] == out["sum_pool"]["ranks"] == [1.0, float("inf")]
    assert out["sum_pool"]["metrics"]["hits@1"] == 50.0
    assert set(evaluate_pool(pairs, pool, got)) == {"bi_pool"}


def test_bm25_finds_the_lexically_matching_response():
    retrieve = BM25Retriever(["the cat sat", "dogs bark loudly", "sunny weather today"])
    hits = retrieve([["is the weather sunny ?"]], 2)
    assert hits.ids[0][0] == 2 and hits.scores[0][0] > hits.scores[0][1]


def test_dense_retriever_matches_brute_force_inner_product(tiny_model_dir):
    torch.manual_seed(0)
    bi = BiEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir))).eval()
    retrieve = DenseRetriever(bi, POOL)
    contexts = [["hello", "what food ?"], ["good morning"]]
    hits = retrieve(contexts, 3)
    brute = bi.embed_contexts(contexts) @ bi.embed_responses(POOL).T
    top = torch.topk(brute, 3, dim=1)
    assert hits.ids.tolist() == top.indices.tolist() and hits.codes is None
    assert np.allclose(hits.scores, top.values.numpy(), atol=1e-4)


def test_evaluate_lists_and_retrieve_and_rerank_run_with_real_models(tiny_model_dir):
    config = ModelConfig(base_model=str(tiny_model_dir))
    bi, cross = BiEncoder.from_pretrained(config).eval(), CrossEncoder.from_pretrained(config).eval()
    pairs = [Pair(("hello", "what food ?"), "I love pizza"), Pair(("pet ?",), "yes i have a dog")]
    lists = protocol_a_lists(pairs, POOL, size=4)
    result = evaluate_lists(pairs, lists, bi, cross)
    assert set(result) == {"bi", "cross", "sum"}
    assert all(len(r["ranks"]) == 2 and 1 <= min(r["ranks"]) <= 4 for r in result.values())
    keys = [normalize(t) for t in POOL]
    ranking = Pipeline(DenseRetriever(bi, POOL), POOL, keys, lambda c, r: cross.score_pairs(c, r).numpy())
    got = retrieve_and_rerank(pairs, ranking, depth=4, n_r=3)
    assert [len(c.rerank) for c in got.candidates] == [3, 3]
    assert all(keys[i] != "hello" for i in got.candidates[0].ids)  # the echo of turn 1 is gone
    top = int(got.candidates[0].ids[0])  # the first pair's top candidate, then excluded from its query
    apart = retrieve_and_rerank(pairs, ranking, 4, 3, exclude=[(POOL[top],), ()])
    deeper = retrieve_and_rerank(pairs, ranking, len(POOL), 3).candidates[0].ids.tolist()
    assert apart.candidates[0].ids.tolist() == [i for i in deeper if keys[i] != keys[top]][:4]
    assert apart.candidates[1].ids.tolist() == got.candidates[1].ids.tolist()  # the other pair as it was


def test_conversation_others_are_the_rest_of_a_pairs_conversation_in_its_split():
    split = [
        Pair(("hi",), "hello there", "c1"),
        Pair(("hi", "hello there"), "how are you ?", "c1"),
        Pair(("hi", "hello there", "how are you ?"), "Fine,  THANKS", "c1"),
        Pair(("hello there", "how are you ?", "fine, thanks"), "Hello There", "c1"),  # said again
        Pair(("yo",), "sup", "c2"),
        Pair(("hm",), "ok", ""),  # no conversation id: nothing to exclude
    ]
    # neither the gold (in any spelling) nor the context's own turns, each other line once
    assert conversation_others(split[:2], split) == [("how are you ?", "Fine,  THANKS"), ("Fine,  THANKS",)]
    assert conversation_others(split[3:], split) == [("hi",), (), ()]
    assert conversation_others(split[4:5], split[:4]) == [()]  # its conversation is not in the split


def test_protocol_b_without_the_conversation_excludes_its_other_lines(tiny_core, toy_pairs):
    from dataclasses import replace

    from evaluation.run import EvalSpec, run_eval
    from evaluation.tables import render_markdown

    # one conversation per round; each test context asks a topic's question, its gold is the next
    # topic's answer, and the asked topic's answer (which the model ranks first) is a line of its round
    lines = [replace(p, conversation_id=p.conversation_id.split("-")[1]) for p in toy_pairs[:16]]
    test = [replace(p, response=q.response) for p, q in zip(lines, lines[1:] + lines[:1], strict=True)]
    spec = EvalSpec(
        name="whole",
        bi=str(tiny_core / "bi"),
        cross=None,
        test=test,
        valid=[],
        pool=toy_pool(),
        negatives=toy_pool(),
        protocols=("B",),
        n_r=(4,),
        judge=None,
    )
    whole = run_eval(spec)
    apart = run_eval(replace(spec, name="apart", exclude=conversation_others(test, lines)))
    # the 7 other topics' questions and answers of its round
    assert whole["meta"]["excluded_per_case"] is None and apart["meta"]["excluded_per_case"] == 14.0
    before, after = whole["B"][0]["ranks"], apart["B"][0]["ranks"]  # retrieval order: golds only move up
    assert all(a <= b for a, b in zip(after, before, strict=True))
    assert max(after) <= 5 < max(before)  # only the pool's four lines of no conversation are left to beat
    assert "less each case's other conversation lines" in render_markdown([apart])
    with pytest.raises(ValueError, match="report them apart"):
        render_markdown([whole, apart])
    assert "Protocol B (full pool)" in render_markdown([whole, {**apart, "B": []}])  # no B rows: no clash


def test_a_guard_that_leaves_contexts_no_candidate_is_said(tiny_core, toy_pairs, monkeypatch, caplog):
    from coreply import restatement
    from evaluation.run import EvalSpec, run_eval

    spec = EvalSpec(
        name="g",
        bi=str(tiny_core / "bi"),
        cross=None,
        test=list(toy_pairs[:6]),
        valid=[],
        pool=toy_pool(),
        negatives=toy_pool(),
        protocols=("B",),
        judge=None,
        guard_pairs=list(toy_pairs[6:20]),
    )
    caplog.set_level("WARNING")
    run_eval(spec)
    assert "no candidate" not in caplog.text  # the guard as calibrated leaves these contexts candidates
    everything = restatement.Guard(last=-2.0, earlier=-2.0)  # every cosine is at least -2: all restate
    monkeypatch.setattr(restatement.Guard, "of", classmethod(lambda cls, entry: everything))
    guarded = run_eval(spec)["B"][1]
    assert guarded["system"].endswith("+ guard") and guarded["metrics"]["hits@50"] == 0
    assert "the restatement guard left 6 of 6 test contexts no candidate" in caplog.text


def test_restatement_judge_flags_answers_that_repeat_the_last_turn(tiny_model_dir):
    from evaluation.restatement import RestatementJudge

    torch.manual_seed(0)
    judge = RestatementJudge(BiEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir))), 0.99)
    contexts = [("hello", "what is your favorite food ?"), ("do you have a pet ?",), ("how are you ?",)]
    answers = ["what is your favorite food ?", "yes i have a dog and a cat", None]
    sims = judge.similarity(contexts[:2], answers[:2])
    assert sims[0] == pytest.approx(1.0, abs=1e-5) and sims[1] < 0.99
    assert judge.flags(contexts, answers).tolist() == [1.0, 0.0, 0.0]  # no answer: not a restatement
    assert judge.rate(contexts, answers) == pytest.approx(100 / 3)
    with pytest.raises(ValueError, match="threshold"):
        RestatementJudge(judge.judge, 0.0)


def test_words_rate_counts_answers_that_share_most_of_the_last_turns_words():
    from evaluation.restatement import words_rate

    contexts = [("hi", "i just got a new puppy!"), ("what do you do for a living?",), ("hello",)]
    # a restatement (3 shared words of 4 and 6: F1 0.6, the threshold), a reply (F1 0.14), no answer
    answers = ["yep a new puppy!", "i teach math at a high school", None]
    assert words_rate(contexts, answers) == pytest.approx(33.33)
    assert words_rate(contexts[:1], ["a reply about cats"]) == 0.0


def test_ranked_ids_order_the_answers_like_ranks_for():
    from evaluation.protocols import ranked_ids

    candidates = Candidates(np.array([0, 1, 2]), np.array([3.0, 2.0, 1.0]), np.array([0.0, 0.0, 5.0]))
    got = Retrieved([candidates], retrieve_s=0.0, rerank_s=0.0)
    assert ranked_ids(got, "retrieval", 3)[0].tolist() == [0, 1, 2]
    assert ranked_ids(got, "rerank", 3)[0].tolist() == [2, 0, 1]
    assert ranked_ids(got, "rerank", 2)[0].tolist() == [0, 1]


def test_report_keeps_two_recipes_with_one_label_apart_and_one_shared_baseline_once():
    from evaluation.metrics import summarize
    from evaluation.tables import render_markdown

    def result(name, ranks):
        rows = [
            {"system": "Bi-Enc", "metrics": summarize(ranks), "ranks": ranks},
            {"system": "BM25", "metrics": summarize([2.0, 2.0]), "ranks": [2.0, 2.0]},
        ]
        meta = dict(name=name, date="2026-11-23", machine="cpu", test_pairs=2, pool_size=9)
        meta |= dict(candidates_protocol_a=4, valid_pairs_for_calibration=0)
        return {"meta": meta, "A": rows}

    text = render_markdown([result("shared", [1.0, 3.0]), result("separate", [1.0, 1.0])])
    assert "| Bi-Enc |" in text and "| Bi-Enc [separate] |" in text
    assert text.count("| BM25 |") == 1


def test_report_against_a_run_tests_every_other_runs_rows_against_its_row_of_the_same_role():
    from evaluation.metrics import paired_bootstrap, per_case, summarize
    from evaluation.tables import render_markdown

    def result(name, bi, guarded):  # each run's retriever named by its recipe, as eval labels it
        model = {"new": "Bi-Enc (hard)", "old": "Bi-Enc (CORE)"}[name]
        rows = [
            {"system": model, "metrics": summarize(bi), "ranks": bi},
            {"system": f"{model} + guard", "metrics": summarize(guarded), "ranks": guarded},
        ]
        meta = dict(name=name, date="2026-11-24", machine="cpu", test_pairs=4, pool_size=9)
        meta |= dict(candidates_protocol_a=4, valid_pairs_for_calibration=0)
        return {"meta": meta, "B": rows}

    new_bi, old_bi = [1.0, 1.0, 1.0, 2.0], [1.0, 2.0, 3.0, 2.0]
    new_guarded, old_guarded = [1.0] * 4, [2.0] * 4
    text = render_markdown(
        [result("new", new_bi, new_guarded), result("old", old_bi, old_guarded)], against="old"
    )
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| Bi-Enc")}
    p_bi = paired_bootstrap(per_case(new_bi, "hits@1"), per_case(old_bi, "hits@1"))
    p_guarded = paired_bootstrap(per_case(new_guarded, "hits@1"), per_case(old_guarded, "hits@1"))
    assert rows["| Bi-Enc (hard)"].endswith(f"| {p_bi:.3f} |") and p_bi < 0.2
    assert rows["| Bi-Enc (hard) + guard"].endswith(f"| {p_guarded:.3f} |") and p_guarded < 0.001
    assert rows["| Bi-Enc (CORE)"].endswith("|  |") and rows["| Bi-Enc (CORE) + guard"].endswith("|  |")
    assert "against the row of **old** that measures the same thing" in text
