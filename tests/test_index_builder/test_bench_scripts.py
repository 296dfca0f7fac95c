"""The benchmark scripts on the tiny models: CPU smoke runs that keep them working (for a GPU lease too)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


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
    for row in result["rows"]:
        stages = row["ms_per_batch"]
        assert row["batches"] == 4 // row["batch"] and stages["rerank"] > 0 and stages["encode"] > 0
        assert stages["total"] >= stages["encode"] + stages["search"] + stages["rerank"]
        assert len(row["operators"]) == 5 and all(op["self_host_ms"] >= 0 for op in row["operators"])
        assert any(op["op"].startswith("aten::") for op in row["operators"])


def test_rerank_ops_profiles_the_onnx_reranker(tiny_bundle):
    run = bench(
        "rerank_ops.py", "--bundle", str(tiny_bundle), "--n-r", "3", "--requests", "4", "--rounds", "1"
    )
    table = run.stdout.split("| operator | ms per request | share |")[1]
    assert "rerank ms per request" in run.stdout and "MatMul" in table


def test_benches_refuse_bad_flags_in_one_line(tmp_path, tiny_bundle, tiny_core):
    other = tmp_path / "other.json"  # a restatement_guard run on another split: nothing to pair with
    other.write_text(json.dumps({"top1_cases": {}, "meta": {"split": "valid", "pairs": 2000}}))
    for script, args, flag in (
        ("serve_profile.py", ["--bundle", str(tmp_path)], "--bundle: "),
        ("serve_profile.py", ["--bundle", str(tiny_bundle), "--device", "gpu"], "--device: "),
        ("rerank_ops.py", ["--bundle", str(tiny_bundle), "--n-r", "0"], "--n-r"),
        ("quantisation.py", ["--bi", str(tiny_core / "bi"), "--limit", "20", "--pool", "5"], "--pool: "),
        ("restatement_guard.py", ["--bundle", str(tiny_bundle), "--against", str(other)], "--against "),
    ):
        run = subprocess.run(
            [sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True
        )
        assert run.returncode != 0 and run.stderr.startswith(flag) and len(run.stderr.splitlines()) == 1, (
            run.stderr
        )


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
