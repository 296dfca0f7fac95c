"""The retriever and rerankers shipped in the repository."""

import numpy as np
import pytest
import torch

from coreply.checkpoint import base_weights, fp16_fingerprint, read_meta
from coreply.config import ModelConfig
from index_builder.default import DEFAULT_BI, DEFAULT_CROSS


def test_shipped_weights_verify_and_name_the_installed_base_model():
    meta = read_meta(DEFAULT_BI)  # every file against its recorded sha256
    assert meta["kind"] == "bi" and set(meta["files"]) == {"adapter.safetensors"}
    config = ModelConfig.from_dict(meta["model_config"])
    assert config.base_model == "default" and config.normalize and not config.share_towers  # two towers
    # loading checks the fp16 fingerprint: weights trained on a GPU host, whose base arrived in fp16 and
    # was widened there, name that copy by sha256 and share the installed base's fingerprint
    assert meta["adapter"]["base_fp16_sha256"] == fp16_fingerprint(base_weights(config))
    # the provenance the issue asks for travels with the weights
    assert {"command", "data", "date", "test_metrics", "train_config"} <= set(meta["extra"])


def test_the_shipped_reranker_verifies_and_names_the_installed_base_model():
    """``default-cross/`` is the default bundle's reranker; it travels to the GPU host with the tree
    (scripts/gpu_lease.sh's core-warm run starts from it) and must load there as here: its base named by
    fp16 fingerprint (what loading checks; it names the copy widened from fp16 on the GPU host that
    trained it)."""
    meta = read_meta(DEFAULT_CROSS)
    assert meta["kind"] == "cross" and set(meta["files"]) == {"adapter.safetensors"}
    config = ModelConfig.from_dict(meta["model_config"])
    assert meta["adapter"]["base_fp16_sha256"] == fp16_fingerprint(base_weights(config))
    assert "residual_to" not in meta["extra"]  # not tied to one retriever
    # the provenance the issue asks for travels with the weights
    assert {"command", "data", "date", "test_metrics", "train_config"} <= set(meta["extra"])


@pytest.mark.pretrained
def test_shipped_weights_load_as_a_changed_but_close_relative_of_zero_shot():
    from coreply.checkpoint import load_bi
    from coreply.config import ZERO_SHOT

    texts = ["yes, a dog named max.", "the weather is cold today.", "i love pizza"]
    trained = load_bi(DEFAULT_BI).embed_responses(texts)
    zero_shot = load_bi(ZERO_SHOT).embed_responses(texts)
    cosines = trained @ zero_shot.T  # [3, 3], both unit length
    agreement = cosines.diagonal()  # each text against itself
    assert (agreement < 0.9999).all()  # the adapters were applied
    # and kept MiniLM's geometry: each text stays closest to its own zero-shot embedding, at cosine
    # 0.69-0.90 for the shipped weights, while different texts sit at 0.03-0.15
    others = cosines.masked_fill(torch.eye(len(texts), dtype=torch.bool), -1).amax(dim=1)
    assert (agreement > 0.6).all() and (agreement - others > 0.4).all()


def test_default_bundle_is_rebuilt_when_the_shipped_weights_or_the_recipe_change(tmp_path, monkeypatch):
    import json

    from coreply.bundle import FORMAT, MANIFEST
    from index_builder import default

    built = []
    monkeypatch.setattr(default, "build_default_bundle", built.append)
    bundle = tmp_path / "default-bundle"

    bi, cross = (read_meta(path)["content_hash"] for path in (DEFAULT_BI, DEFAULT_CROSS))

    def built_from(bi: str, cross: str | None, recipe: str = default.RECIPE) -> None:
        models = {"bi": {"content_hash": bi}, "cross": cross and {"content_hash": cross}}
        manifest = {"format": FORMAT, "models": models, "build": {"command": recipe}}
        (bundle / MANIFEST).write_text(json.dumps(manifest))

    default.ensure_default_bundle(bundle)  # missing: built
    bundle.mkdir()
    built_from("an-earlier-shipped-retriever", cross)
    default.ensure_default_bundle(bundle)  # stale retriever: rebuilt
    built_from(bi, None)
    default.ensure_default_bundle(bundle)  # built before the reranker shipped: rebuilt
    built_from(bi, cross, recipe="an earlier recipe")
    default.ensure_default_bundle(bundle)  # stale recipe: rebuilt
    built_from(bi, cross)
    default.ensure_default_bundle(bundle)  # current: kept
    assert built == [bundle] * 4


def test_the_shipped_reranker_joins_the_default_with_calibrated_fusion(tmp_path, monkeypatch):
    from index_builder import build, default

    calls = []
    monkeypatch.setattr(build, "build_bundle", lambda out, texts, **kw: calls.append(kw))
    default.build_default_bundle(tmp_path / "b")
    kw = calls[0]
    assert kw["cross"] == str(DEFAULT_CROSS) and len(kw["calibration"]) == default.CALIBRATION_PAIRS
    assert kw["calibration"] == kw["lexical_pairs"]  # choices on valid[:2000]; the rest measures
    assert len(kw["prior_pairs"]) == 118_111 and len(kw["guard_pairs"]) == 6_623  # train / valid splits
    monkeypatch.setattr(default, "DEFAULT_CROSS", tmp_path / "left-out")
    default.build_default_bundle(tmp_path / "b")
    assert calls[1]["cross"] is None and calls[1]["calibration"] == ()  # a checkout without it: retrieval
    default.build_default_bundle(tmp_path / "b", cross=tmp_path / "lease-cross")  # a candidate in its place
    assert calls[2]["cross"] == str(tmp_path / "lease-cross") and calls[2]["calibration"] == kw["calibration"]
    assert calls[2]["command"].startswith(default.RECIPE) and calls[2]["command"] != default.RECIPE
    default.build_default_bundle(tmp_path / "b", bi=tmp_path / "lease-bi")  # behind the shipped reranker
    assert calls[3]["bi"] == str(tmp_path / "lease-bi") and calls[3]["cross"] is None  # (left out above)
    assert "lease-bi" in calls[3]["command"] and "candidate reranker" not in calls[3]["command"]


@pytest.mark.pretrained
def test_the_shipped_reranker_prefers_a_reply_to_an_unrelated_turn():
    """Not to a restatement: it scores the user's own last turn above the human reply in most contexts
    (docs/results.md §49), so the default's restatement guard drops those before it reranks."""
    from coreply.checkpoint import load_checkpoint

    cross = load_checkpoint(DEFAULT_CROSS, expect="cross")
    contexts = [["i just got a new puppy!"], ["hi! how was your weekend?", "great, i went hiking. you?"]]
    replies = ["What type of puppy? I love dogs!", "That's fun. I love hiking"]
    unrelated = ["the weather is cold today.", "i love pizza with extra cheese"]
    scores = cross.score_pairs(contexts * 2, replies + unrelated)  # [4]: replies, then unrelated turns
    assert (scores[:2] > scores[2:] + 1).all(), scores.tolist()


def test_the_default_is_built_with_the_choices_pinned_for_the_shipped_weights(tmp_path, monkeypatch):
    """The pins hold for the shipped weights (shipping others without pinning that build's choices
    fails here) and describe this recipe's stages; other weights, or ``calibrate``, are calibrated."""
    from coreply import gate, lexical, prior, restatement
    from coreply.bundle import CALIBRATED
    from coreply.ranking import FUSIONS
    from index_builder import build, default

    assert default.shipped_hashes() == default.PINNED_FOR, "new weights: pin a calibrated build's choices"
    pins = default.PINNED
    assert set(pins) == {"source", *CALIBRATED}
    ones = np.ones(2 * restatement.MIN_OPENERS)  # a calibration's entry, with openers: the keys pinned
    entry = restatement.guard_entry(ones, ones, ones, default.GUARD_QUANTILE, ones.astype(bool))
    assert set(pins["restatement"]) == set(entry)
    assert set(pins["restatement"]["openers"]) == set(entry["openers"])
    assert (pins["restatement"]["quantile"], pins["restatement"]["words_quantile"]) == (
        default.GUARD_QUANTILE,
        restatement.WORDS_QUANTILE,
    )
    assert (pins["prior"]["k"], pins["prior"]["reference_contexts"]) == (prior.K, prior.REFERENCE)
    assert pins["prior"]["alpha"] in prior.ALPHAS
    assert (pins["lexical"]["depth"], pins["lexical"]["turns"]) == (lexical.DEPTH, lexical.TURNS)
    fusion = pins["fusion"]
    assert fusion["default"] in FUSIONS and 0 <= fusion["zscore_weight"] <= 1
    fidelities = (fusion["gate"]["fidelity"], fusion["reach"]["fidelity"])
    assert fidelities == (gate.GATE_FIDELITY, gate.REACH_FIDELITY)

    calls = []

    def build_bundle(out, texts, pinned, rho, **kw):
        calls.append((pinned, rho is not None))

    monkeypatch.setattr(build, "build_bundle", build_bundle)
    default.build_default_bundle(tmp_path / "b")
    default.build_default_bundle(tmp_path / "b", calibrate=True)
    # a candidate reranker: the first stage's pins held, the fusion chosen for it
    default.build_default_bundle(tmp_path / "b", cross=tmp_path / "lease-cross")
    first_stage = {name: entry for name, entry in pins.items() if name != "fusion"}
    # a candidate retriever, alone or with a candidate reranker: every choice and the prior measured for it
    default.build_default_bundle(tmp_path / "b", bi=tmp_path / "lease-bi")
    default.build_default_bundle(tmp_path / "b", bi=tmp_path / "lease-bi", cross=tmp_path / "lease-cross")
    monkeypatch.setattr(default, "PINNED_FOR", {"bi": "other weights", "cross": None})
    default.build_default_bundle(tmp_path / "b")
    assert calls == [(pins, True), (None, False), (first_stage, True)] + [(None, False)] * 3


def test_the_default_prior_is_shipped_for_the_corpus_it_was_measured_on(monkeypatch, capsys):
    """The shipped rho is intact and fits the installed corpus's pool; another pool, or a damaged
    file, measures its own (with a line saying so)."""
    from coreply.corpus import distinct, load_chitchat, responses_of
    from index_builder import default

    texts = responses_of(load_chitchat())
    assert default.pool_digest(texts) == default.PINNED_POOL, "another corpus: ship the rho measured on it"
    rho = default.pinned_rho(texts)
    assert rho.dtype == np.float32 and rho.shape == (len(distinct(texts)),) and np.isfinite(rho).all()
    assert default.pinned_rho(texts[:-1]) is None
    assert "not the one the default's prior was measured on" in capsys.readouterr().out
    monkeypatch.setattr(default, "PINNED_RHO_SHA256", "0" * 64)
    assert default.pinned_rho(texts) is None
    assert "does not match its checksum" in capsys.readouterr().out
