"""Dial-MAE post-training on the tiny model: masking, the decoder's dependence on the context vector,
learning, and the checkpoint that `coreply train --init-bi` starts from."""

import json

import pytest
import torch

from coreply.checkpoint import load_checkpoint
from coreply.config import ModelConfig
from coreply.models import BiEncoder
from training.dialmae import DialMAE, DialMAEConfig, mask_tokens, pretrain


def test_masking_hides_the_asked_share_of_maskable_tokens_only():
    ids = torch.arange(1, 2001).reshape(4, 500)
    maskable = torch.ones_like(ids, dtype=torch.bool)
    maskable[:, 0] = maskable[:, -1] = False  # [CLS] ... [SEP]
    maskable[3] = False  # a row of specials only
    masked, labels = mask_tokens(ids, maskable, 0.3, 0, torch.Generator().manual_seed(0))
    chosen = masked == 0
    assert not chosen[~maskable].any() and not chosen[3].any()
    assert 0.25 < chosen[:3].float().mean() < 0.35
    assert torch.equal(labels[chosen], ids[chosen]) and (labels[~chosen] == -100).all()
    one, _ = mask_tokens(ids[:1, :3], maskable[:1, :3], 1e-9, 0, torch.Generator().manual_seed(0))
    assert (one == 0).sum() == 1  # at least one token per row, or the loss would be empty


def test_the_decoder_learns_through_the_context_vector(tiny_model_dir):
    """The decoder loss reaches the encoder only through the pooled context vector: its gradient flows
    into the encoder's layers, and a different context changes the decoder's loss."""
    bi = BiEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), dropout=0.0))
    model = DialMAE(bi, decoder_layers=1).eval()
    ctx = bi.tokenizer.contexts([["do you have a pet ?"], ["what music do you like ?"]])
    resp = bi.tokenizer.responses(["yes i have a dog", "yes i have a dog"])
    no_mask = torch.full_like(ctx.input_ids, -100)
    labels = resp.input_ids.masked_fill(resp.attention_mask == 0, -100)
    labels[:, 0] = -100
    _, dec = model(ctx.input_ids, ctx.attention_mask, no_mask, resp.input_ids, resp.attention_mask, labels)
    dec.backward()
    layer = bi.context_tower.encoder.layer[-1]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    with torch.no_grad():
        per_row = [
            model(ctx.input_ids[i : i + 1], ctx.attention_mask[i : i + 1], no_mask[i : i + 1],
                  resp.input_ids[:1], resp.attention_mask[:1], labels[:1])[1]
            for i in range(2)
        ]  # fmt: skip
    assert not torch.isclose(per_row[0], per_row[1])


def test_pretraining_lowers_both_losses_and_saves_an_encoder_train_can_start_from(
    tmp_path, tiny_model_dir, toy_pairs
):
    from conftest import train_toy

    out = tmp_path / "mae"
    config = DialMAEConfig(
        output_dir=str(out), model=ModelConfig(base_model=str(tiny_model_dir)), max_steps=60, batch_size=16,
        lr=3e-3, log_every=10, device="cpu",
    )  # fmt: skip
    summary = pretrain(config, toy_pairs)
    curve = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert curve[-1]["enc_mlm"] < curve[0]["enc_mlm"] and curve[-1]["dec_mlm"] < curve[0]["dec_mlm"]
    assert summary["steps"] == 60
    # the diagnostic is reported (on this toy task the two are equal: the decoder guesses the 8 replies from
    # their unmasked words and positions and ignores the vector, see docs/results.md §11)
    assert 0 < summary["decoder_mlm_own_context"] < 20 and 0 < summary["decoder_mlm_other_context"] < 20
    post = load_checkpoint(out / "bi", expect="bi")
    base = BiEncoder.from_pretrained(config.model)
    word = "embeddings.word_embeddings.weight"
    tower = post.context_tower.state_dict()
    assert not torch.equal(tower[word], base.context_tower.state_dict()[word])  # it did change
    assert all(torch.equal(v, post.response_tower.state_dict()[k]) for k, v in tower.items())  # both towers
    run = train_toy(tmp_path / "ft", config.model, toy_pairs, mode="independent", models="bi",
                    init_bi=str(out / "bi"), max_steps=4, eval_every=4)  # fmt: skip
    assert run["steps"] == 4


@pytest.mark.parametrize(("field", "value"), [("enc_mask", 0.0), ("dec_mask", 1.0), ("decoder_layers", 0)])
def test_nonsense_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')}"):
        DialMAEConfig(**{field: value})


def test_coreply_pretrain_command(tmp_path, tiny_model_dir, toy_pairs, capsys):
    from cli.main import main

    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(json.dumps({"context": list(p.context), "response": p.response}) + "\n" for p in toy_pairs)
    )
    argv = ["pretrain", "--data", str(data), "-o", str(tmp_path / "mae"), "--base-model", str(tiny_model_dir)]
    argv += ["--max-steps", "3", "--batch-size", "4", "--device", "cpu"]
    assert main(argv) == 0
    assert f"coreply train --init-bi {tmp_path / 'mae' / 'bi'}" in capsys.readouterr().out
    assert main(argv) == 2 and "already holds a post-trained encoder" in capsys.readouterr().err
