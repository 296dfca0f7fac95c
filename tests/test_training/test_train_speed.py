"""bench/train_speed.py on the tiny model and a slice of the corpus: the CPU smoke run CI can afford."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_train_speed_reports_throughput_padding_and_utilisation_per_mode_and_variant(tmp_path):
    out = tmp_path / "speed.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "train_speed.py"), "--device", "cpu", "--steps", "1",
         "--warmup", "1", "--pairs", "300", "--batch-size", "4", "--num-negatives", "3",
         "--modes", "core", "distill", "--variant", "base", "chunks=64", "packed", "mined=1",
         "packed-cpu-bf16", "--profile", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["train_pairs"] == 300 and result["list_size"] == 4 and result["date"]
    rows = {(r["mode"], r["variant"]): r for r in result["rows"]}
    variants = ("base", "chunks=64", "packed", "mined=1", "packed-cpu-bf16")
    assert set(rows) == {(m, v) for m in ("core", "distill") for v in variants}
    for r in rows.values():
        assert r["contexts_per_s"] > 0 and r["tokens_per_s"] > 0 and r["model_tflops_per_s"] > 0
        assert 0 < r["mfu_vs_measured_matmul"] < 1
        assert "bi_loss" in r["losses"]
        # one more step under the profiler: where its time went, operator by operator (host time on a CPU)
        prof = r["profile"]
        assert prof["steps"] == 1 and prof["ms_per_step"] > 0 and prof["device_busy_share"] is None
        assert any(op["op"] in ("aten::addmm", "aten::mm", "aten::bmm") for op in prof["operators"])
        assert sum(op["self_host_ms"] for op in prof["operators"]) <= prof["ms_per_step"]
    # chunking the reranker's pairs by a token budget pads less than one batch padded to the longest
    assert rows["core", "chunks=64"]["padding_share"] < rows["core", "base"]["padding_share"]
    assert rows["core", "packed"]["padding_share"] == 0  # packed: no compute on padding at all
    bf16 = rows["core", "packed-cpu-bf16"]  # the same steps under bf16 autocast: packed, other roundings
    assert bf16["padding_share"] == 0 and bf16["losses"] != rows["core", "packed"]["losses"]
    check = result["packed_check"]  # on a CPU: padded attention over the packed tokens, the same scores
    assert check["pairs"] == 256 and check["max_abs_diff"] < 1e-4 < check["score_std"] and not check["varlen"]
    assert check["autocast_noise"] == 0  # no autocast on a CPU
    assert "cross_loss" not in rows["distill", "base"]["losses"]  # distill trains the retriever only
