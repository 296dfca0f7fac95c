"""The response prior: neighbourhoods, the own-conversation mask, rescoring and the weight's choice."""

import numpy as np
import pytest

from coreply.corpus import Pair
from coreply.prior import Prior, choose_alpha, neighbourhood, own_conversations, reference_sample


def test_neighbourhood_is_the_mean_of_the_k_best_scores_outside_the_mask():
    responses = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=np.float32)  # [3, 2]
    contexts = np.array([[3.0, 0.0], [2.0, 1.0], [0.0, 1.0], [1.0, 0.0]], dtype=np.float32)  # [4, 2]
    # scores: r0 3 2 0 1 | r1 0 1 1 0 | r2 3 3 1 1
    np.testing.assert_allclose(neighbourhood(responses, contexts, k=2), [2.5, 1.0, 3.0])
    masked = neighbourhood(responses, contexts, k=2, masked={0: [0], 2: [0, 1, 2, 3]})
    # r0 without context 0: 2 and 1; r2 masked against everything: the median of the others
    np.testing.assert_allclose(masked, [1.5, 1.0, 1.25])
    # masked against all but one context: that one's score, not a mean with -inf
    np.testing.assert_allclose(neighbourhood(responses, contexts, k=2, masked={0: [0, 1, 2]})[0], 1.0)
    with pytest.raises(ValueError, match="at least one reference context"):
        neighbourhood(responses, contexts[:0])


def test_own_conversations_mask_every_text_of_the_reference_pairs_dialogues():
    keys = ["hi", "how are you", "fine thanks", "great", "elsewhere"]
    everything = [
        Pair(("hi",), "how are you", "a"),
        Pair(("hi", "how are you"), "fine thanks", "a"),
        Pair(("great",), "elsewhere", "b"),
        Pair(("Fine  thanks",), "great", ""),  # no conversation id: its own texts only
    ]
    reference = [everything[1], everything[3]]  # columns 0 and 1
    masked = own_conversations(keys, reference, everything)
    # column 0 is conversation "a" (hi, how are you, fine thanks), wherever those texts occur
    assert masked == {0: [0], 1: [0], 2: [0, 1], 3: [1]}


def test_rescore_subtracts_the_weighted_prior_and_keeps_missing_hits_last():
    prior = Prior(1.0, np.array([0.0, 5.0, 1.0, 0.0], dtype=np.float32))
    scores = np.array([[10.0, 9.0, 8.0, 0.0]])  # [1, 4]
    ids = np.array([[1, 2, 3, -1]])
    adjusted, order = prior.rescore(scores, ids, 3)
    np.testing.assert_array_equal(order, [[2, 3, 1]])  # 8.0, 8.0 (stable), 5.0
    np.testing.assert_allclose(adjusted, [[8.0, 8.0, 5.0]])
    _, same = Prior(0.0, prior.values).rescore(scores, ids, 4)
    np.testing.assert_array_equal(same, [[1, 2, 3, -1]])


def test_the_weight_is_the_first_with_the_best_hits_at_1():
    values = np.array([4.0, 0.0, 0.0], dtype=np.float32)  # response 0 is a hub
    scores = np.array([[10.0, 9.0], [10.0, 9.5]])
    ids = np.array([[0, 1], [0, 2]])
    alpha, hits = choose_alpha(values, scores, ids, np.array([1, 2]), alphas=(0.0, 0.1, 0.5, 1.0))
    # alpha 0.1 moves nothing (10 - 0.4 > 9.5); 0.5 puts both golds first, 1.0 too: the first wins
    assert hits == {"0": 0.0, "0.1": 0.0, "0.5": 100.0, "1": 100.0} and alpha == 0.5
    alpha, hits = choose_alpha(values, scores, ids, np.array([0, 0]), alphas=(0.0, 1.0))
    assert alpha == 0.0 and hits == {"0": 100.0, "1": 0.0}


def test_reference_sample_is_seeded_and_capped():
    pairs = [Pair((str(i),), "r", str(i)) for i in range(50)]
    assert reference_sample(pairs, size=100) == pairs
    assert reference_sample(pairs, size=10) == reference_sample(pairs, size=10)
    assert len({p.conversation_id for p in reference_sample(pairs, size=10)}) == 10
