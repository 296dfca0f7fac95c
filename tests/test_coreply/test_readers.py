import json
from pathlib import Path

import pytest

from coreply.readers import DataError, read_jsonl, read_pairs, read_pool

FIXTURES = Path(__file__).parents[1] / "fixtures"


def test_ubuntu_train_csv_keeps_positives_and_splits_turns_and_utterances():
    pairs = read_pairs(FIXTURES / "ubuntu_train.csv")
    assert [(p.context, p.response) for p in pairs] == [
        (("how do i install vim", "apt-get install vim sudo first"), "thanks that worked"),
        (("any idea why x fails",), "check the logs in /var/log"),
    ]


def test_ubuntu_test_csv_carries_distractors_as_negatives():
    (pair,) = read_pairs(FIXTURES / "ubuntu_test.csv")
    assert pair.context == ("wifi is down", "which card")
    assert pair.response == "intel"
    assert pair.negatives == ("no idea", "try reboot")


def test_dstc7_json_merges_same_speaker_messages_and_excludes_the_gold_from_negatives():
    (pair,) = read_pairs(FIXTURES / "dstc7.json")
    assert pair.context == ("hi grub is broken", "which version?")
    assert pair.response == "grub 2"
    assert pair.negatives == ("use lilo", "reinstall")
    assert pair.conversation_id == "42"


def test_jsonl_round_trip(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"context": ["a", "b"], "response": "c"}) + "\n\n")
    (pair,) = read_jsonl(path)
    assert pair.context == ("a", "b") and pair.response == "c" and pair.negatives == ()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"context": "a", "response": "c"}', "d.jsonl:2: field 'context'"),
        ('{"context": ["a"], "response": 3}', "d.jsonl:2: field 'response'"),
        ('{"context": ["a"]', "d.jsonl:2: invalid JSON"),
        ("[1, 2]", "d.jsonl:2: expected a JSON object"),
    ],
)
def test_jsonl_errors_name_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"context": ["ok"], "response": "ok"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message.replace("[", r"\[")):
        read_jsonl(path)


def test_csv_errors_name_line_and_field(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('Context,Utterance,Label\n"q __eou__ __eot__",a __eou__,maybe\n')
    with pytest.raises(DataError, match=r"bad.csv:2: field 'Label'"):
        read_pairs(path)
    path.write_text("Question,Answer\nq,a\n")
    with pytest.raises(DataError, match="missing column 'Context'"):
        read_pairs(path)


def test_dstc7_errors_name_the_example_and_field(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"example-id": 7, "messages-so-far": [], "options-for-correct-answers": []}]))
    with pytest.raises(DataError, match="example 7: field 'messages-so-far'"):
        read_pairs(path)


def test_pool_reader_and_unknown_formats(tmp_path):
    txt = tmp_path / "pool.txt"
    txt.write_text("one\n\ntwo\n")
    assert read_pool(txt) == (["one", "two"], [{}, {}])
    jl = tmp_path / "pool.jsonl"
    jl.write_text('{"text": "one", "id": "faq-1", "intent": "greet"}\n{"text": "two"}\n')
    assert read_pool(jl) == (["one", "two"], [{"id": "faq-1", "intent": "greet"}, {}])
    jl.write_text('{"text": "one"}\n{"txt": "two"}\n')
    with pytest.raises(DataError, match=r"pool.jsonl:2: field 'text'"):
        read_pool(jl)
    with pytest.raises(DataError, match="unknown data format"):
        read_pairs(txt)
    with pytest.raises(DataError, match="no such file"):
        read_pairs(tmp_path / "missing.jsonl")
    for missing in ("missing.jsonl", "missing.txt"):
        with pytest.raises(DataError, match=f"{missing}: no such file"):
            read_pool(tmp_path / missing)
    (tmp_path / "folder.jsonl").mkdir()
    for read in (read_pool, read_pairs):
        with pytest.raises(DataError, match=r"folder\.jsonl: a folder; name a file in it"):
            read(tmp_path / "folder.jsonl")


def test_files_that_are_not_utf8_are_named_not_a_codec_traceback(tmp_path):
    for name in ("pairs.jsonl", "pool.txt"):
        path = tmp_path / name
        path.write_bytes(b'{"context": ["caf\xe9"], "response": "ok"}\n')
        reader = read_pairs if name.endswith(".jsonl") else read_pool
        with pytest.raises(DataError, match=f"{name}: not UTF-8 text"):
            reader(path)
