"""Low-rank adapters: compact checkpoints that rebuild exactly the trained model from the base."""

import json

import pytest
import torch
from conftest import reseal
from tiny import write_tiny_model

from coreply.adapters import add_lora, lora_settings, merge_lora, trainable_state
from coreply.checkpoint import CheckpointError, load_checkpoint, load_dialogue_tokenizer, save_checkpoint
from coreply.checkpoint_meta import SEALING
from coreply.config import ModelConfig
from coreply.models import BiEncoder, CrossEncoder
from training.config import TrainConfig
from training.trainer import Trainer

CONTEXTS = [["hello", "how are you ?"], ["what is your favorite food ?"]]
RESPONSES = ["i am fine", "pizza", "i like music"]


def bi_scores(model):
    return model.embed_contexts(CONTEXTS) @ model.embed_responses(RESPONSES).T


def perturbed_bi(tiny_model_dir, **options) -> BiEncoder:
    """A bi-encoder with adapters whose factors and biases are no longer at their start values."""
    torch.manual_seed(0)
    model = BiEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), **options)).eval()
    add_lora(model, rank=4, alpha=8.0)
    with torch.no_grad():
        for tensor in trainable_state(model).values():
            tensor.add_(torch.randn_like(tensor) * 0.05)
    return model


def test_adapters_start_at_the_base_model_and_train_only_small_tensors(tiny_model_dir):
    model = BiEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir))).eval()
    before = bi_scores(model)
    add_lora(model, rank=4, alpha=8.0)
    assert torch.equal(bi_scores(model), before)  # B = 0 at the start
    names = list(trainable_state(model))
    assert names and all("lora_" in n or n.endswith("bias") or "LayerNorm" in n for n in names), names
    assert not any("word_embeddings" in n for n in names)
    assert lora_settings(model) == {"rank": 4, "alpha": 8.0}


@pytest.mark.parametrize("options", [{}, {"share_towers": True, "normalize": True}])
def test_adapter_checkpoint_is_compact_and_loads_as_the_merged_model(tmp_path, tiny_model_dir, options):
    model = perturbed_bi(tiny_model_dir, **options)
    expected = bi_scores(model)
    save_checkpoint(model, tmp_path / "bi")
    files = json.loads((tmp_path / "bi" / "checkpoint.json").read_text())["files"]
    assert set(files) == {"adapter.safetensors"}  # no base weights, no tokenizer copy
    loaded = load_checkpoint(tmp_path / "bi", expect="bi")
    assert lora_settings(loaded) is None  # merged into plain weights
    assert torch.allclose(bi_scores(loaded), expected, atol=1e-5)
    assert load_dialogue_tokenizer(tmp_path / "bi").contexts(CONTEXTS).input_ids.shape[0] == 2
    merge_lora(model)
    assert torch.allclose(bi_scores(model), expected, atol=1e-5)


def test_adapter_checkpoint_refuses_a_different_base_model(tmp_path, tiny_model_dir):
    save_checkpoint(perturbed_bi(tiny_model_dir), tmp_path / "bi")
    other = write_tiny_model(tmp_path / "other-base", seed=1)
    reseal(tmp_path / "bi", SEALING, lambda meta: meta["model_config"].update(base_model=str(other)))
    with pytest.raises(CheckpointError, match=r"different .* base model"):
        load_checkpoint(tmp_path / "bi")


def core_with_adapters(tmp_path, tiny_model_dir, **kw) -> TrainConfig:
    """A CORE run on the tiny model with rank-4 adapters; ``kw`` overrides."""
    base = dict(
        output_dir=str(tmp_path / "run"),
        model=ModelConfig(base_model=str(tiny_model_dir), dropout=0.0),
        mode="core",
        lora_rank=4,
        num_negatives=3,
        lr=1e-2,
        device="cpu",
    )
    return TrainConfig(**(base | kw))


def test_core_with_adapters_learns_and_saves_compact_checkpoints(tmp_path, tiny_model_dir, toy_pairs):
    cfg = core_with_adapters(
        tmp_path, tiny_model_dir, batch_size=8, max_steps=40, eval_every=20, valid_size=16,
        valid_candidates=4, log_every=20,
    )  # fmt: skip
    trainer = Trainer(cfg, toy_pairs, toy_pairs[:16], sorted({p.response for p in toy_pairs}))
    summary = trainer.fit()
    start = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["valid"]
    assert summary["best_valid_hits@1"]["bi"] > start["bi"]["hits@1"]
    for name, kind in (("bi", BiEncoder), ("cross", CrossEncoder)):
        meta = json.loads((tmp_path / "run" / name / "checkpoint.json").read_text())
        assert meta["adapter"]["rank"] == 4 and "model.safetensors" not in meta["files"]
        assert isinstance(load_checkpoint(tmp_path / "run" / name, expect=name), kind)


def test_a_bundle_serves_an_adapter_checkpoint_through_onnx(tmp_path, tiny_model_dir):
    from conftest import toy_pool

    from coreply.bundle import load_bundle, make_backend
    from index_builder.build import build_bundle

    model = perturbed_bi(tiny_model_dir, share_towers=True, normalize=True)
    save_checkpoint(model, tmp_path / "bi")
    build_bundle(tmp_path / "b", toy_pool(), bi=str(tmp_path / "bi"), onnx="fp32", progress=False)
    backend = make_backend(load_bundle(tmp_path / "b"), backend="onnx")
    onnx_scores = backend.encode_contexts(CONTEXTS) @ backend.encode_responses(RESPONSES).T
    assert torch.allclose(torch.from_numpy(onnx_scores), bi_scores(model), atol=1e-4)


def test_adapters_load_on_a_base_carried_in_fp16_but_not_on_a_changed_one(tmp_path, tiny_model_dir):
    """A GPU host gets the base weights in fp16 (half the bytes to carry): adapters trained there or
    here load on either copy; a base whose weights really differ is still refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    save_checkpoint(perturbed_bi(tiny_model_dir), tmp_path / "bi")
    for name, change in (("carried", 0.0), ("changed", 1e-2)):
        base = tmp_path / name
        shutil.copytree(tiny_model_dir, base)
        tensors = {k: v.half().float() for k, v in load_file(base / "model.safetensors").items()}
        first = sorted(tensors)[0]
        tensors[first] = tensors[first] + change
        save_file(tensors, base / "model.safetensors")
        assert (base / "model.safetensors").read_bytes() != (
            tiny_model_dir / "model.safetensors"
        ).read_bytes()
        reseal(tmp_path / "bi", SEALING, lambda meta, b=base: meta["model_config"].update(base_model=str(b)))
        if change:
            with pytest.raises(CheckpointError, match=r"different .* base model"):
                load_checkpoint(tmp_path / "bi")
        else:
            assert load_checkpoint(tmp_path / "bi").kind == "bi"


def test_the_reranker_can_train_every_weight_beside_a_retriever_with_adapters(
    tmp_path, tiny_model_dir, toy_pairs
):
    cfg = core_with_adapters(
        tmp_path, tiny_model_dir, cross_lora_rank=0, cross_lr=1e-3, batch_size=4, max_steps=2,
        valid_size=0, warmup_ratio=0.0, log_every=1,  # valid_size 0: the last weights are kept
    )  # fmt: skip
    trainer = Trainer(cfg, toy_pairs, [], sorted({p.response for p in toy_pairs}))
    assert [g["lr"] for g in trainer.optimizers["bi"].param_groups] == [1e-2]
    assert [g["lr"] for g in trainer.optimizers["cross"].param_groups] == [1e-3]
    trainer.fit()
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["lr"] > logged["cross_lr"] > 0
    bi = json.loads((tmp_path / "run" / "bi" / "checkpoint.json").read_text())
    cross = json.loads((tmp_path / "run" / "cross" / "checkpoint.json").read_text())
    assert bi["adapter"]["rank"] == 4 and "adapter" not in cross and "model.safetensors" in cross["files"]
    # the word embeddings, frozen under adapters, trained in the reranker
    base = CrossEncoder.from_pretrained(cfg.model)
    trained = load_checkpoint(tmp_path / "run" / "cross", expect="cross")
    name = next(n for n, _ in base.named_parameters() if "word_embeddings" in n)
    assert not torch.equal(dict(base.named_parameters())[name], dict(trained.named_parameters())[name])


def cross_scores(model):
    return model.score_pairs([c for c in CONTEXTS for _ in RESPONSES], RESPONSES * len(CONTEXTS))


def test_a_reranker_trained_in_full_ships_as_adapters_that_keep_its_low_rank_change(tmp_path, tiny_model_dir):
    """``coreply compact``: each linear weight's change, here of rank 2, is kept exactly by rank-2
    adapters stored in fp16; biases, norms, the head and the position and token-type embeddings are
    copied; the word embeddings' change is dropped."""
    from cli.main import main
    from coreply.adapters import extract_lora

    torch.manual_seed(0)
    config = ModelConfig(base_model=str(tiny_model_dir))
    tuned = CrossEncoder.from_pretrained(config).eval()
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if param.dim() == 2 and "embeddings" not in name and "backbone" in name:
                out, inp = param.shape
                param.add_(torch.randn(out, 2) @ torch.randn(2, inp) * 0.05)  # a rank-2 change
            else:
                param.add_(torch.randn_like(param) * 0.05)
    save_checkpoint(tuned, tmp_path / "full")
    compact = CrossEncoder.from_pretrained(config).eval()
    kept = extract_lora(compact, tuned, rank=2)
    with torch.no_grad():  # the reference: the change it keeps, all but the word embeddings'
        for name, param in tuned.named_parameters():
            if name.endswith("word_embeddings.weight"):
                param.copy_(dict(compact.named_parameters())[name])
    assert kept["kept"] == pytest.approx(1.0) and kept["worst_kept"] == pytest.approx(1.0, abs=1e-4)
    assert kept["embedding_change"] > 0.01
    expected = cross_scores(tuned)
    assert torch.allclose(cross_scores(compact), expected, atol=1e-4)
    assert extract_lora(CrossEncoder.from_pretrained(config), tuned, rank=1)["kept"] < 0.9

    assert main(["compact", str(tmp_path / "full"), "-o", str(tmp_path / "small"), "--rank", "2"]) == 0
    meta = json.loads((tmp_path / "small" / "checkpoint.json").read_text())
    assert set(meta["files"]) == {"adapter.safetensors"} and meta["adapter"]["rank"] == 2
    small = (tmp_path / "small" / "adapter.safetensors").stat().st_size
    assert small < (tmp_path / "full" / "model.safetensors").stat().st_size / 2
    loaded = load_checkpoint(tmp_path / "small", expect="cross")
    spread = float(expected.max() - expected.min())
    assert (cross_scores(loaded) - expected).abs().max() < 1e-2 * spread  # fp16 factors
    assert main(["compact", str(tmp_path / "small"), "-o", str(tmp_path / "again")]) == 2
    assert main(["compact", str(tmp_path / "full"), "-o", str(tmp_path / "big"), "--rank", "999"]) == 2


def compact_reranker(tmp_path, tiny_model_dir) -> str:
    """A reranker fine-tuned in full (its position and token-type tables too), compacted to rank-2
    adapters as the shipped one was: the tables are stored whole beside the adapters."""
    from coreply.adapters import extract_lora

    torch.manual_seed(0)
    config = ModelConfig(base_model=str(tiny_model_dir), dropout=0.0)
    tuned = CrossEncoder.from_pretrained(config).eval()
    with torch.no_grad():
        for param in tuned.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    compact = CrossEncoder.from_pretrained(config).eval()
    extract_lora(compact, tuned, rank=2)
    save_checkpoint(compact, tmp_path / "compact")
    return str(tmp_path / "compact")


def test_adapters_trained_on_from_a_compact_checkpoint_keep_its_embedding_tables(tmp_path, tiny_model_dir):
    """``--init-cross builtin --cross-lora-rank 32`` loads the shipped reranker's adapters unmerged and
    trains them on. Its position and token-type tables stay frozen, but a checkpoint saved from it must
    store them: without them it loads over the base model's tables, another reranker (a run's saved
    reranker once scored 24.6 hits@1 where the same weights had validated at 40.6)."""
    source = compact_reranker(tmp_path, tiny_model_dir)
    expected = cross_scores(load_checkpoint(source, expect="cross"))
    unmerged = load_checkpoint(source, expect="cross", merge=False)
    tables = [
        "backbone.embeddings.position_embeddings.weight",
        "backbone.embeddings.token_type_embeddings.weight",
    ]
    assert not any(unmerged.get_parameter(t).requires_grad for t in tables)  # frozen, as trained
    save_checkpoint(unmerged, tmp_path / "again")  # what a run saves at step 0, or one that trained nothing
    assert torch.allclose(
        cross_scores(load_checkpoint(tmp_path / "again", expect="cross")), expected, atol=1e-5
    )


def test_a_run_saves_the_reranker_it_validated(tmp_path, tiny_model_dir, toy_pairs):
    """The reranker a run keeps scores its validation lists as the run recorded when it kept it, here for
    adapters trained on from a compact checkpoint."""
    from evaluation.protocols import evaluate_lists

    source = compact_reranker(tmp_path, tiny_model_dir)
    cfg = core_with_adapters(
        tmp_path, tiny_model_dir, init_cross=source, cross_lora_rank=2, batch_size=8, max_steps=4,
        eval_every=2, valid_size=16, valid_candidates=4, log_every=2,
    )  # fmt: skip
    trainer = Trainer(cfg, toy_pairs, toy_pairs[:16], sorted({p.response for p in toy_pairs}))
    trainer.fit()
    saved = tmp_path / "run" / "cross"
    recorded = json.loads((saved / "checkpoint.json").read_text())["extra"]["valid"]["cross"]
    again = evaluate_lists(
        trainer.valid_pairs, trainer.valid_lists, None, load_checkpoint(saved, expect="cross")
    )
    assert again["cross"]["metrics"]["mrr"] == pytest.approx(recorded["mrr"], abs=1e-6)
