import pytest

from coreply.corpus import build_pool, chitchat_turns, load_chitchat, pairs_from_turns, responses_of, split_of
from coreply.text import normalize, says_nothing, variant_key


def msg(sender: str, text: str) -> dict:
    return {"sender": sender, "text": text}


def test_turns_merge_consecutive_messages_of_one_sender_and_drop_empty_turns():
    conversation = {
        "messages": [
            [msg("a", "hi"), msg("a", "there")],
            [msg("a", "again")],  # same sender in the next group: still the same turn
            [msg("b", "  ")],  # empty turn, dropped
            [msg("a", "you?")],
            [msg("b", "fine")],
        ]
    }
    # After dropping b's empty turn, a's two turns stay separate: merging is of consecutive messages only.
    assert chitchat_turns(conversation) == ["hi there again", "you?", "fine"]


def test_pairs_use_at_most_max_turns_previous_turns():
    turns = ["t0", "t1", "t2", "t3"]
    pairs = pairs_from_turns(turns, "c", max_turns=2)
    assert [(p.context, p.response) for p in pairs] == [
        (("t0",), "t1"),
        (("t0", "t1"), "t2"),
        (("t1", "t2"), "t3"),
    ]


def test_split_is_a_stable_function_of_the_conversation_id():
    assert split_of("a07edb12-6b91-4138-b11e-02421888d699") == split_of(
        "a07edb12-6b91-4138-b11e-02421888d699"
    )
    counts = {"train": 0, "valid": 0, "test": 0}
    for i in range(2000):
        counts[split_of(f"conv-{i}")] += 1
    assert 0.03 < counts["test"] / 2000 < 0.07 and 0.03 < counts["valid"] / 2000 < 0.07


def test_chitchat_split_counts_match_the_specification():
    splits = load_chitchat(max_turns=5)
    assert {k: len(v) for k, v in splits.items()} == {"train": 118_111, "valid": 6_623, "test": 6_823}
    conversations = {name: {p.conversation_id for p in pairs} for name, pairs in splits.items()}
    assert not conversations["train"] & conversations["test"]
    assert not conversations["valid"] & conversations["test"]
    assert max(len(p.context) for p in splits["train"]) == 5
    pool = build_pool(responses_of(splits))
    assert len({normalize(t) for t in pool}) == len(pool)
    assert 100_000 < len(pool) < 131_557


def test_pool_deduplicates_by_normalised_text_and_keeps_first_spelling_in_order():
    assert build_pool(["Hi  there", "hi there", "Yes", "", "  ", "yes", "No"]) == ["Hi  there", "Yes", "No"]


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("Hey!", "heyyy", True),
        ("HEY", "hey .", True),
        ("What's up?", "whats up", True),
        ("Nice", "niceee!!", True),
        ("10", "110", False),  # digits are not held letters
        ("what up", "whats up", False),
        (":)", ":(", False),  # no letters: the texts themselves
        (":)", " :) ", True),
        ("Café!", "CAFÉ", True),
    ],
)
def test_spelling_variants_share_a_key_and_other_answers_do_not(a, b, same):
    assert (variant_key(a) == variant_key(b)) is same


@pytest.mark.parametrize(
    ("text", "empty"),
    [("...", True), ("?", True), ("! ? …", True), ("", True), (":)", False), ("?!a", False), ("1.", False)],
)
def test_a_reply_of_nothing_but_the_marks_that_end_a_sentence_says_nothing(text, empty):
    assert says_nothing(text) is empty
