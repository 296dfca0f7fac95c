"""Training configuration (kept free of heavy imports so the CLI can build its parser instantly)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from coreply.config import ModelConfig

Mode = Literal["independent", "distill", "core", "mutual"]
MODES: tuple[str, ...] = ("independent", "distill", "core", "mutual")


@dataclass
class TrainConfig:
    """Defaults are the CORE paper's (Sec. 4.3) unless a comment says otherwise."""

    mode: Mode = "core"
    output_dir: str = "runs/core"
    models: Literal["both", "bi", "cross"] = "both"  # which models `independent` trains;
    # `distill`: "cross" makes the student a (smaller) cross-encoder, anything else the bi-encoder
    teacher: str | None = None  # cross-encoder checkpoint for `distill`
    init_bi: str | None = None  # start from these checkpoints instead of the base model
    init_cross: str | None = None
    lora_rank: int = 0  # > 0: train low-rank adapters (+ biases, norms, heads) instead of every weight;
    # checkpoints then hold only those (a few MB) and name the base model by hash (coreply.adapters)
    lora_alpha: float = 16.0
    model: ModelConfig = field(default_factory=ModelConfig)
    num_negatives: int = 32  # delta_r
    batch_size: int = 8  # contexts per step and process
    grad_accum: int = 1
    lr: float = 5e-5
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; the budget for equal-budget comparisons
    tau: float = 3.0
    gamma_r: float = 1.0
    gamma_g: float = 3.0
    alpha: float = 1.0  # `mutual`: weight of both KL terms
    in_batch: bool = False  # bi-encoder also ranks the other contexts' candidates
    hard_negatives: int = 0  # how many of the delta_r negatives are mined by the current retriever
    hard_refresh: int = 200  # steps between re-embeddings of the mining pool
    hard_pool: int = 20_000  # responses sampled for mining
    hard_top: int = 50  # mine among the retriever's top-k
    own_turn_negatives: int = 0  # how many negatives are the context's own turns (restatements)
    paraphrase_negatives: int = 0  # how many are the pool's nearest neighbours of the last turn, mined
    # like the hard negatives (same pool sample and refresh): paraphrases of what the user just said
    max_batch_tokens: int = 0  # > 0: run the reranker's pairs in length-sorted chunks of at most this
    # many padded tokens (less padding); 0: one padded batch per micro-batch
    prefetch: bool = True  # build the next step's lists and token ids in a thread while this step runs
    compile: bool = False  # torch.compile the models (dynamic shapes)
    grad_clip: float = 10.0  # the precursor paper's value
    seed: int = 42
    eval_every: int = 200
    valid_size: int = 500
    valid_candidates: int = 100  # protocol A list size on the validation split
    patience: int = 5  # evaluations without a new best before early stopping
    log_every: int = 10
    device: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = ModelConfig.from_dict(self.model)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "distill" and not self.teacher:
            raise ValueError("mode 'distill' needs --teacher (a trained cross-encoder checkpoint)")
        if self.lora_rank < 0:
            raise ValueError("lora_rank must be >= 0 (0 = train every weight)")
        if self.lora_rank and (self.init_bi or self.init_cross):
            raise ValueError("lora_rank adapts the base model; it cannot start from --init-bi/--init-cross")
        if self.num_negatives < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("num_negatives, batch_size and grad_accum must be >= 1")
        chosen = {
            "hard_negatives": self.hard_negatives,
            "own_turn_negatives": self.own_turn_negatives,
            "paraphrase_negatives": self.paraphrase_negatives,
        }
        if min(chosen.values()) < 0 or self.max_batch_tokens < 0:
            raise ValueError(f"{', '.join(chosen)} and max_batch_tokens must be >= 0")
        if sum(chosen.values()) > self.num_negatives:
            raise ValueError(f"{' + '.join(chosen)} cannot exceed num_negatives ({self.num_negatives})")

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
