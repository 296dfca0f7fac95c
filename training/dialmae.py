"""Dial-MAE post-training (``../shared/papers/dial-mae.md``): teach the retriever's encoder to put what a
reply needs into its one context vector, before contrastive fine-tuning.

* The encoder (the bi-encoder's context tower) reads the context with ``enc_mask`` of its tokens masked
  and predicts them (MLM).
* A shallow decoder (``decoder_layers`` fresh transformer layers) reads the *response* with ``dec_mask``
  of its tokens masked, its first position replaced by the context vector, and predicts the masked
  response tokens. With few layers and most of the response hidden, it must lean on that vector.
* Loss = encoder MLM + decoder MLM (paper Eq. 4). One MLM head, tied to the word embeddings, serves both.

The context vector is the model's own pooling (``ModelConfig.pooling``; the paper's [CLS] when
``--pooling cls``): the vector retrieval will use is the one trained to carry the reply. Afterwards the
decoder and the head are dropped and the encoder initialises both towers (``coreply train --init-bi``).
Paper settings for English (Ubuntu): masks 30 % / 75 %, one decoder layer, lr 3e-4, warm-up 10 %."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from coreply.artifacts import write_json_atomic
from coreply.checkpoint import save_checkpoint
from coreply.config import ModelConfig
from coreply.corpus import Pair
from coreply.device import autocast, resolve_device
from coreply.models import BiEncoder, pool
from training.config import check_fields


@dataclass
class DialMAEConfig:
    output_dir: str = "runs/dial-mae"
    model: ModelConfig = field(default_factory=ModelConfig)
    enc_mask: float = 0.30
    dec_mask: float = 0.75
    decoder_layers: int = 1
    batch_size: int = 16
    lr: float = 3e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    max_steps: int = 1000
    grad_clip: float = 1.0
    seed: int = 42
    log_every: int = 10
    device: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = ModelConfig.from_dict(self.model)
        check_fields(
            self,
            share=("enc_mask", "dec_mask"),
            at_least_one=("decoder_layers", "batch_size", "max_steps", "log_every"),
            positive=("lr", "grad_clip"),
            non_negative=("weight_decay",),
            fraction=("warmup_ratio",),
        )


def mask_tokens(
    ids: torch.Tensor, maskable: torch.Tensor, rate: float, mask_id: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, L], maskable [N, L] bool -> (ids with ``rate`` of the maskable tokens replaced by
    ``mask_id``, labels [N, L]: the original id where masked, -100 elsewhere). At least one token per row
    is masked when the row has any maskable token."""
    draw = torch.rand(ids.shape, generator=generator) < rate  # [N, L]
    first = maskable.float().argmax(1)  # [N]: a row's first maskable position
    rows = maskable.any(1) & ~(draw & maskable).any(1)
    draw[rows.nonzero().squeeze(1), first[rows]] = True
    chosen = draw & maskable
    return ids.masked_fill(chosen, mask_id), ids.masked_fill(~chosen, -100)


class DialMAE(nn.Module):
    """The post-training model around a bi-encoder's context tower."""

    def __init__(self, bi: BiEncoder, decoder_layers: int) -> None:
        super().__init__()
        self.bi = bi
        hf = bi.context_tower.config
        hidden = hf.hidden_size
        self.transform = nn.Sequential(  # BERT's MLM transform; the output layer is the word embeddings
            nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden, eps=hf.layer_norm_eps)
        )
        self.vocab_bias = nn.Parameter(torch.zeros(hf.vocab_size))
        self.decoder = nn.ModuleList(
            nn.TransformerEncoderLayer(
                hidden,
                hf.num_attention_heads,
                hf.intermediate_size,
                dropout=hf.hidden_dropout_prob,
                activation="gelu",
                batch_first=True,
                layer_norm_eps=hf.layer_norm_eps,
            )
            for _ in range(decoder_layers)
        )

    def _mlm_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """hidden [N, L, H], labels [N, L] -> mean cross-entropy over the masked positions."""
        picked = hidden[labels != -100]  # [M, H]
        words = self.bi.context_tower.get_input_embeddings().weight  # [V, H]
        logits = self.transform(picked) @ words.T + self.vocab_bias  # [M, V]
        return nn.functional.cross_entropy(logits.float(), labels[labels != -100])

    def forward(
        self,
        context_ids: torch.Tensor,
        context_mask: torch.Tensor,
        context_labels: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        response_labels: torch.Tensor,
        other_context: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked context [N, Lc] and masked response [N, Lr] (with their masks and labels) -> (encoder
        MLM loss, decoder MLM loss). ``other_context``: each response gets the next row's context vector
        (a diagnostic: how much the decoder relies on the right one)."""
        tower = self.bi.context_tower
        hidden = tower(input_ids=context_ids, attention_mask=context_mask).last_hidden_state  # [N, Lc, H]
        vector = pool(hidden, context_mask, self.bi.config.pooling)  # [N, H]
        if other_context:
            vector = vector.roll(1, dims=0)
        words = tower.embeddings(input_ids=response_ids)  # [N, Lr, H]
        x = torch.cat([vector[:, None].to(words.dtype), words[:, 1:]], dim=1)  # [N, Lr, H]
        padding = response_mask == 0  # [N, Lr]
        for layer in self.decoder:
            x = layer(x, src_key_padding_mask=padding)
        return self._mlm_loss(hidden, context_labels), self._mlm_loss(x, response_labels)


def pretrain(config: DialMAEConfig, pairs: Sequence[Pair]) -> dict[str, Any]:
    """Post-train ``config.model``'s encoder on ``pairs`` (context -> response) and save it as a bi-encoder
    checkpoint ``output_dir/bi`` whose two towers both start from it. Returns the run's summary."""
    from training.trainer import warmup_linear

    if not pairs:
        raise ValueError("Dial-MAE needs dialogue pairs to post-train on")
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    bi = BiEncoder.from_pretrained(config.model).to(device).train()
    model = DialMAE(bi, config.decoder_layers).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    schedule = warmup_linear(optimizer, config.max_steps, config.warmup_ratio)
    special = torch.tensor(sorted(set(bi.tokenizer.hf.all_special_ids)))
    mask_id = bi.tokenizer.hf.mask_token_id
    rng = np.random.default_rng([config.seed, 13])
    generator = torch.Generator().manual_seed(config.seed)

    def masked(batch: Sequence[Pair], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        """The model's inputs for ``batch``, masked at the configured rates, on the device."""
        ctx = bi.tokenizer.contexts([p.context for p in batch])
        resp = bi.tokenizer.responses([p.response for p in batch])
        ctx_ids, ctx_labels = mask_tokens(
            ctx.input_ids, ~torch.isin(ctx.input_ids, special), config.enc_mask, mask_id, gen
        )
        resp_ids, resp_labels = mask_tokens(
            resp.input_ids, ~torch.isin(resp.input_ids, special), config.dec_mask, mask_id, gen
        )
        tensors = (ctx_ids, ctx.attention_mask, ctx_labels, resp_ids, resp.attention_mask, resp_labels)
        return tuple(t.to(device) for t in tensors)

    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "pretrain_config.json", json.loads(json.dumps(asdict(config))))
    started, window = time.perf_counter(), []
    with open(out / "metrics.jsonl", "w") as log:
        for step in range(1, config.max_steps + 1):
            chosen = rng.choice(len(pairs), size=min(config.batch_size, len(pairs)), replace=False)
            with autocast(device):
                enc_loss, dec_loss = model(*masked([pairs[i] for i in chosen], generator))
            optimizer.zero_grad(set_to_none=True)
            (enc_loss + dec_loss).backward()
            nn.utils.clip_grad_norm_(params, config.grad_clip)
            optimizer.step()
            schedule.step()
            window.append((enc_loss.item(), dec_loss.item()))
            if step % config.log_every == 0 or step == config.max_steps:
                enc, dec = np.mean(window, axis=0)
                last = {"step": step, "enc_mlm": round(float(enc), 4), "dec_mlm": round(float(dec), 4)}
                log.write(json.dumps(last) + "\n")
                window = []
    # Does the decoder read the context vector? Its loss with each reply's own context vs another's, on
    # a fixed sample (same masks for both; dropout off).
    model.eval()
    sample = [pairs[i] for i in np.random.default_rng([config.seed, 17]).permutation(len(pairs))[:256]]
    losses: dict[bool, list[float]] = {False: [], True: []}
    with torch.no_grad(), autocast(device):
        for start in range(0, len(sample), config.batch_size):
            inputs = masked(sample[start : start + config.batch_size], torch.Generator().manual_seed(start))
            for other in (False, True):
                losses[other].append(model(*inputs, other_context=other)[1].item())
    if not config.model.share_towers:  # both towers start from the post-trained encoder
        bi.response_tower.load_state_dict(bi.context_tower.state_dict())
    summary = {
        "objective": "dial-mae",
        "steps": config.max_steps,
        "examples_seen": config.max_steps * min(config.batch_size, len(pairs)),
        "train_seconds": round(time.perf_counter() - started, 1),
        "last": last,
        "decoder_mlm_own_context": round(float(np.mean(losses[False])), 4),
        "decoder_mlm_other_context": round(float(np.mean(losses[True])), 4),
        "device": str(device),
    }
    save_checkpoint(bi.eval(), out / "bi", {"pretrain": summary, "pretrain_config": asdict(config)})
    write_json_atomic(out / "summary.json", summary)
    return summary
