import gzip
import json

import pytest

from coreply.artifacts import read_json, write_json_atomic


def test_json_is_what_json_reads_back_with_lists_of_scalars_on_one_line(tmp_path):
    data = {
        "B": [{"system": "bi", "ranks": [3, 1, 17], "restates": [False, True, False]}],
        "meta": {"n_r": [5, 10], "pool": None, "empty": {}, "none": []},
        "nested": [[1, 2], [3]],
        "score": 0.5,
    }
    path = tmp_path / "eval.json"
    write_json_atomic(path, data)
    text = path.read_text()
    assert json.loads(text) == data
    assert '"ranks": [3, 1, 17],' in text and '"n_r": [5, 10],' in text
    assert '"B": [\n    {\n      "ranks"' in text  # objects stay indented, keys sorted
    assert text.endswith("}\n") and list(tmp_path.iterdir()) == [path]  # no temporary file left
    write_json_atomic(path, {"rows": {"fp32": 1, "int8": 2, "bf16": 3}}, sort_keys=False)
    assert list(json.loads(path.read_text())["rows"]) == ["fp32", "int8", "bf16"]  # a bench's order kept


def test_a_gz_name_is_written_compressed_and_read_back_and_a_broken_one_is_an_oserror(tmp_path):
    data = {"B": [{"ranks": list(range(1, 2001)) * 3}], "meta": {"name": "x"}}
    plain, packed = tmp_path / "eval.json", tmp_path / "eval.json.gz"
    write_json_atomic(plain, data)
    write_json_atomic(packed, data)
    assert packed.read_bytes()[:2] == b"\x1f\x8b" and packed.stat().st_size < plain.stat().st_size / 4
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()  # the same text inside
    assert read_json(packed) == read_json(str(plain)) == data
    write_json_atomic(tmp_path / "again.json.gz", data)
    assert (tmp_path / "again.json.gz").read_bytes() == packed.read_bytes()  # no timestamp: same bytes
    for broken in (packed.read_bytes()[:-20], plain.read_bytes()):  # cut short; not gzip at all
        (tmp_path / "broken.json.gz").write_bytes(broken)
        with pytest.raises(OSError):
            read_json(tmp_path / "broken.json.gz")
