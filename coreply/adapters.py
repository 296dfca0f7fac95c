"""Low-rank adapters (LoRA) for compact fine-tuning: every linear layer of the transformer backbone(s)
gets ``W' = W + (B @ A) * alpha / rank`` with ``W`` frozen; biases, LayerNorms and the heads stay
trainable. What training changes is then small enough to ship in git (a few MB instead of 90 MB), and
a checkpoint stores only that (see ``coreply.checkpoint``): the base weights come from the base model.

The adapters live as ``torch.nn.utils.parametrize`` parametrizations, so the model classes are
unchanged; :func:`merge_lora` folds them into plain weights for serving and export. A model fine-tuned
in full can be shipped the same way: :func:`extract_lora` approximates its change by adapters.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize

ADAPTED = "weight"


class LowRankDelta(nn.Module):
    """Parametrization ``W -> W + (lora_B @ lora_A) * scale``; B starts at zero, so step 0 is the base."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))  # [r, in]
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))  # [out, r]
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> [out, in]
        return weight + (self.lora_B @ self.lora_A) * self.scale


def backbones(model: nn.Module) -> list[nn.Module]:
    """The pretrained transformers of a coreply model (a shared tower counted once)."""
    found = []
    for name in ("context_tower", "response_tower", "backbone"):
        module = getattr(model, name, None)
        if module is not None and all(module is not m for m in found):
            found.append(module)
    return found


def add_lora(model: nn.Module, rank: int, alpha: float) -> None:
    """Freeze the backbone's linear weights and give each a rank-``rank`` adapter (in place)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    for backbone in backbones(model):
        for module in backbone.modules():
            if isinstance(module, nn.Linear) and not parametrize.is_parametrized(module, ADAPTED):
                module.weight.requires_grad_(False)
                delta = LowRankDelta(module.out_features, module.in_features, rank, alpha)
                parametrize.register_parametrization(module, ADAPTED, delta.to(module.weight.device))
        # embeddings are frozen too: only adapters, biases, norms and what sits outside the backbones train
        for name, param in backbone.named_parameters():
            if "embeddings" in name and not name.endswith(("LayerNorm.weight", "LayerNorm.bias")):
                param.requires_grad_(False)


def lora_settings(model: nn.Module) -> dict[str, float] | None:
    """``{"rank": r, "alpha": a}`` of the model's adapters, or None if it has none."""
    for module in model.modules():
        if isinstance(module, LowRankDelta):
            rank = module.lora_A.shape[0]
            return {"rank": rank, "alpha": module.scale * rank}
    return None


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors training changed: adapter factors and every parameter that still requires grad."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an adapter checkpoint of ``model`` stores: :func:`trainable_state`, and the frozen tensors
    the adapter checkpoint it was loaded from stored beyond that (``model.kept_whole``, set by
    :func:`coreply.checkpoint.load_checkpoint`): the position and token-type tables of a reranker
    compacted by :func:`extract_lora`, which adapters trained on from it keep frozen and must not drop."""
    params = dict(model.named_parameters())
    kept = {name: params[name].detach() for name in getattr(model, "kept_whole", ())}
    return kept | trainable_state(model)


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its weight (in place): the model becomes a plain one again."""
    for module in list(model.modules()):
        if parametrize.is_parametrized(module, ADAPTED):
            parametrize.remove_parametrizations(module, ADAPTED, leave_parametrized=True)


@torch.no_grad()
def extract_lora(model: nn.Module, tuned: nn.Module, rank: int) -> dict[str, float]:
    """Turn ``model`` (the base, in place) into a rank-``rank`` adapter model that approximates ``tuned``,
    the same architecture fine-tuned in full: each linear weight's change ``W_tuned - W_base`` becomes
    its best rank-``rank`` approximation (truncated SVD, ``alpha = rank`` so the scale is 1); biases,
    LayerNorms, heads and the small embedding tables (positions and token types, which a reranker
    retrains to tell the response from the context) are copied whole; the word embeddings' change is
    dropped (a vocabulary-sized table; adapters keep it frozen).

    Returns what was kept: ``kept`` and ``worst_kept``, the share of the linear changes' squared
    Frobenius norm kept over all layers and in the worst one, and ``embedding_change``, the dropped
    change's norm relative to the word embeddings' norm."""
    tuned_params = dict(tuned.named_parameters())
    if set(tuned_params) != {name for name, _ in model.named_parameters()}:
        raise ValueError("the fine-tuned model and the base are not the same architecture")
    linears = [m for b in backbones(model) for m in b.modules() if isinstance(m, nn.Linear)]
    smallest = min(min(m.weight.shape) for m in linears)
    if not 1 <= rank <= smallest:
        raise ValueError(f"rank must be in [1, {smallest}] (the smallest linear layer's size), got {rank}")
    add_lora(model, rank, float(rank))
    for name, param in model.named_parameters():  # stored whole beside the adapters (load_weights reads them)
        if "embeddings" in name and not name.endswith("word_embeddings.weight"):
            param.requires_grad_(True)
    kept = total = 0.0
    worst = 1.0
    for name, module in model.named_modules():
        if not parametrize.is_parametrized(module, ADAPTED):
            continue
        base = module.parametrizations[ADAPTED].original
        change = (tuned_params[f"{name}.weight"] - base).float()  # [out, in]
        u, s, vh = torch.linalg.svd(change, full_matrices=False)  # [out, k], [k], [k, in]
        delta = module.parametrizations[ADAPTED][0]
        delta.lora_B.copy_(u[:, :rank] * s[:rank])  # [out, r]
        delta.lora_A.copy_(vh[:rank])  # [r, in]
        part, energy = float((s[:rank] ** 2).sum()), float((s**2).sum())
        kept, total = kept + part, total + energy
        worst = min(worst, part / energy if energy else 1.0)
    for name, param in model.named_parameters():
        if param.requires_grad and "lora_" not in name:
            param.copy_(tuned_params[name.replace(f".parametrizations.{ADAPTED}.original", f".{ADAPTED}")])
    dropped = [
        (tuned_params[name] - p, p)
        for name, p in model.named_parameters()
        if not p.requires_grad and "embeddings" in name
    ]
    change = sum(float((d**2).sum()) for d, _ in dropped) ** 0.5
    norm = sum(float((p**2).sum()) for _, p in dropped) ** 0.5
    return {
        "kept": kept / total if total else 1.0,
        "worst_kept": worst,
        "embedding_change": change / norm if norm else 0.0,
    }
