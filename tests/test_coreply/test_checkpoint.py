import json

import pytest
import torch

from coreply.checkpoint import CheckpointError, load_checkpoint, read_meta, save_checkpoint
from coreply.config import ModelConfig
from coreply.models import BiEncoder, CrossEncoder

CONTEXTS = [["hello", "how are you ?"], ["what is your favorite food ?"]]
RESPONSES = ["i am fine", "pizza", "i like music"]


def bi_scores(model):
    return model.embed_contexts(CONTEXTS) @ model.embed_responses(RESPONSES).T


def cross_scores(model):
    return model.score_pairs([CONTEXTS[0]] * 3, RESPONSES)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"share_towers": True, "normalize": True},
        {"projection_dim": 8, "pooling": "cls"},
    ],
)
def test_bi_encoder_load_save_load_gives_identical_scores(tmp_path, tiny_model_dir, options):
    model = BiEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), **options)).eval()
    first = save_checkpoint(model, tmp_path / "a")
    loaded = load_checkpoint(tmp_path / "a", expect="bi")
    save_checkpoint(loaded, tmp_path / "b")
    again = load_checkpoint(tmp_path / "b")
    assert torch.equal(bi_scores(model), bi_scores(loaded))
    assert torch.equal(bi_scores(loaded), bi_scores(again))
    assert first == again.content_hash == loaded.content_hash
    assert loaded.config == model.config


def test_towers_are_independent_unless_shared(tiny_model_dir):
    separate = BiEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir)))
    shared = BiEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), share_towers=True))
    assert separate.context_tower is not separate.response_tower
    assert shared.context_tower is shared.response_tower


def test_cross_encoder_round_trip_and_kind_check(tmp_path, tiny_model_dir):
    model = CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir))).eval()
    save_checkpoint(model, tmp_path / "c", extra={"note": "x"})
    loaded = load_checkpoint(tmp_path / "c")
    assert torch.equal(cross_scores(model), cross_scores(loaded))
    assert read_meta(tmp_path / "c")["extra"] == {"note": "x"}
    with pytest.raises(CheckpointError, match="is a cross-encoder checkpoint, expected a bi-encoder"):
        load_checkpoint(tmp_path / "c", expect="bi")


def test_corrupted_missing_or_extra_files_are_refused(tmp_path, tiny_model_dir):
    model = CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir)))
    root = tmp_path / "c"
    save_checkpoint(model, root)
    weights = root / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model.safetensors: corrupted"):
        load_checkpoint(root)
    save_checkpoint(model, root)
    (root / "stray.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"stray.bin: unexpected"):
        load_checkpoint(root)
    save_checkpoint(model, root)
    (root / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer.json: missing"):
        load_checkpoint(root)
    save_checkpoint(model, root)
    meta = json.loads((root / "checkpoint.json").read_text())
    meta["model_config"]["max_turns"] = 1  # reads contexts differently, every weight the same
    (root / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"content_hash does not match the files and fields"):
        load_checkpoint(root)
    meta["format"] = "something-else"
    (root / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="unsupported format"):
        load_checkpoint(root)
    with pytest.raises(CheckpointError, match="not a coreply checkpoint"):
        load_checkpoint(tmp_path)


def test_save_replaces_atomically_and_leaves_no_temporary_files(tmp_path, tiny_model_dir):
    model = CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir)))
    save_checkpoint(model, tmp_path / "c")
    save_checkpoint(model, tmp_path / "c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    model = CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir)))
    save_checkpoint(model, tmp_path / "c")
    before = read_meta(tmp_path / "c")["content_hash"]

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("coreply.checkpoint.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(model, tmp_path / "c")
    assert read_meta(tmp_path / "c")["content_hash"] == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_score_scale_scales_context_embeddings_and_survives_a_round_trip(tmp_path, tiny_model_dir):
    config = ModelConfig(base_model=str(tiny_model_dir), share_towers=True, normalize=True, score_scale=20.0)
    bi = BiEncoder.from_pretrained(config).eval()
    contexts, responses = [["hello", "how are you ?"]], ["i am fine", "pizza"]
    norms = bi.embed_contexts(contexts).norm(dim=-1)
    assert torch.allclose(norms, torch.full_like(norms, 20.0), atol=1e-4)
    assert torch.allclose(bi.embed_responses(responses).norm(dim=-1), torch.ones(2), atol=1e-4)
    save_checkpoint(bi, tmp_path / "bi")
    loaded = load_checkpoint(tmp_path / "bi", expect="bi")
    assert loaded.config.score_scale == 20.0
    assert torch.allclose(loaded.embed_contexts(contexts), bi.embed_contexts(contexts), atol=1e-5)
    with pytest.raises(ValueError, match="score_scale"):
        ModelConfig(score_scale=0.0)


def test_num_layers_keeps_the_first_layers_and_survives_a_round_trip(tmp_path, tiny_model_dir):
    full = CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir))).eval()
    cut = CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), num_layers=1)).eval()
    assert len(full.backbone.encoder.layer) == 2 and len(cut.backbone.encoder.layer) == 1
    pairs = cut.tokenizer.pairs([CONTEXTS[0]] * 3, RESPONSES)
    inputs = {
        "input_ids": pairs.input_ids,
        "attention_mask": pairs.attention_mask,
        "token_type_ids": pairs.token_type_ids,
    }
    with torch.inference_mode():
        after_first = full.backbone(**inputs, output_hidden_states=True).hidden_states[1]  # [N, L, H]
        own = cut.backbone(**inputs).last_hidden_state  # [N, L, H]
    assert torch.allclose(own, after_first, atol=1e-6)
    save_checkpoint(cut, tmp_path / "c")
    loaded = load_checkpoint(tmp_path / "c", expect="cross")
    assert len(loaded.backbone.encoder.layer) == 1 and loaded.config.num_layers == 1
    assert torch.equal(cross_scores(cut), cross_scores(loaded))
    with pytest.raises(ValueError, match="has only 2 layers"):
        CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), num_layers=3))


def test_match_head_scores_the_scaled_cosine_of_its_segment_means_and_round_trips(tmp_path, tiny_model_dir):
    """``cross_head="match"``: 20 x cos(mean of the context segment, mean of the response segment) of the
    joint encoding, the same alone as in a padded batch, and kept by a checkpoint."""
    model = CrossEncoder.from_pretrained(
        ModelConfig(base_model=str(tiny_model_dir), cross_head="match")
    ).eval()
    pairs = model.tokenizer.pairs([CONTEXTS[0]] * 3, RESPONSES)
    with torch.inference_mode():
        hidden = model.backbone(
            input_ids=pairs.input_ids,
            attention_mask=pairs.attention_mask,
            token_type_ids=pairs.token_type_ids,
        ).last_hidden_state  # [3, L, H]
        got = model(pairs)
    for i in range(3):
        kept = pairs.attention_mask[i].bool()
        segment = pairs.token_type_ids[i][kept]
        context, response = hidden[i][kept][segment == 0], hidden[i][kept][segment == 1]
        want = 20 * torch.cosine_similarity(context.mean(0), response.mean(0), dim=0)
        assert got[i].item() == pytest.approx(want.item(), abs=1e-4)
        alone = model(model.tokenizer.pairs([CONTEXTS[0]], [RESPONSES[i]]))
        assert alone.item() == pytest.approx(got[i].item(), abs=1e-4)  # padding does not count
    save_checkpoint(model, tmp_path / "m")
    loaded = load_checkpoint(tmp_path / "m")
    assert loaded.config.cross_head == "match"
    assert torch.equal(cross_scores(model), cross_scores(loaded))
    with pytest.raises(ValueError, match="cross_head must be 'mlp' or 'match'"):
        ModelConfig(cross_head="dot")
