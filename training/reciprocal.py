"""Knowledge-grounded ranking trained by reciprocal learning (RecKGC,
``../shared/papers/reckgc-knowledge-grounded.md``), and its baselines at the same budget.

A knowledge retriever phi (one shared encoder for context and knowledge, Eq. 1) picks the top-m of a
pair's knowledge sentences; the response ranker theta (a cross-encoder reading ``[CLS] k1 [SEP] ... km
[SEP] context [SEP] r [SEP]``, Eq. 3) ranks the gold among sampled negatives. Per step (Algorithm 1):

1. top-m by the current phi (no gradient);
2. L_theta = -log p(r+ | C, K_bar) over the candidate list (Eq. 5, 8); update theta;
3. the ranker's feedback for each picked sentence k_t, with the context removed and no gradient into
   theta: w_t = p(r+ | k_t) + rho(k_t, r+) (Eq. 10; rho = unigram F1); phi's distribution over the top-m
   p(k_t | C) = softmax(s(C, k_t) / tau) (Eq. 11); L_phi = -log sum_t w_t p(k_t | C) (Eq. 9, 12); update phi.

``knowledge`` chooses what the ranker reads: ``reciprocal`` (the above), ``frozen`` (phi's picks, phi never
trained: the two-stage baseline with an off-the-shelf retriever), ``all`` (every sentence in the given
order, cut at the ranker's knowledge budget; no retriever) or ``none`` (the ranker reads no knowledge).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_checkpoint, save_checkpoint
from coreply.corpus import NegativeSampler, Pair
from coreply.device import autocast, resolve_device
from coreply.knowledge import KnowledgeSelector
from coreply.models import BiEncoder, CrossEncoder
from coreply.text import unigram_f1
from training.config import GroundedConfig


def _ranker(config: GroundedConfig, device: torch.device) -> CrossEncoder:
    """A fresh ranker, or ``init_cross`` with this run's knowledge budget."""
    wanted = config.ranker_config()
    if not config.init_cross:
        return CrossEncoder.from_pretrained(wanted).to(device)
    cross = load_checkpoint(config.init_cross, device, expect="cross", merge=True)
    cross.config = replace(cross.config, max_knowledge_tokens=wanted.max_knowledge_tokens)
    cross.tokenizer.config = cross.config
    return cross  # type: ignore[return-value]


def _retriever(config: GroundedConfig, device: torch.device) -> BiEncoder:
    if config.init_retriever:
        return load_checkpoint(config.init_retriever, device, expect="bi", merge=True)  # type: ignore[return-value]
    return BiEncoder.from_pretrained(config.retriever_config()).to(device)


def top_m(retriever: BiEncoder, pairs: Sequence[Pair], m: int) -> list[tuple[str, ...]]:
    """The retriever's current top-m per pair (a fresh selector: phi changes every step)."""
    retriever.eval()
    return KnowledgeSelector(retriever, m)([p.context for p in pairs], [p.knowledge for p in pairs])


def ranker_feedback(
    ranker: CrossEncoder, picked: Sequence[tuple[str, ...]], lists: Sequence[Sequence[str]], feedback: str
) -> list[torch.Tensor]:
    """Per pair, w_t for each picked sentence [m_b] (Eq. 10): p(r+ | k_t) over the pair's candidate list
    with the context removed, plus the unigram F1 of k_t and the gold (``feedback`` may keep only one)."""
    flat_k, flat_r = [], []
    for sentences, candidates in zip(picked, lists, strict=True):
        for k in sentences:
            flat_k += [(k,)] * len(candidates)
            flat_r += list(candidates)
    probs: list[torch.Tensor] = []
    if feedback != "f1" and flat_r:
        was = ranker.training
        ranker.eval()
        scores = ranker.score_pairs([()] * len(flat_r), flat_r, flat_k)  # [sum_b m_b * n_b]
        ranker.train(was)
        start = 0
        for sentences, candidates in zip(picked, lists, strict=True):
            n = len(candidates)
            block = scores[start : start + len(sentences) * n].view(len(sentences), n)  # [m_b, n]
            probs.append(torch.softmax(block, dim=-1)[:, 0])
            start += len(sentences) * n
    out = []
    for b, (sentences, candidates) in enumerate(zip(picked, lists, strict=True)):
        w = torch.zeros(len(sentences))
        if feedback != "f1":
            w += probs[b]
        if feedback != "ranker":
            w += torch.tensor([unigram_f1(k, candidates[0]) for k in sentences])
        out.append(w)
    return out


def retriever_loss(
    retriever: BiEncoder,
    pairs: Sequence[Pair],
    picked: Sequence[tuple[str, ...]],
    weights: Sequence[torch.Tensor],
    tau: float,
) -> torch.Tensor | None:
    """L_phi (Eq. 12) averaged over the pairs with at least two picked sentences (with one, the top-m
    softmax is constant); None when there are none."""
    rows = [b for b, k in enumerate(picked) if len(k) > 1]
    if not rows:
        return None
    tok, device = retriever.tokenizer, retriever.device
    contexts = retriever.encode_context(tok.contexts([pairs[b].context for b in rows]).to(device))  # [B', D]
    sentences = [k for b in rows for k in picked[b]]
    vectors = retriever.encode_response(tok.responses(sentences).to(device))  # [sum m_b, D]
    scale = 1 / math.sqrt(vectors.shape[-1])
    losses, start = [], 0
    for i, b in enumerate(rows):
        m = len(picked[b])
        s = (vectors[start : start + m].float() @ contexts[i].float()) * scale  # [m_b], Eq. 1
        log_p = torch.log_softmax(s / tau, dim=0)  # Eq. 11
        w = weights[b].to(device).clamp(min=1e-8)
        losses.append(-torch.logsumexp(torch.log(w) + log_p, dim=0))  # Eq. 12
        start += m
    return torch.stack(losses).mean()


def train_grounded(
    config: GroundedConfig, train: Sequence[Pair], valid: Sequence[Pair], command: str = ""
) -> dict[str, Any]:
    """Train the ranker (and, for ``reciprocal``, the knowledge retriever) and save ``output_dir/cross``
    (+ ``output_dir/knowledge``, the retriever, when one picks the knowledge) at the best validation
    hits@1. Returns the summary."""
    from evaluation.grounded import grounded_ranks
    from evaluation.metrics import summarize
    from evaluation.protocols import protocol_a_lists
    from training.trainer import warmup_linear

    if not train:
        raise ValueError("grounded training needs training pairs")
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    rng = np.random.default_rng([config.seed, 7])
    sampler = NegativeSampler([p.response for p in train])
    negatives = min(config.num_negatives, sampler.capacity)
    ranker = _ranker(config, device).train()
    retriever = _retriever(config, device) if config.uses_retriever else None
    optimizers = [torch.optim.AdamW(ranker.parameters(), lr=config.lr, weight_decay=config.weight_decay)]
    learns = config.knowledge == "reciprocal"
    if learns and retriever is not None:
        optimizers.append(
            torch.optim.AdamW(
                retriever.parameters(), lr=config.retriever_lr, weight_decay=config.weight_decay
            )
        )
    schedules = [warmup_linear(o, config.max_steps, config.warmup_ratio) for o in optimizers]
    valid = list(valid[: config.valid_size])
    valid_lists = (
        protocol_a_lists(valid, [p.response for p in valid], config.valid_candidates) if valid else []
    )

    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "grounded_config.json", json.loads(json.dumps(asdict(config))))
    provenance = {"grounded_config": asdict(config), "command": command}
    best: dict[str, Any] = {"hits@1": -1.0, "step": 0}

    def validate(step: int) -> dict[str, float]:
        ranks = grounded_ranks(ranker, retriever, valid, valid_lists, config.top_m)
        metrics = summarize(ranks)
        if metrics["hits@1"] > best["hits@1"]:
            best.update({"hits@1": metrics["hits@1"], "mrr": metrics["mrr"], "step": step})
            save_checkpoint(ranker, out / "cross", provenance)
            if retriever is not None:
                save_checkpoint(retriever, out / "knowledge", provenance)
        ranker.train()
        return metrics

    started = time.perf_counter()
    ranker_losses: list[float] = []
    retriever_losses: list[float] = []
    with open(out / "metrics.jsonl", "w") as log:
        for step in range(1, config.max_steps + 1):
            batch = [
                train[i]
                for i in rng.choice(len(train), size=min(config.batch_size, len(train)), replace=False)
            ]
            lists = [[p.response, *sampler.sample(p.response, negatives, rng)] for p in batch]
            if retriever is not None:
                picked = top_m(retriever, batch, config.top_m)
            else:
                picked = [p.knowledge for p in batch]
            flat_c = [p.context for p, cands in zip(batch, lists, strict=True) for _ in cands]
            flat_k = [k for k, cands in zip(picked, lists, strict=True) for _ in cands]
            flat_r = [t for cands in lists for t in cands]
            ranker.train()
            with autocast(device):
                pairs = ranker.tokenizer.pairs(flat_c, flat_r, flat_k).to(device)
                logits = ranker(pairs).float().view(len(batch), -1)  # [B, n]
                loss_theta = nn.functional.cross_entropy(
                    logits, torch.zeros(len(batch), dtype=torch.long, device=device)
                )
            optimizers[0].zero_grad(set_to_none=True)
            loss_theta.backward()
            nn.utils.clip_grad_norm_(ranker.parameters(), config.grad_clip)
            optimizers[0].step()
            schedules[0].step()
            loss_phi = None
            if learns and retriever is not None:
                with torch.no_grad(), autocast(device):
                    weights = ranker_feedback(ranker, picked, lists, config.feedback)
                retriever.train()
                with autocast(device):
                    loss_phi = retriever_loss(retriever, batch, picked, weights, config.tau)
                if loss_phi is not None:
                    optimizers[1].zero_grad(set_to_none=True)
                    loss_phi.backward()
                    nn.utils.clip_grad_norm_(retriever.parameters(), config.grad_clip)
                    optimizers[1].step()
                schedules[1].step()
            ranker_losses.append(loss_theta.item())
            if loss_phi is not None:
                retriever_losses.append(loss_phi.item())
            line: dict[str, Any] = {}
            if step % config.log_every == 0 or step == config.max_steps:
                line["loss_ranker"] = round(float(np.mean(ranker_losses)), 4)
                if retriever_losses:
                    line["loss_retriever"] = round(float(np.mean(retriever_losses)), 4)
                ranker_losses, retriever_losses = [], []
            if valid and (step % config.eval_every == 0 or step == config.max_steps):
                line["valid"] = {k: round(v, 2) for k, v in validate(step).items() if k != "n"}
            if line:
                log.write(json.dumps({"step": step, **line}) + "\n")
                log.flush()
    if not valid:
        save_checkpoint(ranker, out / "cross", provenance)
        if retriever is not None:
            save_checkpoint(retriever, out / "knowledge", provenance)
    summary = {
        "method": "reckgc" if learns else f"grounded-{config.knowledge}",
        "knowledge": config.knowledge,
        "steps": config.max_steps,
        "negatives": negatives,
        "best_valid": best if valid else None,
        "train_seconds": round(time.perf_counter() - started, 1),
        "device": str(device),
    }
    write_json_atomic(out / "summary.json", summary)
    return summary
