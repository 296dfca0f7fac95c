"""The benchmark scripts on the tiny models: CPU smoke runs that keep them working (for a GPU lease too)."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from conftest import reseal

from coreply.bundle import SEALING, load_bundle

ROOT = Path(__file__).parents[2]


def load_script(name: str, monkeypatch) -> ModuleType:
    """bench/NAME.py as a module, its helpers in bench/bench.py importable as when it is run."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.delitem(sys.modules, "bench", raising=False)
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench(script: str, *args: str) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return run


def test_serve_profile_times_every_stage_and_lists_operators(tmp_path, tiny_bundle):
    out = tmp_path / "profile.json"
    bench("serve_profile.py", "--bundle", str(tiny_bundle), "--backend", "torch", "--n-r", "3",
          "--batch", "1", "2", "--requests", "4", "--top", "5", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert result["date"] and result["n_r"] == 3 and [r["batch"] for r in result["rows"]] == [1, 2]
    assert result["packed"] is False  # a CPU's PyTorch backend pads (CUDA's packs)
    for row in result["rows"]:
        stages = row["ms_per_batch"]
        assert row["batches"] == 4 // row["batch"] and stages["rerank"] > 0 and stages["encode"] > 0
        assert stages["total"] >= stages["encode"] + stages["search"] + stages["rerank"]
        assert len(row["operators"]) == 5 and all(op["self_host_ms"] >= 0 for op in row["operators"])
        assert any(op["op"].startswith("aten::") for op in row["operators"])


def test_serve_profile_times_the_lexical_stage_and_answers_without_it(tmp_path, lexical_bundle):
    for flags, on in (([], True), (["--no-lexical"], False)):
        out = tmp_path / f"profile-{on}.json"
        bench("serve_profile.py", "--bundle", str(lexical_bundle), "--backend", "torch", "--n-r", "3",
              "--batch", "2", "--requests", "4", "--top", "1", "--out", str(out), *flags)  # fmt: skip
        result = json.loads(out.read_text())
        assert result["lexical"] is on and (result["rows"][0]["ms_per_batch"]["lexical"] > 0) is on


def test_search_kernels_time_each_way_and_check_the_ranking(tmp_path, tiny_bundle):
    out = tmp_path / "kernels.json"
    bench("search_kernels.py", "--pool", "300", "--dim", "16", "--batch", "1", "3", "--k", "10",
          "--rounds", "2", "--cold", "1", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert result["pool"] == [300, 16] and [r["batch"] for r in result["rows"]] == [1, 3]
    assert result["cold_mb"] == 1
    for row in result["rows"]:
        assert row["torch"]["exact_top_k"] == row["float32-slices"]["exact_top_k"] == 1.0
        assert row["served"]["exact_top_k"] == 1.0
        assert row.get("bf16-pass", {"exact_top_k": 1.0})["exact_top_k"] == 1.0  # where bf16 is fast
        assert all(row[name]["ms"] > 0 for name in ("torch", "float32-slices", "served", "torch-fp16"))
    bench("search_kernels.py", "--bundle", str(tiny_bundle), "--batch", "2", "--rounds", "1")


def test_rerank_ops_profiles_the_onnx_reranker(tiny_bundle):
    run = bench(
        "rerank_ops.py", "--bundle", str(tiny_bundle), "--n-r", "3", "--requests", "4", "--rounds", "1"
    )
    table = run.stdout.split("| operator | ms per request | share |")[1]
    assert "rerank ms a request, served" in run.stdout and "rerank ms a request, all fusions" in run.stdout
    assert "of 4 requests" in run.stdout and "MatMul" in table and "SkipLayerNormalization" not in table


def test_openvino_rerank_says_in_one_line_that_openvino_is_missing(monkeypatch, tiny_bundle):
    script = load_script("openvino_rerank", monkeypatch)
    monkeypatch.setitem(sys.modules, "openvino", None)  # an import of it raises ImportError
    monkeypatch.setattr(sys, "argv", ["openvino_rerank.py", "--bundle", str(tiny_bundle)])
    try:
        script.main()
    except SystemExit as exc:
        assert str(exc) == "openvino is not installed: pip install openvino, then run this again"
    else:
        raise AssertionError("ran without openvino")


def test_openvino_rerank_scores_the_served_pairs_in_each_runtime(tmp_path, tiny_bundle):
    pytest.importorskip("openvino", reason="openvino is not a coreply dependency")
    out = tmp_path / "openvino.json"
    bench("openvino_rerank.py", "--bundle", str(tiny_bundle), "--n-r", "3", "--requests", "4",
          "--rounds", "1", "--out", str(out))  # fmt: skip
    results = json.loads(out.read_text())["results"]
    runtimes = {"ONNX Runtime int8 (served)", "OpenVINO fp32, fp32 graph", "OpenVINO, served int8 graph"}
    assert runtimes <= set(results)
    assert all(r["ms_median"] > 0 and r["pearson"] > 0.9 for r in results.values())
    assert results["OpenVINO fp32, fp32 graph"]["max_abs_diff"] < 1e-3  # the model's own function


def test_int8_products_times_each_way_at_a_pair_and_a_packed_request():
    run = bench("int8_products.py", "--hidden", "64", "--ffn", "128", "--tokens", "5", "--pairs", "3",
                "--rounds", "2")  # fmt: skip
    rows = [line.split() for line in run.stdout.splitlines()[2:-1]]  # between the header and the legend
    assert [(r[0], r[2], r[3]) for r in rows] == [
        (k, n, m) for k, n in (("64", "64"), ("64", "128"), ("128", "64")) for m in ("5", "15")
    ]
    for row in rows:  # four cells of (ms, "ms", GMAC/s, "GMAC/s", error): each way computes x @ w
        errors = [float(e) for e in row[8::5]]
        assert errors[0] == 0 and max(errors[1:3]) < 0.05 and errors[3] < 0.3, row


def test_load_sends_a_fixed_rate_and_takes_the_bundles_own_fusion(tmp_path, tiny_bundle):
    out = tmp_path / "load.json"
    bench("load.py", "--bundle", str(tiny_bundle), "--rps", "10", "--seconds", "1", "--fusion", "default",
          "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert result["sent"] in (10, 11) and result["codes"] == {"200": result["sent"]}  # every one answered
    assert result["shed_503"] == 0 and result["admitted_latency_ms"]["p50"] > 0


def test_bench_times_the_server_beside_the_peer_on_the_bundles_trained_weights(tmp_path, tiny_bundle):
    out = tmp_path / "bench.json"
    bench("bench.py", "--bundle", str(tiny_bundle), "--n-r", "3", "--concurrency", "1", "--requests", "4",
          "--threads", "1", "--fusion", "default", "--peer-pool", "own", "--typed-user-turns",
          "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert result["peer_pool"] == "own" and result["peer_pool_encode_s"] is not None  # its own index
    assert result["typed_user_turns"] is True
    (row,) = result["rows"]
    assert row["coreply"]["latency_ms"]["p50"] > 0 and row["peer"]["latency_ms"]["p50"] > 0
    assert set(row["peer"]["stages_ms"]) == {"encode", "search", "rerank"}
    assert set(row["hits@1"]) == {"coreply", "peer"} and 0 <= row["same_top1"] <= 1 and row["p50_speedup"] > 0
    assert 0 < row["p_coreply_better"] <= 1


def test_benches_refuse_bad_flags_in_one_line(tmp_path, tiny_bundle, tiny_core):
    other = tmp_path / "other.json"  # a restatement_guard run on another split: nothing to pair with
    other.write_text(json.dumps({"top1_cases": {}, "meta": {"split": "valid", "pairs": 2000}}))
    retrieval_only = tmp_path / "retrieval-only"  # the tiny bundle as if built without a reranker
    shutil.copytree(tiny_bundle, retrieval_only)
    reseal(retrieval_only, SEALING, lambda manifest: manifest["models"].update(cross=None))
    torch_only = tmp_path / "torch-only"  # the tiny bundle as if built with --onnx none
    shutil.copytree(tiny_bundle, torch_only)
    reseal(torch_only, SEALING, lambda manifest: manifest.update(onnx=None))
    cases = (
        ("bench.py", ["--bundle", str(tmp_path), "--out", str(other)], "--bundle: "),
        ("bench.py", ["--bundle", str(retrieval_only), "--out", str(other)], "--fusion rerank: "),
        (
            "bench.py",
            ["--bundle", str(retrieval_only), "--think-ms", "nan", "--out", str(other)],
            "--think-ms ",
        ),
        ("serve_profile.py", ["--bundle", str(tmp_path)], "--bundle: "),
        ("serve_profile.py", ["--bundle", str(tiny_bundle), "--device", "gpu"], "--device: "),
        ("rerank_ops.py", ["--bundle", str(tiny_bundle), "--n-r", "0"], "--n-r"),
        ("rerank_ops.py", ["--bundle", str(torch_only)], "--bundle: "),
        ("rerank_ops.py", ["--bundle", str(retrieval_only)], f"--bundle {retrieval_only}: needs a reranker"),
        ("quantisation.py", ["--bi", str(tiny_core / "bi"), "--limit", "20", "--pool", "5"], "--pool: "),
        ("restatement_guard.py", ["--bundle", str(tiny_bundle), "--against", str(other)], "--against "),
        (
            "restatement_guard.py",
            ["--bundle", str(tiny_bundle), "--against", str(tmp_path / "no.json")],
            "--against ",
        ),
        ("restatement_guard.py", ["--bundle", str(tiny_bundle), "--fusion", "retrieval"], "--fusion: "),
        ("restatement_guard.py", ["--bundle", str(tiny_bundle), "--backend", "gpu"], "--backend: "),
        ("rerank_precision.py", ["--bundle", str(tmp_path)], "--bundle: "),
        ("rerank_precision.py", ["--variants", "int4"], "--variants: "),
        ("rerank_precision.py", ["--weights", "0.5", "2"], "--weights: "),
        ("rerank_precision.py", ["--keep-fp32", "("], "--keep-fp32: "),
        ("rerank_precision.py", ["--out", str(tmp_path / "no/x.json")], "--out: "),
        ("rerank_precision.py", ["--start", "100000"], "--start 100000: "),
        ("rerank_gate.py", ["--bundle", str(tmp_path)], "--bundle: "),
        ("rerank_gate.py", ["--bundle", str(tiny_bundle), "--fidelity", "1"], "--fidelity: "),
        ("rerank_gate.py", ["--bundle", str(tiny_bundle), "--reach-fidelity", "-0.5"], "--reach-fidelity: "),
        ("rerank_gate.py", ["--bundle", str(tiny_bundle), "--measure", "test:0"], "--measure: "),
        ("rerank_gate.py", ["--bundle", str(tiny_bundle), "--measure", "test:0:8", "test:7:2"], "--measure"),
        (  # the default --calibrate is valid:0:2000
            "rerank_gate.py",
            ["--bundle", str(tiny_bundle), "--measure", "valid:1999:5"],
            "--measure: valid:1999:5 overlaps --calibrate",
        ),
        ("rerank_gate.py", ["--bundle", str(tiny_bundle), "--calibrate", "train:0:5"], "--calibrate: "),
        ("rerank_gate.py", ["--bundle", str(tiny_bundle), "--out", str(tmp_path)], f"--out: {tmp_path} is a"),
        ("rerank_gate.py", ["--bundle", str(tiny_bundle), "--n-r", "10", "0"], "--n-r: "),
        ("rerank_ensemble.py", ["--bundle", str(tmp_path), "--cross", str(tmp_path)], "--bundle: "),
        ("as_served.py", ["--bundles", str(tiny_bundle)], "--bundles: "),
        ("as_served.py", ["--bundles", str(tiny_bundle), str(tiny_bundle)], "--bundles: "),
        ("as_served.py", ["--bundles", str(tiny_bundle), str(tmp_path)], "--bundle: "),
        ("as_served.py", ["--bundles", "a", "b", "--measure", "test:0:8", "test:7:2"], "--measure: test:7"),
        ("as_served.py", ["--bundles", "a", "b", "--threads", "0"], "--threads: "),
        ("as_served.py", ["--bundles", "a", "b", "--pairs", str(other)], f"--pairs: {other}: "),
        ("as_served.py", ["--bundles", "a", "b", "--pairs", "x/p.jsonl", "y/p.jsonl"], "--pairs: two files"),
        (
            "other_corpus.py",
            ["--corpus", str(tmp_path), "--out", str(other)],
            f"--corpus: {tmp_path} holds no",
        ),
        ("prior_served.py", ["--bundle", str(tiny_bundle)], f"--bundle: {tiny_bundle} has no response prior"),
        ("prior_served.py", ["--choose", "valid:0:10", "--measure", "valid:5:10"], "--measure: valid:5:10"),
        ("prior_served.py", ["--alphas", "-1"], "--alphas: "),
        (
            "as_served.py",
            ["--bundles", str(tiny_bundle), str(retrieval_only), "--measure", "test:6800:100"],
            "--measure: test:6800:100 runs past the test split's 6823 pairs",
        ),
        (
            "rerank_gate.py",
            ["--bundle", str(tiny_bundle), "--calibrate", "valid:6600:50", "--measure", "test:0:5"],
            "--calibrate: valid:6600:50 runs past",
        ),
        (
            "rerank_ensemble.py",
            ["--bundle", str(tiny_bundle), "--cross", str(tmp_path)],
            f"--cross {tmp_path}: ",
        ),
        (  # two folders named "cross": their rows would share a name
            "rerank_ensemble.py",
            ["--bundle", str(tiny_bundle), "--cross", str(tiny_core / "cross"), str(tiny_bundle / "cross")],
            f"--cross {tiny_bundle / 'cross'}: another --cross",
        ),
        ("own_turns.py", ["--cross", str(tmp_path)], f"--cross {tmp_path}: "),
        ("filtered.py", ["--bundle", str(tiny_bundle), "--top-k", "5", "--candidates", "3"], "--top-k 5: "),
        ("own_turns.py", ["--cross", *[str(tiny_core / "cross")] * 2], "--cross: "),
        ("guard_rules.py", ["--words", "0.995", "1"], "--words: "),
        ("guard_rules.py", ["--depth", "3"], "--depth"),
        ("guard_rules.py", ["--bundle", str(tmp_path)], "--bundle: "),
        (
            "rerank_precision.py",
            ["--bundle", str(tiny_bundle), "--keep-fp32", "nowhere"],
            "--keep-fp32 nowhere: ",
        ),
        ("retriever_sum.py", ["--bi", str(tmp_path), str(tiny_core / "bi"), "--out", str(other)], "--bi: "),
        ("retriever_sum.py", ["--bi", *[str(tiny_core / "bi")] * 2, "--out", str(other)], "--bi: "),
        ("hybrid_bm25.py", ["--bi", str(tmp_path), "--pool", "80", "--out", str(other)], "--bi: "),
        ("hybrid_bm25.py", ["--weights", "1", "--out", str(other)], "--weights: "),
        ("hybrid_bm25.py", ["--k1", "0", "--out", str(other)], "--k1: "),
        ("hybrid_bm25.py", ["--b", "1.5", "--out", str(other)], "--b: "),
        ("hybrid_bm25.py", ["--guard-quantile", "0.99", "--out", str(other)], "--guard-quantile: "),
        ("hybrid_bm25.py", ["--bundle", str(tiny_bundle), "--pool", "80", "--out", str(other)], "--pool: "),
        ("learned_fusion.py", ["--bundle", str(tiny_bundle), "--out", str(other)], "--bundle: "),
        ("learned_fusion.py", ["--train", "5", "--out", str(other)], "--train: "),
        ("learned_fusion.py", ["--l2", "-1", "--out", str(other)], "--l2: "),
        ("pool_projection.py", ["--bundle", str(tmp_path), "--out", str(other)], "--bundle: "),
        (  # the toy pool holds a few chitchat replies, not 2,000 validation pairs' worth
            "pool_projection.py",
            ["--bundle", str(tiny_bundle), "--out", str(other)],
            "--select: ",
        ),
        ("pool_projection.py", ["--epochs", "0", "--out", str(other)], "--epochs: "),
        ("pool_projection.py", ["--lr", "0", "--out", str(other)], "--lr: "),
        ("context_views.py", ["--views", "1", "0", "--out", str(other)], "--views: "),
        ("context_views.py", ["--grid", "0", "--out", str(other)], "--grid: "),
        ("reply_memory.py", ["--bundle", str(tmp_path), "--out", str(other)], "--bundle: "),
        ("reply_memory.py", ["--tau", "0.05", "0", "--out", str(other)], "--tau: "),
        ("query_feedback.py", ["--bundle", str(tmp_path), "--out", str(other)], "--bundle: "),
        ("query_feedback.py", ["--beta", "-0.2", "0", "--out", str(other)], "--beta: "),
        ("query_feedback.py", ["--k", "0", "--out", str(other)], "--k: "),
        ("query_feedback_served.py", ["--k", "101"], "--k: "),
        ("query_feedback_served.py", ["--beta", "0"], "--beta: "),
        (
            "reply_memory.py",
            ["--bundle", str(tiny_bundle), "--train", "5", "--k", "8", "--out", str(other)],
            "--k: ",
        ),
        ("restatement_guard.py", ["--bundle", str(tmp_path)], "--bundle: "),
        ("batch_effect.py", ["--bundle", str(tmp_path)], "--bundle: "),
        ("search_kernels.py", ["--bundle", str(tmp_path)], "--bundle: "),
        ("search_kernels.py", ["--rounds", "0"], "--rounds "),
        ("int8_products.py", ["--pairs", "0"], "--pairs "),
        ("int8_products.py", ["--hidden", "100"], "--hidden "),
        ("search_kernels.py", ["--batch", "1", "0"], "--batch: "),
        (  # more queries than the test split has contexts
            "search_kernels.py",
            ["--bundle", str(tiny_bundle), "--batch", "64", "--rounds", "200"],
            "--rounds/--batch: ",
        ),
        (
            "retriever_sum.py",
            ["--bi", str(tmp_path), str(tiny_core), "--out", str(tmp_path / "no/x.json")],
            "--out: ",
        ),
        # the scripts that start a server: refused before it starts, not after a 300 s wait for it
        ("fuzz.py", ["--bundle", str(tmp_path), "--out", str(other)], "--bundle: "),
        ("fuzz.py", ["--bundle", str(tiny_bundle), "--cases", "0", "--out", str(other)], "--cases: "),
        ("load.py", ["--bundle", str(tmp_path), "--out", str(other)], "--bundle: "),
        ("load.py", ["--bundle", str(tiny_bundle), "--seconds", "nan", "--out", str(other)], "--seconds: "),
        ("load.py", ["--bundle", str(tiny_bundle), "--rps", "-3", "--out", str(other)], "--rps: "),
        ("soak.py", ["--bundle", str(tiny_bundle), "--out", str(tmp_path)], f"--out: {tmp_path} is a"),
        ("soak.py", ["--bundle", str(tiny_bundle), "--minutes", "0.5", "--out", str(other)], "--minutes "),
        ("index_bench.py", ["--bundle", str(tmp_path), "--out", str(other)], "--bundle: "),
        ("index_bench.py", ["--bundle", str(tiny_bundle), "--out", str(tmp_path / "no/x.json")], "--out: "),
        ("response_prior.py", ["--bundle", str(tmp_path)], "--bundle: "),
        ("response_prior.py", ["--alphas", "nan"], "--alphas: "),
        ("response_prior.py", ["--ks", "10", "0"], "--ks: "),
        ("quality.py", ["--bundle", str(tmp_path)], "--bundle: "),
        ("poly_stage.py", ["--bundle", str(tiny_bundle)], f"--bundle {tiny_bundle}: "),  # cross, not poly
        ("poly_stage.py", ["--bundle", str(tmp_path / "no/poly")], "--bundle: "),
        ("poly_stage.py", ["--pool", "5", "--n-r", "6"], "--n-r: at most --pool (5)"),
        ("poly_stage.py", ["--codes", "16", "0"], "--codes: "),
        ("bench.py", ["--bundle", str(tiny_bundle), "--concurrency", "0", "--out", str(other)], "--n-r, "),
        ("restatement_guard.py", ["--bundle", str(tiny_bundle), "--single", "0"], "--single: "),
        ("restatement_guard.py", ["--bundle", str(tiny_bundle), "--start", "-1"], "--start: "),
        ("restatement_guard.py", ["--bundle", str(tiny_bundle), "--quantiles", "1.5"], "--quantiles: "),
        ("paraphrase_negatives.py", ["--bi", str(tmp_path), "--batches", "0"], "--batches: "),
        ("paraphrase_negatives.py", ["--bi", str(tmp_path), "--paraphrase-negatives", "16"], "--paraphrase-"),
        ("paraphrase_negatives.py", ["--bi", str(tmp_path / "no")], f"paraphrase_negatives.py: {tmp_path}"),
        ("quantisation.py", ["--limit", "0"], "--limit: "),
        ("train_speed.py", ["--out", str(tmp_path / "no/x.json")], "--out: "),
        ("variants.py", ["--bundle", str(tmp_path)], "--bundle: "),
        ("openers.py", ["--bundle", str(tiny_bundle)], f"--bundle {tiny_bundle}: has no restatement guard"),
        ("variants.py", ["--max-turns", "0"], "--max-turns: "),
        ("variants.py", ["--top-k", "5", "--n-candidates", "4"], "--n-candidates: "),
    )

    # each case in a fork of one process that imported torch once (tests/forked_scripts.py): as its own
    # `python bench/...` a case is mostly its imports, about 6 s here
    runs = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "forked_scripts.py")],
        input=json.dumps([[script, args] for script, args, _ in cases]),
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )

    def refused(code: int, err: str, flag: str) -> bool:
        """Refused in one line that starts with the flag."""
        return code != 0 and err.startswith(flag) and len(err.splitlines()) == 1

    failures = [
        f"{script} {args}: exit {code}: {err}"
        for (script, args, flag), (code, err) in zip(cases, json.loads(runs.stdout), strict=True)
        if not refused(code, err, flag)
    ]
    assert not failures, failures
    script, args, flag = cases[0]  # and one as a user runs it: what a fork would hide (import warnings)
    alone = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True
    )
    assert refused(alone.returncode, alone.stderr, flag), alone.stderr


def test_a_server_that_stops_before_it_is_ready_is_said_in_one_line(tmp_path, tiny_bundle):
    """Before, the script waited 300 s for a dead server and ended in a TimeoutError traceback."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "load.py"), "--bundle", str(tiny_bundle), "--out",
         str(tmp_path / "load.json")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COREPLY_MAX_TURNS": "0"},
    )  # fmt: skip
    assert run.returncode != 0 and len(run.stderr.splitlines()) == 1, run.stderr
    assert (
        run.stderr.startswith(f"coreply serve --bundle {tiny_bundle} exited (2): ")
        and "COREPLY_MAX_TURNS" in run.stderr
    )
    assert not (tmp_path / "load.json").exists()


def test_a_soak_whose_server_dies_keeps_its_windows_and_says_so(tmp_path, tiny_bundle):
    """Before, the dead server's missing memory line or a refused connection ended the run in a
    traceback, and the windows measured until then were lost."""
    out = tmp_path / "soak.json"
    soak = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--bundle", str(tiny_bundle), "--minutes", "1",
         "--window-s", "2", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert json.loads(soak.stdout.readline())["requests"] > 0  # the first window: the server answers
        (server,) = _children(soak.pid)
        os.kill(server, signal.SIGKILL)
        _, err = soak.communicate(timeout=60)
    finally:
        soak.kill()
    report = json.loads(out.read_text())
    assert report["server_exit_code"] == -9 and report["windows"][0]["requests"] > 0
    t = report["windows"][-1]["t_s"]
    assert soak.returncode == 1 and err.strip() == f"coreply serve exited (-9) after {t} s; see {out}"


def test_a_benchmark_whose_server_dies_says_so_in_one_line(tmp_path, tiny_bundle):
    """Before, the next request's refused connection ended bench.py in an httpx traceback."""
    out = tmp_path / "bench.json"
    run = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "bench.py"), "--bundle", str(tiny_bundle), "--out", str(out),
         "--fusion", "retrieval", "--n-r", "1", "2", "3", "--concurrency", "1", "--requests", "20",
         "--think-ms", "200"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert json.loads(run.stdout.readline())["n_r"] == 1  # the first cell: the server answers
        (server,) = _children(run.pid)
        os.kill(server, signal.SIGKILL)
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 1 and not out.exists()
    assert err.strip() == f"bench: coreply serve exited (-9) after 1 of 3 cells; {out} not written"


def _children(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(pid):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return found


def test_rerank_gate_chooses_gates_on_one_span_and_scores_them_on_others(tmp_path, tiny_bundle):
    out = tmp_path / "gate.json"
    bench("rerank_gate.py", "--bundle", str(tiny_bundle), "--calibrate", "valid:0:12", "--measure",
          "test:0:8", "test:8:6", "--fidelity", "0", "0.5", "--n-r", "4", "1", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["n_r"]) == {"4", "1"}
    # one candidate reranked is the first stage's answer: nothing to reorder, nothing won or lost
    alone = result["n_r"]["1"]["pooled"]["always rerank"]
    assert (
        alone["hits@1"] == result["n_r"]["1"]["pooled"]["first stage"]
        and alone["wins"] == alone["losses"] == 0
    )
    spans = result["n_r"]["4"]["spans"]
    assert set(spans) == {"valid[0:12]", "test[0:8]", "test[8:14]"}
    assert result["calibrated_on"] == "valid[0:12]"
    calibration = spans["valid[0:12]"]
    assert calibration["always rerank"]["skipped_%"] == 0 == calibration["always rerank"]["changed_%"]
    assert calibration["fidelity 0"]["changed_%"] == 0 and calibration["fidelity 0.5"]["changed_%"] <= 50
    assert calibration["fidelity 0.5"]["skipped_%"] >= calibration["fidelity 0"]["skipped_%"]
    for rows in spans.values():
        gated = [r for r in rows.values() if "gate" in r]
        assert 0 <= rows["first stage"]["hits@1"] <= 100 and all(
            0 <= r["p_always_better"] <= 1 for r in gated
        )
    # the measured spans pooled: every setting's pairs, wins and losses are the spans' together
    pooled, parts = result["n_r"]["4"]["pooled"], [spans["test[0:8]"], spans["test[8:14]"]]
    assert pooled["spans"] == ["test[0:8]", "test[8:14]"] and pooled["pairs"] == 14
    hits = (8 * parts[0]["first stage"]["hits@1"] + 6 * parts[1]["first stage"]["hits@1"]) / 14
    assert abs(pooled["first stage"] - hits) < 0.01
    for label in ("always rerank", "fidelity 0", "fidelity 0.5", "the bundle's own"):
        for key in ("wins", "losses"):
            assert pooled[label][key] == sum(rows[label][key] for rows in parts)
        assert 0 <= pooled[label]["p_beats_first_stage"] <= 1
    # a pool without the measured conversations: the calibration span is recalled as a bundle is built
    bench("rerank_gate.py", "--bundle", str(tiny_bundle), "--calibrate", "valid:0:12", "--measure",
          "test:0:8", "--fidelity", "0", "0.5", "--n-r", "4", "--exclude-conversation",
          "--out", str(out))  # fmt: skip
    apart = json.loads(out.read_text())
    assert apart["exclude_conversation"] is True and result["exclude_conversation"] is False
    assert apart["n_r"]["4"]["spans"]["valid[0:12]"] == calibration


def test_as_served_answers_as_the_gated_offline_ranking_and_pairs_bundles(tmp_path, tiny_bundle, monkeypatch):
    """Each bundle answers through its Responder, one context at a time: the same top answers as the
    offline ranking rerank_gate.py scores for the bundle's own gate and reach (two paths to one answer,
    which here differ from reranking every candidate); every later bundle is paired with the first on
    each span and pooled."""
    from coreply.corpus import load_chitchat
    from coreply.responder import Responder
    from evaluation.protocols import ranked_ids, retrieve_and_rerank

    retrieval_only = tmp_path / "retrieval-only"
    shutil.copytree(tiny_bundle, retrieval_only)
    reseal(retrieval_only, SEALING, lambda manifest: manifest["models"].update(cross=None))
    torch_only = tmp_path / "torch-only"  # the tiny bundle as if built with --onnx none
    shutil.copytree(tiny_bundle, torch_only)
    reseal(torch_only, SEALING, lambda manifest: manifest.update(onnx=None))
    out = tmp_path / "served.json"
    bench("as_served.py", "--bundles", str(tiny_bundle), str(retrieval_only), "--measure", "test:0:40",
          "valid:2000:30", "--threads", "1", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    names = ["test[0:40]", "valid[2000:2030]"]
    mine = result["bundles"][str(tiny_bundle)]
    assert mine["version"] == load_bundle(tiny_bundle).version and result["n_r"] == 10

    bot = Responder.load(tiny_bundle)
    ranking, fusion = bot.pipeline, bot.default_fusion
    got = retrieve_and_rerank(load_chitchat()["test"][:40], ranking, 10, 10)
    gated, always = (
        [int(ids[0]) if len(ids) else None for ids in ranked_ids(got, fusion, 10, ranking.weight, *limits)]
        for limits in ((ranking.gate, ranking.reach), ())
    )
    assert mine["spans"]["test[0:40]"]["answers"] == gated != always

    assert result["bundles"][str(retrieval_only)]["fusion"] == "retrieval"
    rows, first = result["against_first"][str(retrieval_only)], mine["spans"]
    for name, size in zip(names, (40, 30), strict=True):
        other = result["bundles"][str(retrieval_only)]["spans"][name]
        assert len(other["answers"]) == size
        assert rows[name]["hits@1"] == other["hits@1"] == round(100 * len(other["top1_cases"]) / size, 2)
        assert 0 <= rows[name]["p_beats_first"] <= 1
    for key in ("wins", "losses"):
        assert rows["pooled"][key] == sum(rows[n][key] for n in names)
    assert rows["pooled"]["pairs"] == 70
    pooled_first = (40 * first[names[0]]["hits@1"] + 30 * first[names[1]]["hits@1"]) / 70
    assert abs(rows["pooled"]["first's hits@1"] - pooled_first) < 0.01

    # a team's own pairs file: the same pairs as a span of chitchat's get the same answers
    own = tmp_path / "own.jsonl"
    own.write_text(
        "".join(
            json.dumps({"context": p.context, "response": p.response}) + "\n"
            for p in load_chitchat()["test"][:40]
        )
    )
    bench("as_served.py", "--bundles", str(tiny_bundle), str(retrieval_only), "--pairs", str(own),
          "--threads", "1", "--out", str(out))  # fmt: skip
    again = json.loads(out.read_text())["bundles"]
    for path, before in result["bundles"].items():
        assert list(again[path]["spans"]) == ["own.jsonl"]
        assert again[path]["spans"]["own.jsonl"]["answers"] == before["spans"]["test[0:40]"]["answers"]

    # restatements of the last turn: people's replies on these spans restate none, the turn itself does
    assert result["people"] == {name: {"judge": 0.0, "words": 0.0} for name in names}
    assert all(set(row["restates_%"]) == {"judge", "words"} for row in mine["spans"].values())
    module = load_script("as_served", monkeypatch)
    pairs = load_chitchat()["test"][:40]
    judge = module.RestatementJudge(module.load_bi(module.ZERO_SHOT))
    assert module.restates(judge, pairs, [pair.context[-1] for pair in pairs]) == {"judge": 100, "words": 100}
    assert module.restates(judge, pairs, [None] * 40) == {"judge": 0, "words": 0}


def test_other_corpus_writes_each_distinct_pair_once_and_its_replies_as_the_pool(tmp_path):
    corpus = tmp_path / "english"
    corpus.mkdir()
    (corpus / "greetings.yml").write_text(
        "conversations:\n- - Hello\n  - Hi\n  - How are you?\n- - Hello\n  - Hi\n"
    )
    (corpus / "support.yml").write_text("conversations:\n- - My mouse froze.\n  - Try another port.\n")
    (corpus / "empty.yml").write_text("categories:\n- empty\n")
    (corpus / "blank.yml").write_text("")
    (corpus / "trivia.yml").write_text("conversations:\n- A question and its answer in one string\n")
    out = tmp_path / "out"
    said = bench("other_corpus.py", "--corpus", str(corpus), "--out", str(out)).stdout
    assert "note: 1 entries are not lists of turns, left out: trivia:0" in said  # not one turn a letter
    pairs = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    assert [(p["context"], p["response"], p["conversation_id"]) for p in pairs] == [
        (["Hello"], "Hi", "greetings:0"),  # greetings:1 repeats it
        (["Hello", "Hi"], "How are you?", "greetings:0"),
        (["My mouse froze."], "Try another port.", "support:0"),
    ]
    replies = [json.loads(line)["text"] for line in (out / "replies.jsonl").read_text().splitlines()]
    assert replies == ["Hi", "How are you?", "Try another port."]

    for text, says in (
        ("conversations: [[a, b]\n", "is not UTF-8 YAML"),
        ("conversations: hi\n", "a list of lists"),
    ):
        (corpus / "bad.yml").write_text(text)
        script = str(ROOT / "bench" / "other_corpus.py")
        run = subprocess.run(
            [sys.executable, script, "--corpus", str(corpus), "--out", str(out)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert run.returncode != 0 and f"--corpus: {corpus / 'bad.yml'}" in run.stderr and says in run.stderr
        assert "Traceback" not in run.stderr


def test_prior_served_tries_each_weight_where_it_serves(tmp_path_factory, tmp_path, tiny_core, toy_pairs):
    """Every weight answers the --choose spans as served, paired with the bundle's own; the held-out spans
    are measured only where another weight wins. A weight of 0 is the bundle without its prior."""
    from conftest import tiny_models_over, toy_pool

    bundle = tiny_models_over(
        tmp_path_factory, tiny_core, "prior", toy_pool(), prior_pairs=toy_pairs, guard_pairs=toy_pairs
    )
    out = tmp_path / "prior.json"
    bench("prior_served.py", "--bundle", str(bundle), "--alphas", "0", "2", "--choose", "valid:0:12",
          "--measure", "test:0:8", "--threads", "1", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    own = result["own_alpha"]
    assert set(result["choose"]) == {str(own), "0.0", "2.0"} and result["chosen"] in (own, 0.0, 2.0)
    for alpha, row in result["choose"].items():
        assert 0 <= row["hits@1"] <= 100 and (alpha == str(own)) == ("p_beats_own" not in row)
    assert ("measure" in result) == (result["chosen"] != own)


def test_quantisation_compares_each_int8_variant_with_fp32(tmp_path, tiny_core):
    out = tmp_path / "quant.json"
    bench("quantisation.py", "--bi", str(tiny_core / "bi"), "--limit", "20", "--pool", "60", "--single", "2",
          "--out", str(out))  # fmt: skip
    variants = json.loads(out.read_text())["variants"]
    assert list(variants) == ["fp32", "int8-per-channel-7bit", "int8-per-channel", "int8-per-tensor"]
    assert variants["fp32"]["top1_as_fp32"] == 100.0 and variants["fp32"]["cosine_contexts"] == 1.0
    for row in variants.values():
        assert 0 <= row["hits@1"] <= row["hits@10"] <= 100 and 0 < row["cosine_responses"] <= 1.0001
    assert variants["int8-per-channel"]["megabytes"] < variants["fp32"]["megabytes"]


def test_rerank_precision_scores_the_same_candidates_in_each_precision(tmp_path, tiny_bundle):
    out = tmp_path / "precision.json"
    bench("rerank_precision.py", "--bundle", str(tiny_bundle), "--limit", "6", "--weights", "0.3",
          "--variants", "fp32", "int8-per-channel-7bit", "torch", "torch-bf16", "torch-int8",
          "--keep-fp32", r"layer\.0/", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["rows"]
    int8 = "int8-per-channel-7bit"
    assert set(rows) == {
        "retrieval",
        "fp32",
        int8,
        "torch",
        "torch-bf16",
        "torch-int8",
        rf"{int8}, fp32: layer\.0/",
    }
    assert rows["fp32"]["pearson_with_fp32"] == 1.0 and rows["fp32"]["top1_as_fp32_%"] == 100.0
    assert rows["torch"]["pearson_with_fp32"] > 0.999  # the same model in PyTorch
    fusions = {"rerank", "sum", *[f"zscore {w}" for w in {0.3, result["served_weight"]}]}
    if result["gate"]["margin"] is not None:  # the bundle's default fusion behind its rerank gate
        fusions.add(f"{load_bundle(tiny_bundle).manifest['fusion']['default']}, gated")
    for name, row in rows.items():
        if name == "retrieval":
            continue
        assert row["ms_per_context"] > 0 and -1 <= row["pearson_with_fp32"] <= 1
        assert {k for k, v in row.items() if isinstance(v, dict)} == fusions
        assert all(0 <= row[f]["hits@1"] <= 100 and 0 <= row[f]["p_gains"] <= 1 for f in fusions)
        for f in fusions:  # paired with the first stage's top-1 cases: every gain and loss is counted
            cases, base = set(row[f]["top1_cases"]), set(rows["retrieval"]["top1_cases"])
            assert (row[f]["wins"], row[f]["losses"]) == (len(cases - base), len(base - cases))
            assert row[f]["hits@1"] == round(100 * len(cases) / 6, 2)


def test_rerank_ensemble_sums_every_set_of_rerankers_on_the_same_candidates(tmp_path, tiny_bundle, tiny_core):
    out = tmp_path / "ensemble.json"
    copy = (
        tmp_path / "copy"
    )  # the bundle's own reranker again: as served, it must score exactly as the bundle's
    shutil.copytree(tiny_core / "cross", copy)
    bench("rerank_ensemble.py", "--bundle", str(tiny_bundle), "--cross", str(copy), "--split", "valid",
          "--limit", "12", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["rows"]
    sets = ["the bundle's", "copy", "the bundle's + copy"]
    assert set(rows) == {"first stage"} | {f"{f}: {s}" for f in ("sum", "zscore") for s in sets}
    assert set(result["ms_per_context"]) == {"the bundle's", "copy"}
    for fusion in ("sum", "zscore"):
        own, again = rows[f"{fusion}: the bundle's"], rows[f"{fusion}: copy"]
        assert own["top1_cases"] == again["top1_cases"] and again["wins_losses_vs_own"] == [0, 0]
    for name, row in rows.items():
        assert 0 <= row["hits@1"] <= 100 and (name == "first stage" or 0 <= row["p_beats_own"] <= 1)


def test_filtered_times_each_share_of_the_pool_and_counts_what_filtering_after_leaves_short(
    tmp_path, tiny_bundle
):
    out = tmp_path / "filtered.json"
    bench("filtered.py", "--bundle", str(tiny_bundle), "--split", "valid", "--limit", "4", "--threads", "1",
          "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["filtered"]
    size = len(load_bundle(tiny_bundle).texts)  # 13: shard = id
    assert [row["responses allowed"] for row in rows] == [1, 10, 2, 7, size]
    assert rows[0]["short of top_k 3 %"] == 100.0 and rows[-1]["short of top_k 3 %"] == 0.0
    assert rows[-1]["filtered after: short %"] == 0.0 and result["requests"] == 4
    assert all(row["p50 ms"] > 0 and row["search p50 ms"] > 0 for row in rows)
    # over an IVF index of the bundle's vectors, probed in full: past 4 allowed the index searches within
    # the filter, and finds the top answers the exact search within it finds
    bench("filtered.py", "--bundle", str(tiny_bundle), "--split", "valid", "--limit", "4", "--threads", "1",
          "--factory", "IVF2,Flat", "--search-params", "nprobe=2", "--exact-within", "4",
          "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert result["index"] == "IVF2,Flat nprobe=2" and result["exact_within"] == 4
    by_index = [row for row in result["filtered"] if row["searched by"] == "the index, within the filter"]
    assert [row["responses allowed"] for row in by_index] == [10, 7, size]
    assert all(row["top answer not the exact search's %"] == 0.0 for row in by_index)


def test_own_turns_scores_the_reply_against_the_contexts_own_turns(tmp_path, tiny_core):
    out = tmp_path / "own.json"
    copy = tmp_path / "copy"  # the same reranker again: it must prefer the reply exactly as often
    shutil.copytree(tiny_core / "cross", copy)
    bench("own_turns.py", "--cross", str(tiny_core / "cross"), str(copy), "--split", "valid", "--limit", "12",
          "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    first, again = result["rows"][str(tiny_core / "cross")], result["rows"][str(copy)]
    assert result["pairs"] == "valid[0:12]" and first["pairs"] == 12
    assert 0 < first["pairs with a last turn"] <= 12
    for name in ("last", "before last", "either"):
        assert 0 <= first[f"{name} above reply %"] <= 100
        assert first[f"{name} above reply %"] == again[f"{name} above reply %"]
    assert first["either above reply %"] >= first["last above reply %"] * first["pairs with a last turn"] / 12
    assert again["vs first: wins, losses"] == [0, 0]


def test_guard_rules_drop_what_each_rule_flags_and_pair_every_rule_with_the_served_guard(
    tmp_path, guarded_bundle
):
    out = tmp_path / "rules.json"
    bench("guard_rules.py", "--bundle", str(guarded_bundle), "--split", "test", "--start", "0",
          "--limit", "12", "--depth", "10", "--cosine", "0.99", "--words", "0.995",
          "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert set(rows) == {
        "guard off",
        "served guard",
        "cosine 0.99",
        "words 0.995",
        "cosine 0.99 + words 0.995",
    }
    dropped = {name: row["human_replies_dropped_%"] for name, row in rows.items()}
    assert dropped["guard off"] == 0 and result["served_guard"]["quantile"] == 0.99
    assert dropped["cosine 0.99 + words 0.995"] >= max(dropped["cosine 0.99"], dropped["words 0.995"])
    served = set(rows["served guard"]["top1_cases"])
    for row in rows.values():  # every gain and loss against the served guard is counted
        cases = set(row["top1_cases"])
        assert (row["wins"], row["losses"]) == (len(cases - served), len(served - cases))
        assert row["hits@1"] <= row["hits@10"] and 0 <= row["restates_judge"] <= 100


def test_response_prior_sweep_measures_every_setting_against_no_prior(tmp_path, tiny_bundle):
    out = tmp_path / "sweep.json"
    bench("response_prior.py", "--bundle", str(tiny_bundle), "--limit", "20", "--reference", "100",
          "--ks", "5", "--alphas", "0.5", "1", "--out", str(out))  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mask"], r["k"], r["alpha"]) for r in rows] == [
        (None, None, 0.0), (True, 5, 0.5), (True, 5, 1.0), (False, 5, 0.5), (False, 5, 1.0)
    ]  # fmt: skip
    assert rows[0]["valid_p"] == 1.0  # no better than itself
    assert all(0 <= r["test_hits@1"] <= r["test_hits@10"] <= 100 for r in rows)


def evaluation(path: Path, *protocols: list[list[int]]) -> str:
    """A `coreply eval` JSON at ``path`` whose protocols A and B hold rows of these per-case ranks."""
    rows = [
        [{"system": f"s{i}", "ranks": r, "metrics": {"hits@1": 0}} for i, r in enumerate(p)]
        for p in protocols
    ]
    path.write_text(json.dumps(dict(zip("AB", rows, strict=True))))
    return str(path)


def test_compare_evals_pairs_rows_across_files_and_names_a_bad_row_in_one_line(tmp_path):
    new = evaluation(tmp_path / "new.json", [[1, 1, 2, 1]], [[3, 1, 1, 1], [1, 1, 1, 2]])
    old = evaluation(tmp_path / "old.json", [[2, 2, 1, 3]], [[1, 5, 9, 1]])
    listing = bench("compare_evals.py", "--list", new).stdout.splitlines()
    assert [line.split("\t")[0] for line in listing] == [f"{new}#A0", f"{new}#B0", f"{new}#B1"]
    out = bench("compare_evals.py", f"{new}#A0", f"{old}#A0", f"{new}#B1", f"{old}#B0").stdout.splitlines()
    assert out[0].split() == ["75.00", "new#A0", "s0"]
    assert "wins 3, losses 1," in out[1] and "wins 1, losses 1," in out[2] and "wins 1, losses 0," in out[3]
    p = [float(line.rsplit("p ", 1)[1]) for line in out[1:]]
    assert 0 < p[0] < 0.5 < p[1] < 1  # better by 2 of 4 cases; level
    short = evaluation(tmp_path / "short.json", [[1, 1]], [])
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"A": [{"system": "s0"}]}))
    for args, error in (
        ([f"{new}#C0", f"{old}#A0"], "name a row as FILE#A3"),
        ([f"{new}#B2", f"{old}#A0"], "protocol B has 2 rows"),
        ([f"{new}#A0", f"{short}#A0"], "2 cases, the first row has 4"),
        ([f"{new}#A0", f"{tmp_path}/missing.json#A0"], "cannot read an evaluation JSON"),
        ([f"{new}#A0", f"{bare}#A0"], "no system name or per-case ranks"),
    ):
        run = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "compare_evals.py"), *args], capture_output=True, text=True
        )
        assert run.returncode != 0 and error in run.stderr and len(run.stderr.splitlines()) == 1, run.stderr


def test_retriever_sum_ranks_by_both_retrievers_scores(tmp_path, tiny_core):
    from coreply.checkpoint import read_meta, save_checkpoint
    from coreply.config import ModelConfig
    from coreply.models import BiEncoder

    trained = tiny_core / "bi"
    twin, untrained = tmp_path / "twin", tmp_path / "untrained"
    shutil.copytree(trained, twin)  # the same retriever under another name
    config = ModelConfig.from_dict(read_meta(trained)["model_config"])
    save_checkpoint(BiEncoder.from_pretrained(config), untrained, {})  # a different one
    for other in (twin, untrained):
        out = tmp_path / f"{other.name}.json"
        bench("retriever_sum.py", "--bi", str(trained), str(other), "--split", "valid", "test",
              "--limit", "10", "--pool", "80", "--out", str(out))  # fmt: skip
        result = json.loads(out.read_text())
        assert result["pool_size"] == 80 and [r["split"] for r in result["B"]] == ["valid"] * 3 + ["test"] * 3
        assert all(0 <= r["metrics"]["hits@1"] <= r["metrics"]["hits@10"] <= 100 for r in result["B"])
        for total in (result["B"][2], result["B"][5]):
            assert total["system"].endswith(": sum") and set(total["against"]) == {str(trained), str(other)}
        twice = [result["B"][i]["ranks"] for i in (0, 2, 3, 5)]  # each split: the trained one, the sum
        if other == twin:  # the same scores twice: the sum keeps the retriever's order exactly
            assert twice[0] == twice[1] and twice[2] == twice[3]
    alone = tmp_path / "alone.json"  # one retriever: its rows alone, the same as beside another
    bench("retriever_sum.py", "--bi", str(trained), "--split", "valid", "test", "--limit", "10",
          "--pool", "80", "--out", str(alone))  # fmt: skip
    rows = json.loads(alone.read_text())["B"]
    assert [r["system"] for r in rows] == [f"valid: {trained}", f"test: {trained}"]
    assert "against" not in rows[0] and [r["ranks"] for r in rows] == [twice[0], twice[2]]


def test_hybrid_bm25_reorders_the_retrievers_first_candidates(tmp_path, tiny_core, guarded_bundle):
    out = tmp_path / "hybrid.json"
    bench("hybrid_bm25.py", "--bi", str(tiny_core / "bi"), "--split", "valid", "test", "--limit", "10",
          "--pool", "80", "--depth", "10", "--weights", "0.5", "0", "--k1", "1.5", "0.5", "--b", "0.75",
          "0", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    rows = {r["system"]: r for r in result["B"]}
    settings = [f"k1={k1}, b={b}" for k1 in ("1.5", "0.5") for b in ("0.75", "0")]
    names = ["dense"] + [f"dense + BM25 ({s}), w={w}" for s in settings for w in ("0.5", "0.0")]
    assert list(rows) == [f"{split}: {name}" for split in ("valid", "test") for name in names]
    chosen = result["chosen_weight"]
    assert chosen["on"] == "valid" and chosen["weight"] in (0.5, 0.0)
    best = max(
        (r for r in result["B"] if r["split"] == "valid" and "weight" in r),
        key=lambda r: r["metrics"]["hits@1"],
    )
    assert chosen["weight"] == best["weight"] and (chosen["k1"], chosen["b"]) == (best["k1"], best["b"])
    for split in ("valid", "test"):
        dense = rows[f"{split}: dense"]
        for name in names[1:]:
            fused = rows[f"{split}: {name}"]
            assert fused["metrics"]["hits@10"] == dense["metrics"]["hits@10"]  # a reordering of the same 10
            assert set(fused["against_dense"]) == {"wins", "losses", "p"}
    bm25_alone = [
        rows[f"{split}: dense + BM25 (k1=1.5, b=0.75), w=0.0"]["ranks"] for split in ("valid", "test")
    ]
    assert bm25_alone != [rows[f"{split}: dense"]["ranks"] for split in ("valid", "test")]  # BM25 reorders
    scores = {
        s: [rows[f"{split}: dense + BM25 ({s}), w=0.0"]["ranks"] for split in ("valid", "test")]
        for s in settings
    }
    assert len({repr(r) for r in scores.values()}) > 1  # k1 and b reach the scores: not every order alike
    assert all(set(r["restates"]) == {"judge", "words"} for r in rows.values())
    assert set(rows["valid: dense"]["people_restate"]) == {"judge", "words"}
    served = tmp_path / "served.json"  # the same through a bundle's own pipeline and pool
    bench("hybrid_bm25.py", "--bundle", str(guarded_bundle), "--split", "test", "--limit", "10",
          "--depth", "5", "--weights", "0.5", "--guard-quantile", "0.99", "--query", "earlier",
          "--out", str(served))  # fmt: skip
    result = json.loads(served.read_text())
    assert result["served"] and result["guard_quantile"] == 0.99 and result["query"] == "earlier"
    assert [r["system"] for r in result["B"]] == ["test: dense", "test: dense + BM25 (k1=1.5, b=0.75), w=0.5"]


def test_restatement_guard_answers_as_the_service_does(guarded_bundle, toy_pairs, monkeypatch):
    """The bench's batched answers are the service's, one request at a time: in the first stage's order
    and reranked with the bundle's fusion, with the guard off and on."""
    from coreply.responder import Responder

    module = load_script("restatement_guard", monkeypatch)
    bot = Responder.load(guarded_bundle)
    assert bot.default_fusion == "zscore"  # the bundle has a reranker
    for fusion in ("retrieval", "zscore"):
        for allow in (True, False):
            ranked, top = module.top_answers(bot.pipeline, toy_pairs, allow, fusion)
            served = [bot.respond(p.context, 10, fusion=fusion, allow_restatements=allow) for p in toy_pairs]
            assert top == [replies[0].text for replies in served]
            assert ranked == [[bot.pipeline.keys[r.id] for r in replies] for replies in served]
    assert module.setting(False, "zscore") == "guard on, reranked (zscore)"


def test_typed_user_turns_miss_the_pool_and_are_answered_alike(monkeypatch, guarded_bundle):
    """bench.py --typed-user-turns: the user's turns (the last, every second one before it) miss the pool's
    stored vectors, as a user's own words do, so the guard encodes them; the answers stay the same."""
    from coreply.responder import Responder

    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # as when run: its helpers in bench/bench.py
    monkeypatch.delitem(sys.modules, "bench", raising=False)
    from bench import typed_user_turns

    bot = Responder.load(guarded_bundle)
    encoded: list[str] = []
    encode = bot.backend.encode_responses
    monkeypatch.setattr(bot.backend, "encode_responses", lambda texts: encoded.extend(texts) or encode(texts))
    pool = bot.bundle.texts
    for start in range(0, 12, 3):
        held = list(pool[start : start + 4])  # a conversation whose every turn the pool holds
        typed = typed_user_turns(held)
        assert typed == [held[0], held[1] + " ", held[2], held[3] + " "]
        encoded.clear()
        before = bot.respond(held, 10)
        assert encoded == []  # every turn's vector read from the index
        after = bot.respond(typed, 10)
        assert set(encoded) >= {typed[-1]} and not set(encoded) & set(held)  # the user's, and only theirs
        assert [(r.id, r.score) for r in after] == [(r.id, r.score) for r in before]


def test_variants_counts_the_answers_passed_over(tmp_path, variants_bundle):
    """Every candidate of the variants pool asked for: each list holds its four variants (two of "hello",
    two of the pizza answer), all replaced, and nothing is left to replace them."""
    out = tmp_path / "variants.json"
    n = str(len(load_bundle(variants_bundle).texts))
    bench("variants.py", "--bundle", str(variants_bundle), "--limit", "3", "--max-turns", "1",
          "--top-k", n, "--n-candidates", n, "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert (result["contexts"], result["max_turns"], result["lists_with_variants_pct"]) == (3, 1, 100.0)
    assert result["variants_replaced"] == 4 * 3 and result["lists_left_short"] == 3
    (first, *_) = result["examples"]
    assert len(first["context"]) == 1 and len(first["served"]) == len(first["allowed"]) - 4


def test_openers_reports_the_guard_on_peoples_replies_by_kind_of_turn(tmp_path, guarded_bundle):
    out = tmp_path / "openers.json"
    bench("openers.py", "--bundle", str(guarded_bundle), "--out", str(out))
    result = json.loads(out.read_text())
    for split in ("valid[:5000] (calibration)", "test"):
        rows = result["splits"][split]
        assert set(rows) == {"openers", "first turns", "short turns later", "all"}
        assert rows["all"]["pairs"] == 5000 and rows["openers"]["pairs"] < rows["first turns"]["pairs"]
        for row in rows.values():
            assert 0 <= row["dropped_%"] <= 100 and 0 <= row["dropped_without_opener_thresholds_%"] <= 100
    assert set(result["answers"]) >= {"hello", "hi"} and all(result["answers"].values())
