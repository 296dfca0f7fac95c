"""The retriever shipped in the repository for the default bundle."""

import pytest
import torch

from coreply.artifacts import sha256_file
from coreply.checkpoint import base_weights, fp16_fingerprint, read_meta
from coreply.config import ModelConfig
from index_builder.default import DEFAULT_BI


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


def test_the_reranker_a_lease_run_starts_from_verifies_and_names_the_installed_base_model():
    """``core-cross-r32/`` travels to the GPU host with the tree: scripts/gpu_lease.sh's residual-core run
    starts from it, so it must load there as here (its base named by sha256 and by fp16 fingerprint)."""
    meta = read_meta(DEFAULT_BI.parent / "core-cross-r32")
    assert meta["kind"] == "cross" and set(meta["files"]) == {"adapter.safetensors"}
    config = ModelConfig.from_dict(meta["model_config"])
    assert meta["adapter"]["base_sha256"] == sha256_file(base_weights(config))
    assert meta["adapter"]["base_fp16_sha256"] == fp16_fingerprint(base_weights(config))
    assert "residual_to" not in meta["extra"]  # not tied to one retriever


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

    def built_from(content_hash: str, recipe: str = default.RECIPE) -> None:
        manifest = {
            "format": FORMAT,
            "models": {"bi": {"content_hash": content_hash}},
            "build": {"command": recipe},
        }
        (bundle / MANIFEST).write_text(json.dumps(manifest))

    default.ensure_default_bundle(bundle)  # missing: built
    bundle.mkdir()
    built_from("an-earlier-shipped-retriever")
    default.ensure_default_bundle(bundle)  # stale weights: rebuilt
    built_from(read_meta(DEFAULT_BI)["content_hash"], recipe="an earlier recipe")
    default.ensure_default_bundle(bundle)  # stale recipe: rebuilt
    built_from(read_meta(DEFAULT_BI)["content_hash"])
    default.ensure_default_bundle(bundle)  # current: kept
    assert built == [bundle, bundle, bundle]


def test_a_shipped_reranker_joins_the_default_with_calibrated_fusion(tmp_path, monkeypatch, tiny_core):
    import json

    from coreply.bundle import FORMAT, MANIFEST
    from index_builder import build, default

    assert default.shipped_cross() is None  # none shipped yet: the default is retrieval only
    monkeypatch.setattr(default, "DEFAULT_CROSS", tiny_core / "cross")
    calls = []
    monkeypatch.setattr(build, "build_bundle", lambda out, texts, **kw: calls.append(kw))
    default.build_default_bundle(tmp_path / "b")
    kw = calls[0]
    assert kw["cross"] == str(tiny_core / "cross") and len(kw["calibration"]) == default.CALIBRATION_PAIRS
    assert kw["calibration"] == kw["lexical_pairs"]  # choices on valid[:2000]; the rest measures
    assert len(kw["prior_pairs"]) == 118_111 and len(kw["guard_pairs"]) == 6_623  # train / valid splits

    built = []
    monkeypatch.setattr(default, "build_default_bundle", built.append)
    bundle = tmp_path / "default-bundle"
    bundle.mkdir()
    bi = {"content_hash": read_meta(DEFAULT_BI)["content_hash"]}
    manifest = {"format": FORMAT, "models": {"bi": bi, "cross": None}, "build": {"command": default.RECIPE}}
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    default.ensure_default_bundle(bundle)  # built without the reranker now shipped: rebuilt
    manifest["models"]["cross"] = {"content_hash": read_meta(tiny_core / "cross")["content_hash"]}
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    default.ensure_default_bundle(bundle)  # current: kept
    assert built == [bundle]
