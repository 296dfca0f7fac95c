import pytest

from coreply.config import ModelConfig
from coreply.models import load_pretrained


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    return load_pretrained(str(tiny_model_dir))[1]


def make(hf_tokenizer, **kw):
    from coreply.tokenization import DialogueTokenizer

    return DialogueTokenizer(hf_tokenizer, ModelConfig(**kw))


def words(tok, ids):
    return tok.hf.convert_ids_to_tokens(ids)


def test_context_is_cut_from_the_front_keeping_the_latest_tokens(hf_tokenizer):
    tok = make(hf_tokenizer, max_context_tokens=6)
    batch = tok.contexts([["hello hi hey", "good fine great"]])
    # body "hello hi hey [SEP] good fine great" keeps its last 4 tokens
    assert words(tok, batch.input_ids[0].tolist()) == ["[CLS]", "[SEP]", "good", "fine", "great", "[SEP]"]


def test_response_is_cut_at_the_end_keeping_the_first_tokens(hf_tokenizer):
    tok = make(hf_tokenizer, max_response_tokens=4)
    batch = tok.responses(["hello hi hey good"])
    assert words(tok, batch.input_ids[0].tolist()) == ["[CLS]", "hello", "hi", "[SEP]"]


def test_only_the_last_max_turns_utterances_are_used(hf_tokenizer):
    tok = make(hf_tokenizer, max_turns=2)
    batch = tok.contexts([["hello", "hi", "hey"]])
    assert words(tok, batch.input_ids[0].tolist()) == ["[CLS]", "hi", "[SEP]", "hey", "[SEP]"]


def test_pairs_join_context_and_response_with_segments_and_both_cuts(hf_tokenizer):
    tok = make(hf_tokenizer, max_context_tokens=4, max_response_tokens=4)
    batch = tok.pairs([["hello hi hey"], ["good"]], ["yes no maybe sure", "okay"])
    first = words(tok, batch.input_ids[0].tolist())
    assert first == ["[CLS]", "hi", "hey", "[SEP]", "yes", "no", "[SEP]"]
    assert batch.token_type_ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert len(first) <= 4 + 4 - 1
    # the shorter row is padded and masked
    second = batch.input_ids[1].tolist()
    assert words(tok, second[:4]) == ["[CLS]", "good", "[SEP]", "okay"]
    assert batch.attention_mask[1].tolist() == [1, 1, 1, 1, 1, 0, 0]


def test_pairs_need_equal_lengths(hf_tokenizer):
    with pytest.raises(ValueError, match="as many contexts"):
        make(hf_tokenizer).pairs([["a"]], ["b", "c"])
