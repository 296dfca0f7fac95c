"""`coreply train`, `eval` and `report` end to end as a user runs them, on a tiny model and JSONL data."""

import gzip
import json
import subprocess
import sys

import pytest

from coreply.prior import ALPHAS


def coreply(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def test_help_loads_no_model_library():
    """``coreply --help`` and every subcommand's parser stay instant: none imports torch (it took 7 s when
    the ``ground`` parser imported the training module for its defaults)."""
    probe = (
        "import sys; from cli.main import build_parser; build_parser(); "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr


def test_index_info_and_verify_load_no_model_library(tiny_bundle):
    """Reading and checking a bundle needs no model: ``coreply index info`` took 5 s, ``verify`` 5 s on the
    default bundle while importing torch and transformers, 0.4 s and 1.1 s without."""
    probe = (
        "import sys; from cli.main import main; "
        f"assert main(['index', 'info', {str(tiny_bundle)!r}]) == 0; "
        f"assert main(['index', 'verify', {str(tiny_bundle)!r}]) == 0; "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert "ok (version" in loaded.stdout and loaded.stdout.strip().splitlines()[-1] == "[]", loaded.stdout


def test_reports_and_refused_inputs_load_no_model_library(tmp_path):
    """A report merges JSON, and a bad data file, checkpoint, bundle or device name is refused, before
    torch's imports (2-9 s here each, when every command imported its models first)."""
    from evaluation.metrics import summarize

    meta = dict(name="r", date="d", machine="m", test_pairs=1, pool_size=2, candidates_protocol_a=2)
    meta["valid_pairs_for_calibration"] = 0
    row = {"system": "Bi-Enc", "metrics": summarize([1.0]), "ranks": [1.0]}
    (tmp_path / "e.json").write_text(json.dumps({"meta": meta, "B": [row]}))
    (tmp_path / "bad.jsonl").write_text('{"context": ["hi"], "response": ""}\n')
    probe = (
        "import sys; from cli.main import main; "
        "assert main(['report', 'e.json', '--out', 'r.md']) == 0; "
        "assert main(['train', '--data', 'bad.jsonl', '-o', 'run']) == 2; "
        "assert main(['ground', 'train', '--data', 'bad.jsonl', '-o', 'run']) == 2; "
        "assert main(['eval', '--bi', 'gone', '--out', 'x.json']) == 2; "
        "assert main(['serve', '--bundle', 'gone']) == 2; "
        "assert main(['serve', '--bundle', 'gone', '--device', 'gpu']) == 2; "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert loaded.stdout.strip().splitlines()[-1] == "[]", loaded.stdout
    assert loaded.stderr.count("bad.jsonl:1: field 'response'") == 2, loaded.stderr
    assert "gone: not a coreply checkpoint" in loaded.stderr, loaded.stderr
    assert "no bundle at gone" in loaded.stderr, loaded.stderr
    assert "--device / COREPLY_DEVICE: device 'gpu' is not one of" in loaded.stderr, loaded.stderr


@pytest.fixture(scope="module")
def data_file(tmp_path_factory, toy_pairs):
    path = tmp_path_factory.mktemp("data") / "toy.jsonl"
    path.write_text(
        "".join(json.dumps({"context": list(p.context), "response": p.response}) + "\n" for p in toy_pairs)
    )
    return path


def test_builtin_names_the_shipped_models_wherever_a_trained_one_is_taken(tmp_path):
    """``builtin`` is the default bundle's retriever or reranker (the flag says which) for every flag that
    takes a trained checkpoint, so a team can serve, evaluate or fine-tune them without finding where pip
    put them; any other value passes through as a path."""
    from cli.main import build_parser
    from coreply.checkpoint_meta import read_meta
    from coreply.config import BUILTIN_WEIGHTS, ZERO_SHOT

    bi, cross = str(BUILTIN_WEIGHTS["bi"]), str(BUILTIN_WEIGHTS["cross"])
    parse = build_parser().parse_args
    out = ["-o", str(tmp_path / "b")]
    built = parse(["index", "build", *out, "--bi", "builtin", "--cross", "builtin"])
    assert (built.bi, built.cross) == (bi, cross)
    assert parse(["index", "build", *out]).bi == ZERO_SHOT
    assert parse(["index", "build", *out, "--bi", "runs/x/bi"]).bi == "runs/x/bi"
    evaluated = parse(
        ["eval", "--bi", "builtin", "--cross", "builtin", "--judge", "builtin", "--out", "e.json"]
    )
    assert (evaluated.bi, evaluated.cross, evaluated.judge) == (bi, cross, bi)
    assert parse(["eval", "--bi", "zero-shot", "--out", "e.json"]).judge == ZERO_SHOT
    trained = parse(
        ["train", *out, "--init-bi", "builtin", "--init-cross", "builtin", "--teacher", "builtin"]
    )
    assert (trained.init_bi, trained.init_cross, trained.teacher) == (bi, cross, cross)
    assert [read_meta(path, verify=False)["kind"] for path in (bi, cross)] == ["bi", "cross"]


def test_train_eval_report_end_to_end(tmp_path, tiny_model_dir, data_file):
    run = tmp_path / "run"
    trained = coreply(
        "train",
        "--mode",
        "core",
        "--data",
        str(data_file),
        "--valid-data",
        str(data_file),
        "--base-model",
        str(tiny_model_dir),
        "-o",
        str(run),
        "--max-steps",
        "3",
        "--eval-every",
        "3",
        "--num-negatives",
        "3",
        "--batch-size",
        "4",
        "--valid-size",
        "8",
        "--valid-candidates",
        "4",
        "--device",
        "cpu",
        "--max-minutes",
        "30",  # does not bind: the steps do
    )
    assert trained.returncode == 0, trained.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["mode"] == "core"
    assert summary["planned_steps"] == 3 and summary["max_minutes"] == 30 and summary["elapsed_seconds"] > 0
    assert {"bi", "cross", "state"} <= {p.name for p in run.iterdir()}
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= 3

    out = tmp_path / "eval.json"
    evaluated = coreply(
        "eval",
        "--bi",
        str(run / "bi"),
        "--cross",
        str(run / "cross"),
        "--data",
        str(data_file),
        "--limit",
        "10",
        "--candidates",
        "5",
        "--retriever",
        "bm25",
        "bi",
        "--n-r",
        "2",
        "4",
        "--device",
        "cpu",
        "--judge",
        str(run / "bi"),
        "--valid-data",
        str(data_file),
        "--restatement-quantile",
        "0.9",
        "--prior-pairs",
        str(data_file),
        "--out",
        str(out),
    )
    assert evaluated.returncode == 0, evaluated.stderr
    result = json.loads(out.read_text())
    assert {r["system"] for r in result["A"]} == {
        "Bi-Enc (CORE)",
        "Cross-Enc (CORE)",
        "Bi-Enc (CORE) + Cross-Enc (CORE) (sum)",
    }
    systems = {(r["system"], r.get("n_r")) for r in result["B"]}
    assert ("BM25", None) in systems and ("Bi-Enc (CORE)", None) in systems
    # the dense recall again through the restatement guard and the response prior a bundle serves; the
    # reranker reads that one
    assert ("Bi-Enc (CORE) + guard", None) in systems and ("Bi-Enc (CORE) + guard + prior", None) in systems
    assert ("Bi-Enc (CORE) + guard + prior → Cross-Enc (CORE) [sum]", 4) in systems
    assert result["restatement"]["guard"]["quantile"] == 0.9
    assert result["prior"]["alpha"] in ALPHAS and result["prior"]["reference_contexts"] == 48
    assert all(r["metrics"]["n"] == 10 for r in result["A"] + result["B"])
    # protocol A negatives come from the whole split, not only the evaluated (limited) pairs
    assert result["meta"]["protocol_a_negative_pool"] == 48 and result["meta"]["test_pairs"] == 10
    assert "Bi-Enc (CORE)" in evaluated.stdout
    # every row says how often its answer restates the last turn; the gold replies are the reference
    assert all(0 <= r["restates"] <= 100 for r in result["A"] + result["B"])
    assert result["restatement"]["threshold"] == 0.8 and 0 <= result["restatement"]["gold"] <= 100

    md = tmp_path / "results.md"
    reported = coreply(
        "report",
        str(out),
        "--runs",
        str(run / "summary.json"),
        "--out",
        str(md),
        "--plot",
        str(tmp_path / "nr.png"),
        "--curves",
        str(tmp_path / "curves.png"),
    )
    assert reported.returncode == 0, reported.stderr
    text = md.read_text()
    assert "### Protocol A" in text and "### Protocol B" in text and "| run |" in text
    assert "restates %" in text and "the human (gold) replies do so in" in text
    assert "+ guard: protocol B recall without the candidates" in text
    assert "+ prior: recall rescored by the response prior a bundle serves" in text
    assert f"{out.stem}: alpha {result['prior']['alpha']:g} (" in text
    assert f"| {run.name} | 3 of 3 (30 min) |" in text  # the run's steps and its time budget
    assert (tmp_path / "nr.png").stat().st_size > 1000
    assert (tmp_path / "curves.png").stat().st_size > 1000
    packed, md_packed = tmp_path / "eval.json.gz", tmp_path / "results-packed.md"
    packed.write_bytes(gzip.compress(out.read_bytes()))  # how docs/ keeps raw results
    again = coreply("report", str(packed), "--runs", str(run / "summary.json"), "--out", str(md_packed))
    assert again.returncode == 0, again.stderr
    assert md_packed.read_text() == text
    wrong = coreply("report", str(out), "--out", str(md), "--against", "nobody")
    assert wrong.returncode == 2 and "--against 'nobody' names none of the inputs' runs" in wrong.stderr


def test_user_errors_are_one_line_messages_with_exit_code_2(tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": ["hi"], "response": ""}\n')
    result = coreply(
        "train", "--data", str(bad), "-o", str(tmp_path / "r"), "--base-model", str(tiny_model_dir)
    )
    assert result.returncode == 2
    assert "bad.jsonl:1: field 'response'" in result.stderr and "Traceback" not in result.stderr

    result = coreply(
        "eval", "--bi", str(tmp_path / "missing"), "--out", str(tmp_path / "e.json"), "--data", str(bad)
    )
    assert result.returncode == 2 and "not a coreply checkpoint" in result.stderr

    result = coreply("train", "--mode", "distill", "-o", str(tmp_path / "r"), "--data", str(bad))
    assert result.returncode == 2 and "needs --teacher" in result.stderr

    result = coreply("serve", "--bundle", str(tmp_path / "missing"))
    assert result.returncode == 2 and "no bundle at" in result.stderr

    result = coreply("serve", "--bundle", str(tmp_path), "--port", "70000")  # a setting out of range
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "COREPLY_PORT: Input should be less than or equal to 65535" in result.stderr

    result = coreply("index", "verify", str(tmp_path))
    assert result.returncode == 2 and "not a coreply bundle" in result.stderr

    result = coreply("train", "-o", "/dev/null/run", "--max-steps", "1")  # a folder that cannot be made
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--output-dir/-o: /dev/null/run cannot be made: /dev/null is not a folder" in result.stderr


def test_index_build_add_verify(tmp_path, tiny_core):
    pool = tmp_path / "pool.txt"
    pool.write_text("i love pizza\nyes i have a dog\nI love  pizza\n")
    out = tmp_path / "bundle"
    built = coreply(
        "index", "build", "-o", str(out), "--bi", str(tiny_core / "bi"), "--pool", str(pool), "--onnx", "none"
    )
    assert built.returncode == 0, built.stderr
    assert "2 responses" in built.stdout and "1 of the pool's 3 texts were blank or repeats" in built.stdout
    assert "no --queries pairs to calibrate on: the bundle has no restatement guard" in built.stdout
    more = tmp_path / "more.jsonl"
    more.write_text('{"text": "see you soon"}\n')
    added = coreply("index", "add", str(out), str(more))
    assert added.returncode == 0 and "3 responses: 1 added, 0 skipped" in added.stdout, added.stderr
    assert "ok (version" in coreply("index", "verify", str(out)).stdout
    gone = coreply("index", "withdraw", str(out), "--ids", "0", "--texts", str(more))
    assert gone.returncode == 0 and "2 withdrawn; 2 of 3 responses withdrawn" in gone.stdout, gone.stderr
    assert "2 withdrawn)" in coreply("index", "info", str(out)).stdout
    listed = coreply("index", "info", str(out), "--withdrawn").stdout
    assert [json.loads(line) for line in listed.splitlines()] == [
        {"id": 0, "text": "i love pizza"},
        {"id": 2, "text": "see you soon"},
    ]
    reader_gone = subprocess.Popen(  # `| head -0`: the pipe is closed before a line is written
        [sys.executable, "-m", "cli", "index", "info", str(out), "--withdrawn"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    reader_gone.stdout.close()
    assert reader_gone.wait(60) == 1 and reader_gone.stderr.read() == b""  # no error, no traceback
    back = coreply("index", "withdraw", str(out), "--texts", str(more), "--restore")
    assert back.returncode == 0 and "1 restored; 1 of 3" in back.stdout, back.stderr
    (tmp_path / "blank.txt").write_text("\n  \n")
    for flags, message in [
        ((), "name the responses with --ids, --texts or --filter"),
        (("--texts", str(tmp_path / "blank.txt")), "blank.txt: no text in it (one per line"),
        (("--ids", "3"), "--ids: 3 is not a response of this bundle (its ids are 0 to 2)"),
        (("--ids", "-1"), "argument --ids: must be >= 0, got -1"),
        (("--texts", str(tmp_path / "nope.txt")), "nope.txt: no such file"),
    ]:
        bad = coreply("index", "withdraw", str(out), *flags)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    (out / "responses.jsonl").write_text("tampered\n")
    result = coreply("index", "verify", str(out))
    assert result.returncode == 2 and "responses.jsonl: corrupted" in result.stderr
    bad = coreply(
        "index",
        "build",
        "-o",
        str(tmp_path / "b2"),
        "--bi",
        str(tiny_core / "bi"),
        "--pool",
        str(pool),
        "--factory",
        "Bogus7",
    )
    assert bad.returncode == 2 and "--factory 'Bogus7'" in bad.stderr and "Traceback" not in bad.stderr
    bad = coreply("index", "build", "-o", str(tmp_path / "b3"), "--restatement-quantile", "abc")
    assert (
        bad.returncode == 2 and "--restatement-quantile: must be 'off' or in [0.5, 1), got abc" in bad.stderr
    )
    bad = coreply("index", "build", "-o", str(tmp_path / "b3"), "--restatement-quantile", "1.5")
    assert (
        bad.returncode == 2 and "--restatement-quantile: must be 'off' or in [0.5, 1), got 1.5" in bad.stderr
    )
