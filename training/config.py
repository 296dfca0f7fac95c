"""Training configuration (kept free of heavy imports so the CLI can build its parser instantly)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from coreply.config import ModelConfig

Mode = Literal["independent", "distill", "core", "mutual"]
MODES: tuple[str, ...] = ("independent", "distill", "core", "mutual")


AT_LEAST_ONE = (
    "num_negatives", "batch_size", "grad_accum", "epochs", "max_steps", "eval_every", "log_every",
    "patience", "hard_refresh", "hard_pool", "hard_top",
)  # fmt: skip
NON_NEGATIVE = (
    "lora_rank", "cross_lora_rank", "hard_negatives", "own_turn_negatives", "paraphrase_negatives",
    "max_batch_tokens", "valid_size", "valid_pool", "weight_decay", "gamma_r", "gamma_g", "alpha", "seed",
)  # fmt: skip
POSITIVE = ("lr", "cross_lr", "tau", "grad_clip", "lora_alpha", "max_minutes")
RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    "at_least_one": (lambda v: v >= 1, ">= 1"),
    "non_negative": (lambda v: v >= 0, ">= 0"),
    "positive": (lambda v: v > 0, "> 0"),
    "fraction": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "share": (lambda v: 0 < v < 1, "in (0, 1)"),
}


def check_fields(config: Any, **groups: Sequence[str]) -> None:
    """For each rule of :data:`RULES`, the named fields of ``config`` must obey it and be finite (``None``:
    unset, fine); else a ValueError naming the field and its flag."""
    for rule, names in groups.items():
        test, text = RULES[rule]
        for name in names:
            value = getattr(config, name)
            if value is not None and not (math.isfinite(value) and test(value)):
                finite = "" if math.isfinite(value) else "finite and "
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be {finite}{text}, got {value}")


RESUMABLE = frozenset(
    {
        "max_steps",
        "epochs",
        "max_minutes",
        "patience",
        "eval_every",
        "log_every",
        "device",
        "prefetch",
        "cpu_bf16",
    }
)
"""What ``coreply train --resume`` may change: the budget and the bookkeeping, never the recipe."""


HELP = {
    "models": "which models `independent` trains; for `distill`, 'cross' makes the student a (smaller) "
    "cross-encoder, anything else the bi-encoder",
    "teacher": "trained cross-encoder checkpoint that teaches in `distill` ('builtin': the default bundle's)",
    "init_bi": "start the retriever from this checkpoint ('builtin': the default bundle's, rank-8 adapters) "
    "instead of the base model (with --lora-rank: an adapter checkpoint of that rank, whose adapters train "
    "on); in a run that trains only the reranker, the frozen retriever that mines its hard and paraphrase "
    "negatives",
    "cross_residual": "train the reranker as a correction to the frozen --init-bi retriever (with --mode "
    "independent --models cross): a list's scores are the retriever's plus the reranker's, so it learns what "
    "the retriever gets wrong instead of relearning what it knows; its new head starts at zero, i.e. as the "
    "retriever. Serve it with sum fusion behind that retriever (the checkpoint names it by hash)",
    "init_cross": "start the reranker from this checkpoint ('builtin': the default bundle's, rank-32 "
    "adapters) instead of the base model (with --lora-rank: an adapter checkpoint of that rank, whose "
    "adapters train on; with a --num-layers below its depth: a student of its first layers and its head, "
    "reading pairs at this run's --max-context/response-tokens)",
    "lora_rank": "> 0: train low-rank adapters (+ biases, norms, heads) instead of every weight; checkpoints "
    "then hold only those (a few MB) and name the base model by hash",
    "cross_lora_rank": "the reranker's --lora-rank, when it differs (e.g. 0: every weight of the reranker "
    "trains while the retriever trains adapters)",
    "lora_alpha": "LoRA scaling (update = alpha / rank * B A)",
    "num_negatives": "negatives per candidate list (delta_r); capped, with a message, at the distinct "
    "responses the training data has besides the gold",
    "batch_size": "contexts per step and process",
    "grad_accum": "micro-batches accumulated per optimizer step",
    "lr": "AdamW learning rate",
    "cross_lr": "the reranker's learning rate, when it differs from --lr",
    "weight_decay": "AdamW weight decay",
    "warmup_ratio": "share of the steps with a linear learning-rate warm-up",
    "epochs": "passes over the training pairs (unless --max-steps is given)",
    "max_steps": "optimizer steps; the budget for equal-budget comparisons (default: --epochs' worth)",
    "max_minutes": "wall-clock budget of the training loop, validations included (not loading): from the "
    "measured step and validation times the run plans how many of its steps fit, the learning rate decays "
    "to zero at that step, and the last validation ends inside the budget",
    "tau": "softmax temperature of the distributions the models learn from each other",
    "gamma_r": "weight of the retriever's KL term (learning from the reranker)",
    "gamma_g": "weight of the reranker's KL term (learning from the retriever)",
    "alpha": "`mutual`: weight of both KL terms",
    "in_batch": "the retriever also ranks the other contexts' candidates of the batch",
    "hard_negatives": "how many of the negatives are mined by the current retriever",
    "hard_refresh": "steps between re-embeddings of the mining pool (a frozen --init-bi miner's: once)",
    "hard_pool": "responses sampled for mining",
    "hard_top": "mine among the retriever's top k",
    "own_turn_negatives": "how many negatives are the context's own turns (restatements)",
    "paraphrase_negatives": "how many negatives are the pool's nearest neighbours of the last turn: "
    "paraphrases of what the user just said (mined like the hard negatives)",
    "paraphrase_floor": "keep a mined paraphrase only if its cosine with the last turn, under the mining "
    "retriever's response tower, is at least this (0: the nearest, whatever they are; most are on-topic "
    "replies, docs/results.md 28); lists left short get random negatives",
    "max_batch_tokens": "> 0: run each model's inputs (contexts, candidates, reranker pairs) in "
    "length-sorted chunks of at most this many padded tokens (less padding); 0: one padded batch each",
    "packed": "run each model's inputs as their real tokens only, no padding (variable-length "
    "FlashAttention on CUDA, PyTorch >= 2.10, without attention-probability dropout; elsewhere the same "
    "model as padded, 1.1-1.4x a CPU step, docs/results.md 64); instead of --max-batch-tokens. Default: "
    "on a CPU, off on CUDA (where `scripts/gpu_lease.sh packed:S` measures it first); with --resume, "
    "the run's",
    "prefetch": "build the next step's lists and token ids in a thread while this step runs",
    "compile": "torch.compile the models (dynamic shapes)",
    "cpu_bf16": "on a CPU, train under bf16 autocast as CUDA always does (the weights stay fp32): faster "
    "where the CPU has bf16 instructions (AMX, AVX-512 BF16; docs/results.md 71), emulated and slow "
    "elsewhere",
    "grad_clip": "gradient-norm clip (the precursor paper's value)",
    "seed": "seed of the data order, the negatives and the initialisation",
    "eval_every": "steps between validations (checkpoints keep the best validation hits@1)",
    "valid_size": "validation pairs used (0: none; the last weights are kept)",
    "valid_candidates": "protocol A list size on the validation pairs; capped, with a message, at the "
    "distinct validation responses",
    "valid_pool": "> 0: also rank each validation context's gold among this many responses (the validation "
    "golds and a seeded sample of the training pool; protocol B, echoes dropped) and keep the retriever "
    "with the best hits@1 there, which 1-of-N lists barely see (docs/results.md §15); the reranker "
    "reorders the retriever's first 10 there (a reranker alone: those of the frozen --init-bi "
    "retriever) and is kept by its hits@1 in that order (a --cross-residual one: the sum's), as it "
    "serves (§39)",
    "patience": "validations without a new best before training stops early",
    "log_every": "steps between lines of metrics.jsonl",
    "device": "'auto' (CUDA when present), 'cpu', 'cuda' or 'cuda:N'",
}
"""Each field's ``coreply train`` help (``mode``, ``output_dir`` and ``model`` have their own)."""


@dataclass
class TrainConfig:
    """Defaults are the CORE paper's (Sec. 4.3) unless :data:`HELP` says otherwise."""

    mode: Mode = "core"
    output_dir: str = "runs/core"
    models: Literal["both", "bi", "cross"] = "both"
    teacher: str | None = None
    init_bi: str | None = None
    init_cross: str | None = None
    cross_residual: bool = False
    lora_rank: int = 0
    cross_lora_rank: int | None = None
    lora_alpha: float = 16.0
    model: ModelConfig = field(default_factory=ModelConfig)
    num_negatives: int = 32
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 5e-5
    cross_lr: float | None = None
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    epochs: int = 1
    max_steps: int | None = None
    max_minutes: float | None = None
    tau: float = 3.0
    gamma_r: float = 1.0
    gamma_g: float = 3.0
    alpha: float = 1.0
    in_batch: bool = False
    hard_negatives: int = 0
    hard_refresh: int = 200
    hard_pool: int = 20_000
    hard_top: int = 50
    own_turn_negatives: int = 0
    paraphrase_negatives: int = 0
    paraphrase_floor: float = 0.0
    max_batch_tokens: int = 0
    packed: bool | None = None
    prefetch: bool = True
    compile: bool = False
    cpu_bf16: bool = False
    grad_clip: float = 10.0
    seed: int = 42
    eval_every: int = 200
    valid_size: int = 500
    valid_candidates: int = 100
    valid_pool: int = 0
    patience: int = 5
    log_every: int = 10
    device: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = ModelConfig.from_dict(self.model)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "distill" and not self.teacher:
            raise ValueError("mode 'distill' needs --teacher (a trained cross-encoder checkpoint)")
        check_fields(
            self,
            at_least_one=AT_LEAST_ONE,
            non_negative=NON_NEGATIVE,
            positive=POSITIVE,
            fraction=("warmup_ratio", "paraphrase_floor"),
        )
        reranker_alone = self.mode == "independent" and self.models == "cross"
        if self.cross_residual and not (reranker_alone and self.init_bi):
            raise ValueError(
                "cross_residual (--cross-residual) trains a reranker as a correction to one frozen "
                "retriever: use it with --mode independent --models cross --init-bi CHECKPOINT"
            )
        if self.valid_candidates < 2:
            n = self.valid_candidates
            raise ValueError(f"valid_candidates (--valid-candidates) must be >= 2, got {n}")
        if self.packed and self.max_batch_tokens:
            raise ValueError(
                "packed (--packed) runs each model's inputs as one batch without padding: "
                "drop --max-batch-tokens"
            )
        if self.paraphrase_floor and not self.paraphrase_negatives:
            raise ValueError("paraphrase_floor (--paraphrase-floor) filters --paraphrase-negatives: set both")
        chosen = ("hard_negatives", "own_turn_negatives", "paraphrase_negatives")
        if sum(getattr(self, name) for name in chosen) > self.num_negatives:
            raise ValueError(f"{' + '.join(chosen)} cannot exceed num_negatives ({self.num_negatives})")

    def rank_of(self, kind: str) -> int:
        """The LoRA rank ``kind`` ('bi' or 'cross') trains with (0: every weight)."""
        own = self.cross_lora_rank if kind == "cross" else None
        return self.lora_rank if own is None else own

    def lr_of(self, kind: str) -> float:
        """The learning rate of ``kind`` ('bi' or 'cross')."""
        own = self.cross_lr if kind == "cross" else None
        return self.lr if own is None else own

    @property
    def trains_bi(self) -> bool:
        if self.mode == "distill":
            return self.models != "cross"
        return self.mode != "independent" or self.models in ("both", "bi")

    @property
    def trains_cross(self) -> bool:
        if self.mode == "distill":
            return self.models == "cross"
        return self.mode in ("core", "mutual") or self.models in ("both", "cross")


Selection = Literal["reciprocal", "frozen", "all", "none"]
SELECTIONS: tuple[str, ...] = ("reciprocal", "frozen", "all", "none")
Feedback = Literal["both", "ranker", "f1"]


@dataclass
class GroundedConfig:
    """Defaults are the paper's (Sec. 4.3) where coreply has the knob: m = 5, tau = 0.2, learning rates
    3e-5 (ranker) and 1e-5 (retriever), unigram-F1 plus ranker feedback. The knowledge budget (128
    tokens for the m sentences) is ours: the paper's 40 per sentence on 512-token pairs is too dear on CPU."""

    output_dir: str = "runs/grounded"
    knowledge: Selection = "reciprocal"
    model: ModelConfig = field(default_factory=lambda: ModelConfig(max_knowledge_tokens=128))
    init_cross: str | None = None
    init_retriever: str | None = None
    top_m: int = 5
    feedback: Feedback = "both"
    tau: float = 0.2
    num_negatives: int = 15
    batch_size: int = 8
    lr: float = 3e-5
    retriever_lr: float = 1e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    max_steps: int = 1000
    grad_clip: float = 1.0
    eval_every: int = 200
    valid_size: int = 200
    valid_candidates: int = 20
    seed: int = 42
    log_every: int = 10
    device: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = ModelConfig.from_dict(self.model)
        if self.knowledge not in SELECTIONS:
            raise ValueError(f"knowledge (--knowledge) must be one of {SELECTIONS}, got {self.knowledge!r}")
        if self.feedback not in ("both", "ranker", "f1"):
            raise ValueError(f"feedback (--feedback) must be both, ranker or f1, got {self.feedback!r}")
        check_fields(
            self,
            at_least_one=("top_m", "num_negatives", "batch_size", "max_steps", "eval_every", "log_every"),
            positive=("tau", "lr", "retriever_lr", "grad_clip"),
            non_negative=("weight_decay", "valid_size"),
            fraction=("warmup_ratio",),
        )
        if self.valid_candidates < 2:
            raise ValueError(
                f"valid_candidates (--valid-candidates) must be >= 2, got {self.valid_candidates}"
            )
        if self.knowledge != "none" and self.model.max_knowledge_tokens < 3:
            raise ValueError("a ranker that reads knowledge needs --max-knowledge-tokens >= 3")

    @property
    def uses_retriever(self) -> bool:
        return self.knowledge in ("reciprocal", "frozen")

    def ranker_config(self) -> ModelConfig:
        """The ranker's model config: no knowledge budget when it reads none."""
        return self.model if self.knowledge != "none" else replace(self.model, max_knowledge_tokens=0)

    def retriever_config(self) -> ModelConfig:
        """The knowledge retriever: one encoder for both sides (paper Sec. 3.3), the ranker's base model."""
        m = self.model
        return ModelConfig(
            base_model=m.base_model,
            pooling=m.pooling,
            share_towers=True,
            max_context_tokens=m.max_context_tokens,
            max_response_tokens=m.max_response_tokens,
            max_turns=m.max_turns,
        )
