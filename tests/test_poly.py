"""The Poly-encoder end to end on the tiny model: the paper's score, training alone and as CORE's
partner, checkpoints, ONNX export, the poly stage from a bundle's cached vectors, evaluation, serving."""

import json

import numpy as np
import pytest
import torch
from conftest import TOPICS, toy_pool, train_toy
from fastapi.testclient import TestClient

from coreply.checkpoint import load_checkpoint, save_checkpoint
from coreply.config import ModelConfig
from coreply.models import PolyEncoder, poly_scores, retriever_class

M = 4


@pytest.fixture(scope="module")
def poly_config(tiny_model_dir) -> ModelConfig:
    return ModelConfig(base_model=str(tiny_model_dir), dropout=0.0, poly_codes=M)


@pytest.fixture(scope="module")
def tiny_poly_core(tmp_path_factory, poly_config, toy_pairs):
    """A tiny Poly-encoder trained with a cross-encoder by CORE: ``run/bi`` (poly), ``run/cross``."""
    out = tmp_path_factory.mktemp("tiny-poly") / "run"
    return out, train_toy(out, poly_config, toy_pairs, in_batch=True)


@pytest.fixture(scope="module")
def poly_bundle(tmp_path_factory, tiny_poly_core, toy_pairs):
    """The Poly-encoder alone (no cross-encoder): its poly stage is the bundle's reranker."""
    from index_builder.build import build_bundle

    out = tmp_path_factory.mktemp("bundles") / "poly"
    run, _ = tiny_poly_core
    build_bundle(out, toy_pool(), bi=str(run / "bi"), calibration=toy_pairs[:16], progress=False)
    return out


def test_poly_score_is_the_papers_attention_then_dot_product():
    torch.manual_seed(0)
    codes, cands = torch.randn(2, M, 8), torch.randn(5, 8)  # [B, m, D], [M, D]
    got = poly_scores(codes, cands)  # [2, 5]
    for b in range(2):
        for i in range(5):
            w = torch.softmax(codes[b] @ cands[i], dim=0)  # weights over the m context vectors
            y_ctx = (w[:, None] * codes[b]).sum(0)
            assert got[b, i] == pytest.approx(float(y_ctx @ cands[i]), abs=1e-5)
    per_context = poly_scores(codes, cands.expand(2, 5, 8))  # [B, M, D] gives the same
    assert torch.allclose(per_context, got, atol=1e-6)


def test_codes_ignore_padding_and_the_pooled_row_is_the_bi_encoder_vector(poly_config):
    torch.manual_seed(0)
    model = retriever_class(poly_config).from_pretrained(poly_config).eval()
    assert isinstance(model, PolyEncoder) and model.num_codes == M
    short, longer = ["hello", "what is your favorite food ?"], ["a long turn about the weather today"] * 3
    alone = model.embed_context_codes([short])
    padded = model.embed_context_codes([short, longer])[:1]  # padded to the longer context
    assert alone.shape == (1, 1 + M, model.dim)
    assert torch.allclose(alone, padded, atol=1e-5)
    assert torch.allclose(alone[:, 0], model.embed_contexts([short]), atol=1e-5)
    with pytest.raises(ValueError, match="poly_codes"):
        ModelConfig(poly_codes=-1)


def test_poly_trains_with_core_and_alone_and_round_trips(tiny_poly_core, poly_config, toy_pairs, tmp_path):
    run, summary = tiny_poly_core
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    valid = [r["valid"] for r in logged if r.get("valid")]
    assert valid and all({"bi", "poly", "cross"} <= set(v) for v in valid)  # protocol A on validation
    assert summary["best_valid_hits@1"]["bi"] == max(v["poly"]["hits@1"] for v in valid)  # selected on poly
    poly = load_checkpoint(run / "bi", expect="bi")
    cross = load_checkpoint(run / "cross", expect="cross")
    assert isinstance(poly, PolyEncoder) and cross.config.poly_codes == 0
    save_checkpoint(poly, tmp_path / "again")
    again = load_checkpoint(tmp_path / "again")
    contexts = [p.context for p in toy_pairs[:3]]
    assert torch.allclose(again.embed_context_codes(contexts), poly.embed_context_codes(contexts))

    alone = dict(mode="independent", models="bi", max_steps=4, eval_every=2, lora_rank=2)
    train_toy(tmp_path / "alone", poly_config, toy_pairs, **alone)
    adapted = load_checkpoint(tmp_path / "alone" / "bi")  # LoRA: the codes are in the adapter file
    assert isinstance(adapted, PolyEncoder)
    assert not torch.allclose(adapted.codes, retriever_class(poly_config).from_pretrained(poly_config).codes)


@pytest.mark.parametrize("mode", ["mutual", "distill"])
def test_poly_trains_in_the_other_modes(mode, tiny_poly_core, poly_config, toy_pairs, tmp_path):
    run, _ = tiny_poly_core
    extra = {"teacher": str(run / "cross")} if mode == "distill" else {}
    summary = train_toy(
        tmp_path / mode, poly_config, toy_pairs, mode=mode, max_steps=4, eval_every=2, **extra
    )
    assert summary["steps"] == 4 and isinstance(load_checkpoint(tmp_path / mode / "bi"), PolyEncoder)


def test_protocol_a_and_b_report_the_poly_stage(tiny_poly_core, toy_pairs):
    from evaluation.run import EvalSpec, run_eval

    run, _ = tiny_poly_core
    spec = EvalSpec(
        name="poly",
        bi=str(run / "bi"),
        cross=None,
        test=toy_pairs[:16],
        valid=toy_pairs[16:24],
        pool=toy_pool(),
        negatives=toy_pool(),
        candidates=4,
        n_r=(5,),
        retrievers=("bi",),
        device="cpu",
        judge=None,
    )
    result = run_eval(spec)
    names = [r["system"] for r in result["A"]]
    assert len(names) == 2 and names[1] == names[0].replace("Bi-", "Poly-")
    poly_rows = [r for r in result["B"] if "→ Poly-Enc" in r["system"]]
    assert {r["fusion"] for r in poly_rows} == {"rerank", "sum", "zscore"}
    assert poly_rows[0]["metrics"]["hits@1"] > 0  # the toy task is learnt: some golds come first


def test_poly_bundle_serves_the_poly_stage_and_ranks_like_the_evaluation(poly_bundle, tiny_poly_core):
    from coreply.bundle import load_bundle, make_backend, pipeline
    from coreply.corpus import Pair
    from evaluation.protocols import ranked_ids, retrieve_and_rerank
    from service.app import create_app
    from service.settings import Settings

    bundle = load_bundle(poly_bundle)
    assert "fusion" in bundle.manifest  # calibrated through the poly stage
    assert bundle.manifest["fusion"]["gate"]["margin"] is None  # too cheap to skip: never gated
    torch_backend, onnx_backend = make_backend(bundle, "torch"), make_backend(bundle, "onnx")
    contexts = [["hello", q] for q, _ in TOPICS.values()]
    np.testing.assert_allclose(  # the int8 ONNX graph gives the pooled vector and codes like the model
        onnx_backend.encode_context_codes(contexts), torch_backend.encode_context_codes(contexts), atol=0.1
    )
    ranking = pipeline(bundle, torch_backend)  # fp32: the service answers one at a time, this batches
    assert ranking.reranker == "poly"
    weight = bundle.manifest["fusion"]["zscore_weight"]
    got = retrieve_and_rerank([Pair(tuple(c), "") for c in contexts], ranking, 5, 5)
    with TestClient(create_app(Settings(bundle=poly_bundle, threads=1, backend="torch"))) as client:
        ready = client.get("/readyz").json()
        assert ready["reranker"] == "poly"
        for fusion in ("rerank", "zscore"):
            served = [
                client.post(
                    "/respond", json={"context": c, "top_k": 5, "n_candidates": 5, "fusion": fusion}
                ).json()["responses"]
                for c in contexts
            ]
            assert [[r["id"] for r in s] for s in served] == [
                ids.tolist() for ids in ranked_ids(got, fusion, 5, weight)
            ]
            assert all(r["rerank_score"] is not None for s in served for r in s)
    run, _ = tiny_poly_core
    direct = load_checkpoint(run / "bi")
    vectors = ranking.retrieve.vectors(np.arange(3))
    expect = direct.embed_responses(bundle.texts[:3]).numpy()
    np.testing.assert_allclose(vectors, expect, atol=0.1)  # the cache is the response tower's output


def test_the_cross_encoder_wins_the_rerank_stage_over_the_poly(tmp_path, tiny_poly_core, toy_pairs):
    from coreply.bundle import load_bundle, make_backend, pipeline
    from index_builder.build import build_bundle

    run, _ = tiny_poly_core
    build_bundle(tmp_path / "b", toy_pool(), bi=str(run / "bi"), cross=str(run / "cross"), progress=False)
    bundle = load_bundle(tmp_path / "b")
    assert pipeline(bundle, make_backend(bundle)).reranker == "cross"


def test_poly_stage_bench_runs_and_refuses_nonsense(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "bench" / "poly_stage.py"
    out = tmp_path / "poly.json"
    run = [sys.executable, str(script), "--pool", "500", "--n-r", "50", "--requests", "20", "--codes", "4"]
    done = subprocess.run([*run, "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["codes"] for r in rows] == [4] and rows[0]["p50_ms"] > 0
    bad = subprocess.run([*run[:2], "--n-r", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and bad.stderr == "--n-r: give at least 1, got 0\n"  # one line, up front
