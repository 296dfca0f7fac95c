import pytest
import torch

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


def test_assembled_pairs_equal_what_the_tokenizer_itself_produces(hf_tokenizer):
    """Inputs assembled from cached ids are the Hugging Face tokenizer's own encoding of the same pair."""
    tok = make(hf_tokenizer)
    contexts = [["hello how are you", "good thanks"], ["what is your name"]]
    responses = ["i like pizza", "my name is sam and i love music"]
    tok.warm([t for c in contexts for t in c] + responses)
    batch = tok.pairs(contexts, responses)
    for i, (context, response) in enumerate(zip(contexts, responses, strict=True)):
        want = hf_tokenizer(" [SEP] ".join(context), response, return_token_type_ids=True)
        n = len(want["input_ids"])
        assert batch.input_ids[i, :n].tolist() == want["input_ids"]
        assert batch.token_type_ids[i, :n].tolist() == want["token_type_ids"]
        assert batch.attention_mask[i].sum() == n


def test_warm_texts_never_reach_the_tokenizer_again(hf_tokenizer, monkeypatch):
    tok = make(hf_tokenizer)
    assert tok.warm(["hello hi", "good fine", "hello hi"]) == 2
    cold = tok.contexts([["hello hi", "good fine"]])

    def refuse(texts):
        raise AssertionError(f"tokenised again: {texts}")

    monkeypatch.setattr(tok, "_tokenize", lambda texts: refuse(texts) if texts else [])
    assert torch.equal(tok.contexts([["hello hi", "good fine"]]).input_ids, cold.input_ids)
    monkeypatch.undo()
    tok.pieces(["weather"])  # a miss is tokenised but not kept: serving cannot grow the cache
    assert tok.cached == 2


def test_token_budget_chunks_cover_every_row_once_within_the_budget():
    import numpy as np

    from coreply.tokenization import token_budget_chunks

    lengths = [5, 40, 7, 12, 40, 3, 90, 8]
    chunks = token_budget_chunks(lengths, 64)
    assert sorted(np.concatenate(chunks).tolist()) == list(range(len(lengths)))
    for chunk in chunks:
        assert len(chunk) == 1 or len(chunk) * max(lengths[i] for i in chunk) <= 64
    assert [lengths[i] for i in np.concatenate(chunks)] == sorted(lengths)


def test_tokenizers_of_the_same_vocabulary_share_one_cache(hf_tokenizer):
    a, b = make(hf_tokenizer), make(hf_tokenizer, max_context_tokens=8)
    a.warm(["hello hi"])
    assert b.share_cache(a) and b.cached == 1
    b.warm(["good fine"])
    assert a.cached == 2  # one cache, filled once for both
