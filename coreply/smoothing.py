"""Activation smoothing for the reranker's int8 graph (SmoothQuant: Xiao et al., 2023).

ONNX Runtime's dynamic int8 quantises each matrix product's input with one scale per call, so the few
input channels that run 10-16 times larger than the median one (in the shipped MiniLM reranker, the
feed-forward inputs and the GELU outputs) take most of the 8 bits' range and leave the rest about 4.
Dividing input channel j by s_j and multiplying the weight's column j by s_j computes the same product in
fp32 and moves that range into the weights, which are quantised per output channel:

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

with max|X_j| over the calibration pairs' tokens and max|W_j| over the weights that read the input
(query, key and value share theirs). The division is one elementwise multiply before each product in
the exported graph. The checkpoint itself is not changed: only the ONNX export reads the smoothed copy.
Measured in docs/results.md §53.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from coreply.models import CrossEncoder

ALPHA = 0.75
"""How much of each input channel's range moves into the weights (0: none, 1: all)."""
CALIBRATION_PAIRS = 256


class _Smoothed(nn.Module):
    """``inner`` run on its first input divided channel-wise: x [..., C] * inv_s [C]."""

    def __init__(self, inner: nn.Module, inv_s: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("inv_s", inv_s)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        return self.inner(x * self.inv_s, *args, **kwargs)


def calibration_pairs(texts: Sequence[str], n: int = CALIBRATION_PAIRS) -> tuple[list[list[str]], list[str]]:
    """``n`` (context, response) pairs from a response pool, spread evenly over it: two consecutive texts
    as the context, the next as the response. The channels that run large are the model's, not the
    data's, so the pool a bundle serves is enough to find them."""
    if len(texts) < 3:
        return [], []
    starts = torch.linspace(0, len(texts) - 3, min(n, len(texts) - 2)).long().unique().tolist()
    return [[texts[i], texts[i + 1]] for i in starts], [texts[i + 2] for i in starts]


def smoothed(
    cross: CrossEncoder, contexts: Sequence[Sequence[str]], responses: Sequence[str], alpha: float = ALPHA
) -> CrossEncoder:
    """A copy of ``cross`` that scores as it does (fp32 rounding aside), each transformer layer's matrix
    products reading smoothed inputs, calibrated on the pairs (``contexts[i]``, ``responses[i]``).
    ``cross`` is left as it was; no pairs, or a backbone that is not BERT-style, gives it back as it is."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    layers = getattr(getattr(cross.backbone, "encoder", None), "layer", None)
    if not contexts or layers is None or not hasattr(layers[0], "intermediate"):
        return cross
    model = copy.deepcopy(cross).cpu().eval()
    sites: list[tuple[nn.Module, str, list[nn.Linear]]] = []  # (parent, child to wrap, its linears)
    for layer in model.backbone.encoder.layer:
        attention = layer.attention
        sites += [
            (attention, "self", [attention.self.query, attention.self.key, attention.self.value]),
            (attention.output, "dense", [attention.output.dense]),
            (layer, "intermediate", [layer.intermediate.dense]),
            (layer.output, "dense", [layer.output.dense]),
        ]
    batch = model.tokenizer.pairs(contexts, responses)
    real = batch.attention_mask.bool()  # [N, L]: served rows carry no padding, so it sets no range
    x_max: dict[int, torch.Tensor] = {}

    def record(site: int):
        def hook(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach()[real].abs().amax(0)  # [N, L, C] -> [C]
            x_max[site] = torch.maximum(x_max[site], x) if site in x_max else x

        return hook

    hooks = [linears[0].register_forward_pre_hook(record(i)) for i, (_, _, linears) in enumerate(sites)]
    try:
        with torch.inference_mode():
            model(batch)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for i, (parent, name, linears) in enumerate(sites):
            w_max = torch.stack([lin.weight.abs().amax(0) for lin in linears]).amax(0)  # [C]
            s = (x_max[i].clamp(min=1e-5) ** alpha / w_max.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
            for lin in linears:
                lin.weight.mul_(s)  # [out, C] * [C]
            setattr(parent, name, _Smoothed(getattr(parent, name), 1 / s))
    return model
