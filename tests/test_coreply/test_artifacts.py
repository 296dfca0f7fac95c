import json

from coreply.artifacts import write_json_atomic


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
