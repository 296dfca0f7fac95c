import numpy as np
import pytest

from evaluation.metrics import gold_rank, paired_bootstrap, per_case, summarize


def test_gold_rank_counts_ties_against_the_gold():
    assert gold_rank(np.array([0.9, 0.1, 0.5])) == 1
    assert gold_rank(np.array([0.5, 0.9, 0.5])) == 3
    assert gold_rank(np.zeros(100)) == 100


def test_summarize_hand_computed():
    m = summarize([1, 2, 4, float("inf")], ks=(1, 2, 5))
    assert m == {
        "hits@1": 25.0,
        "hits@2": 50.0,
        "hits@5": 75.0,
        "mrr": pytest.approx(100 * (1 + 0.5 + 0.25) / 4),
        "n": 4,
    }
    assert list(per_case([1, 3], "hits@2")) == [1.0, 0.0]
    assert list(per_case([1, 4], "mrr")) == [1.0, 0.25]


def test_paired_bootstrap_separates_better_from_worse():
    rng = np.random.default_rng(0)
    base = (rng.random(400) < 0.3).astype(float)
    better = np.maximum(base, (rng.random(400) < 0.3).astype(float))
    assert paired_bootstrap(better, base) < 0.01
    assert paired_bootstrap(base, better) > 0.99
    with pytest.raises(ValueError):
        paired_bootstrap(base, better[:10])
