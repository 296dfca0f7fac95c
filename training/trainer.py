"""One trainer for every mode:

* ``independent``: each model alone, cross-entropy over 1 positive + delta_r negatives (paper Eq. 2).
* ``distill``: a frozen, trained cross-encoder K teaches the bi-encoder: CE + gamma_R * KL(K || A); with
  ``models="cross"`` it teaches a (smaller) cross-encoder instead: CE + gamma_G * KL(K || G).
* ``core``: both models on the same lists; retriever CE + gamma_R * KL(K || A), reranker
  CE + gamma_G * KL(A || K), each KL target detached (CORE, Eqs. 3-6 and Algorithm 1).
* ``mutual``: the precursor's Algorithm 1: update the retriever, recompute its predictions, then update
  the reranker (weight alpha on both KL terms).

Runs unchanged under ``torchrun`` (DistributedDataParallel): every rank draws the same global batch
and trains on its slice, so the gradient equals the single-process gradient of the global batch.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from coreply.adapters import add_lora, lora_settings
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_checkpoint, save_checkpoint
from coreply.corpus import NegativeSampler, Pair
from coreply.device import autocast, cpu_has_bf16_dot, resolve_device
from coreply.models import BiEncoder, CrossEncoder, MLPHead, PolyEncoder, poly_scores, retriever_class
from coreply.text import normalize
from coreply.tokenization import Batch, DialogueTokenizer, token_budget_chunks
from evaluation.protocols import (
    Retrieved,
    evaluate_lists,
    evaluate_pool,
    pool_for_eval,
    protocol_a_lists,
    recall_pool,
)
from training.config import TrainConfig
from training.losses import kl_to_target, listwise_ce
from training.sampling import HardNegativeMiner, epoch_order, own_turn_negatives, step_rng

log = logging.getLogger(__name__)


class StepLosses:
    """Per-step losses summed *on the device*: adding one never waits for the GPU; reading them
    (:meth:`Trainer.reduce_losses`) is the one host synchronisation, once per logging window."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        v = value.detach().float()
        self.values[name] = self.values[name] + v if name in self.values else v

    def merge(self, other: StepLosses) -> None:
        for name, value in other.values.items():
            self.add(name, value)


Chunks = list[tuple[np.ndarray, Batch]]
"""Model input in length-sorted chunks: (row ids, padded rows); row ids say where each row belongs."""


@dataclass
class MicroBatch:
    """One micro-batch, ready for the models: candidate lists (gold first) and their token ids, built
    from the tokenizers' caches (no Hugging Face tokenizer call) and pinned when training on CUDA."""

    pairs: list[Pair]
    lists: list[list[str]]
    contexts: Chunks | None = None  # bi-encoder contexts [B] in all
    responses: Chunks | None = None  # bi-encoder candidates, list after list [B*N] in all
    cross: Chunks | None = None  # reranker pairs, list after list [B*N] in all
    teacher: Chunks | None = None  # the same pairs for a distillation teacher

    @property
    def counts(self) -> dict[str, int]:
        """Real and computed (padded, unless packed) tokens per model, for throughput figures."""
        out: dict[str, int] = {}
        bi = [b for _, b in self.contexts + self.responses] if self.contexts is not None else []
        for name, batches in (("bi", bi), ("cross", [b for _, b in self.cross or []])):
            if batches:
                out[f"{name}_tokens"] = sum(b.tokens for b in batches)
                out[f"{name}_padded"] = sum(b.computed_tokens for b in batches)
        return out

    def _map(self, fn: Callable[[Batch], Batch]) -> MicroBatch:
        each = lambda chunks: [(i, fn(b)) for i, b in chunks] if chunks else chunks  # noqa: E731
        return MicroBatch(
            self.pairs, self.lists, *map(each, (self.contexts, self.responses, self.cross, self.teacher))
        )

    def pin_memory(self) -> MicroBatch:
        return self._map(Batch.pin_memory)

    def packed(self) -> MicroBatch:
        """Every batch with its packing (models then skip the padding)."""
        return self._map(Batch.packed)


def in_chunks(make_batch, rows: list, lengths: Sequence[int], max_tokens: int) -> Chunks:
    """``rows`` as one padded batch, or (``max_tokens`` > 0) length-sorted chunks of at most that many
    padded tokens each."""
    if not max_tokens:
        return [(np.arange(len(rows)), make_batch(rows))]
    return [(idx, make_batch([rows[i] for i in idx])) for idx in token_budget_chunks(lengths, max_tokens)]


def in_row_order(out: torch.Tensor, chunks: Chunks) -> torch.Tensor:
    """Outputs of chunked rows [N, ...] back in row order."""
    if len(chunks) == 1:
        return out
    order = np.argsort(np.concatenate([i for i, _ in chunks]))
    return out[torch.from_numpy(order).to(out.device)]


def pair_chunks(
    tok: DialogueTokenizer, contexts: Sequence[Sequence[str]], lists: Sequence[Sequence[str]], max_tokens: int
) -> Chunks:
    """Every (context, candidate) pair, list after list, as reranker input."""
    bodies = tok.context_bodies(contexts)
    c_rows = [b for b, cands in zip(bodies, lists, strict=True) for _ in cands]
    rows = list(zip(c_rows, tok.response_bodies([t for cands in lists for t in cands]), strict=True))
    lengths = [len(c) + len(r) + 3 for c, r in rows]
    return in_chunks(lambda rs: tok.batch_pairs(*zip(*rs, strict=True)), rows, lengths, max_tokens)


def single_chunks(tok: DialogueTokenizer, bodies: Sequence[list[int]], max_tokens: int) -> Chunks:
    """One-segment rows (contexts, or candidates list after list) as bi-encoder input."""
    return in_chunks(tok.batch_singles, bodies, [len(b) + 2 for b in bodies], max_tokens)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def warmup_linear(
    optimizer: torch.optim.Optimizer, horizon: int | Callable[[], int], warmup_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_ratio`` of the steps, then linear decay to zero at the last one. A
    callable ``horizon`` is read at every step, so a run that re-plans its length (``--max-minutes``)
    decays to its new end."""

    def factor(step: int) -> float:
        total = horizon() if callable(horizon) else horizon
        warmup = max(1, int(total * warmup_ratio))
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def steps_within(seconds: float, step: int, per_step: float, per_valid: float, eval_every: int | None) -> int:
    """The most steps after ``step`` that fit in ``seconds`` when a step takes ``per_step`` seconds and,
    with validation (``eval_every`` set), every multiple of ``eval_every`` and the last step are followed
    by a validation taking ``per_valid``."""

    def cost(n: int) -> float:  # never decreases with n
        end = step + n
        valids = end // eval_every - step // eval_every + (end % eval_every != 0) if eval_every else 0
        return n * per_step + valids * per_valid

    lo, hi = 0, int(seconds // max(per_step, 1e-9))  # the steps alone bound it
    while lo < hi:  # the largest n with cost(n) <= seconds (0 if none)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= seconds else (lo, mid - 1)
    return lo


class Trainer:
    def __init__(
        self, config: TrainConfig, train: Sequence[Pair], valid: Sequence[Pair], negative_pool: Sequence[str]
    ) -> None:
        self.sampler = NegativeSampler(negative_pool)
        self.rank, self.world = _world()
        # what the data could not give, capped with a message; train_config.json keeps the values asked
        # for beside the ones used, so that the same command line resumes the run
        self.asked: dict[str, int] = {}
        if config.num_negatives > self.sampler.capacity:
            log.warning(
                "--num-negatives %d, but the training pool has %d distinct responses: %d negatives per list "
                "(a list never holds a copy of its gold)",
                config.num_negatives,
                self.sampler.distinct,
                self.sampler.capacity,
            )
            self.asked["num_negatives"] = config.num_negatives
            config = replace(config, num_negatives=self.sampler.capacity)
        if config.batch_size * config.grad_accum * self.world > len(train):  # a step past one pass
            grad_accum = min(config.grad_accum, max(1, len(train) // self.world))
            batch_size = max(1, len(train) // (grad_accum * self.world))
            log.warning(
                "--batch-size %d x --grad-accum %d x %d process(es), but the training data has %d pairs: "
                "--batch-size %d, --grad-accum %d",
                config.batch_size,
                config.grad_accum,
                self.world,
                len(train),
                batch_size,
                grad_accum,
            )
            for key, used in (("batch_size", batch_size), ("grad_accum", grad_accum)):
                if getattr(config, key) != used:
                    self.asked[key] = getattr(config, key)
            config = replace(config, batch_size=batch_size, grad_accum=grad_accum)
        self.cfg = config
        self.device = resolve_device(config.device)
        if self.world > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        if config.cpu_bf16 and self.device.type == "cpu" and not cpu_has_bf16_dot():
            log.warning("--cpu-bf16: this CPU has no bf16 instructions (AVX-512 BF16, AMX): it is slow here")
        torch.manual_seed(config.seed)
        self.train_pairs = list(train)
        self.valid_pairs = list(valid)[: config.valid_size]
        self.valid_lists = (
            protocol_a_lists(
                self.valid_pairs, [p.response for p in valid], config.valid_candidates, seed=config.seed
            )
            if self.valid_pairs
            else []
        )
        self.valid_pool = self._valid_pool(config, negative_pool, valid)
        self.out = Path(config.output_dir)
        self.bi, self.cross, self.teacher = self._build_models()
        mined = config.hard_negatives + config.paraphrase_negatives
        # A run that trains no retriever mines its negatives with, and a residual reranker corrects, a
        # frozen one (--init-bi).
        self.frozen_bi = (
            self._frozen_retriever(config)
            if self.bi is None and (mined or config.cross_residual or self.valid_pool)
            else None
        )
        self._frozen_recall: Retrieved | None = None  # the frozen retriever's over the validation pool
        # Packed by default on a CPU, where it is the padded model at 1.1-1.4x the speed (docs/results.md
        # §50, §64); CUDA packs when asked, as a lease does where it measured that it pays there.
        models = [m for m in (self.bi, self.cross, self.teacher, self.frozen_bi) if m is not None]
        self.packed = (
            config.packed
            if config.packed is not None
            else self.device.type == "cpu"
            and not config.max_batch_tokens
            and all(m.packable() for m in models)
        )
        self.cfg = replace(self.cfg, packed=self.packed)  # as run: a resume that leaves it unset takes it
        self.mining_bi = self.bi if self.bi is not None else self.frozen_bi
        self.tokenize_seconds = self._warm_tokenizers(negative_pool)
        self.global_batch = config.batch_size * config.grad_accum * self.world
        self.steps_per_epoch = max(1, len(self.train_pairs) // self.global_batch)
        self.planned_steps = config.max_steps or self.steps_per_epoch * config.epochs
        self.total_steps = self.planned_steps  # fewer when the time budget says so (_plan_within_budget)
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, Any] = {}
        self.wrapped: dict[str, torch.nn.Module] = {}
        for name, model in (("bi", self.bi), ("cross", self.cross)):
            if model is None:
                continue
            trainable = [p for p in model.parameters() if p.requires_grad]
            fused = self.device.type == "cuda"
            opt = torch.optim.AdamW(
                trainable, lr=config.lr_of(name), weight_decay=config.weight_decay, fused=fused
            )
            self.optimizers[name] = opt
            self.schedulers[name] = warmup_linear(opt, lambda: self.total_steps, config.warmup_ratio)
            self.wrapped[name] = DistributedDataParallel(model) if self.world > 1 else model
        self.miner = (
            HardNegativeMiner(
                negative_pool,
                config.hard_negatives,
                config.hard_refresh,
                config.hard_pool,
                config.hard_top,
                config.seed,
                config.paraphrase_floor,
            )
            if mined
            else None
        )
        # The miner's refresh (a retriever pass) runs on this thread in _take; the prefetch thread only
        # looks its tables up.
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if config.prefetch else None
        self._prefetched: tuple[tuple[int, int], Future] | None = None
        self._order: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))  # (epoch, its order)
        self.step = 0
        self.best: dict[str, float] = {}
        self.stale_evals = 0
        self.examples_seen = 0
        self.train_seconds = 0.0
        self.token_counts: dict[str, int] = {}
        # The time budget (--max-minutes): fit()'s wall clock, validations included, carried over a resume.
        self.clock = time.perf_counter
        self._elapsed_before = 0.0  # fit()'s seconds in earlier processes (a resumed run)
        self._started = self.clock()  # fit() sets it again, less _elapsed_before
        self._valid_seconds: list[float] = []  # each validation with its checkpointing, this process
        self._mark: tuple[int, float, int] | None = None  # (step, time, validations) after its first step

    # ------------------------------------------------------------------------------------ set-up

    def _valid_pool(
        self, config: TrainConfig, negative_pool: Sequence[str], valid: Sequence[Pair]
    ) -> list[str]:
        """The responses ``--valid-pool`` ranks each validation gold among (none without it)."""
        if not config.valid_pool or not self.valid_pairs:
            return []
        if not (config.trains_bi or config.init_bi):
            log.warning(
                "--valid-pool ignored: it ranks with a retriever, and this run neither trains nor has one"
            )
            return []
        golds = len({normalize(p.response) for p in self.valid_pairs})
        if config.valid_pool <= golds:
            raise ValueError(
                f"valid_pool (--valid-pool) must exceed the {golds} distinct validation golds it holds, "
                f"got {config.valid_pool}"
            )
        responses = [*negative_pool, *(p.response for p in valid)]
        pool = pool_for_eval(responses, self.valid_pairs, config.valid_pool, config.seed)
        if len(pool) < config.valid_pool:
            log.warning(
                "--valid-pool %d: there are %d distinct responses, all used", config.valid_pool, len(pool)
            )
        return pool

    def _build_models(self) -> tuple[BiEncoder | None, CrossEncoder | None, CrossEncoder | None]:
        cfg = self.cfg
        bi = cross = teacher = None
        if cfg.trains_bi:
            bi = self._start("bi", cfg.init_bi, lambda: retriever_class(cfg.model).from_pretrained(cfg.model))
        if cfg.trains_cross:
            plain = replace(cfg.model, poly_codes=0)
            cross = self._start("cross", cfg.init_cross, lambda: CrossEncoder.from_pretrained(plain))
            if cfg.cross_residual and not cfg.init_cross and isinstance(cross.head, MLPHead):
                last = cross.head[-1]  # a residual reranker starts as its retriever: a correction of 0
                nn.init.zeros_(last.weight)
                nn.init.zeros_(last.bias)
        if cfg.mode == "distill":
            teacher = load_checkpoint(cfg.teacher, expect="cross").to(self.device).eval()
            teacher.requires_grad_(False)
        if cfg.compile:
            for model in (bi, cross, teacher):
                if model is not None:
                    model.compile(dynamic=True)
        return bi, cross, teacher  # type: ignore[return-value]

    def _frozen_retriever(self, cfg: TrainConfig) -> BiEncoder:
        """A reranker-only run mines its hard and paraphrase negatives with ``--init-bi``'s retriever,
        frozen: the candidates it will rerank when served behind that retriever; a residual reranker
        (``--cross-residual``) adds its scores to that retriever's; ``--valid-pool`` reranks its recall."""
        if not cfg.init_bi:
            raise ValueError(
                "hard and paraphrase negatives are mined by a retriever: this run trains none, so name the "
                "one that mines them with --init-bi"
            )
        bi = load_checkpoint(cfg.init_bi, expect="bi").to(self.device).eval()
        bi.requires_grad_(False)
        return bi

    def _start(self, kind: str, init: str | None, fresh: Callable[[], Any]) -> Any:
        """A model to train: the base model, or ``init``'s weights. With a LoRA rank (``cfg.rank_of(kind)``)
        the adapters train: fresh ones on the base model, or an adapter checkpoint's own (the same rank),
        never new adapters over merged ones (a checkpoint names its base model by hash, and that base
        would not be it). A reranker ``init`` deeper than ``--num-layers`` starts a student of its first
        layers (:meth:`CrossEncoder.first_layers`)."""
        cfg = self.cfg
        rank = cfg.rank_of(kind)
        if not init:
            model = fresh()
            if rank:
                add_lora(model, rank, cfg.lora_alpha)
        else:
            model = load_checkpoint(init, expect=kind, merge=not rank)
            layers = cfg.model.num_layers if kind == "cross" else None
            if layers is not None and layers != (depth := len(model.backbone.encoder.layer)):
                if layers > depth:
                    raise ValueError(f"--num-layers {layers}: --init-cross {init} has only {depth} layers")
                if rank:
                    raise ValueError(
                        f"--init-cross {init} --num-layers {layers}: a student cut from a deeper reranker "
                        "trains every weight (--cross-lora-rank 0)"
                    )
                kept = ("num_layers", "max_context_tokens", "max_response_tokens")
                model = model.first_layers(replace(model.config, **{k: getattr(cfg.model, k) for k in kept}))
            have = lora_settings(model)
            if rank and (have is None or have["rank"] != rank):
                found = f"rank-{have['rank']} adapters" if have else "plain weights"
                own = kind == "cross" and cfg.cross_lora_rank is not None
                flag = "--cross-lora-rank" if own else "--lora-rank"
                raise ValueError(
                    f"--init-{kind} {init}: {flag} {rank} continues an adapter checkpoint of "
                    f"that rank, and this one holds {found} (pass its rank, or {flag} 0)"
                )
        return model.to(self.device).train()

    def _warm_tokenizers(self, pool: Sequence[str]) -> float:
        """Tokenise every training text once (once for all models that share a tokenizer); steps then
        assemble inputs from cached ids."""
        start = time.perf_counter()
        texts = [t for p in self.train_pairs for t in (*p.context, p.response)] + list(pool)
        warmed: list[DialogueTokenizer] = []
        for model in (self.bi, self.frozen_bi, self.cross, self.teacher):
            if model is None:
                continue
            if not any(model.tokenizer.share_cache(w) for w in warmed):
                model.tokenizer.warm(texts)
                warmed.append(model.tokenizer)
        return time.perf_counter() - start

    # ------------------------------------------------------------------------------------ batches

    def _global_batch(self, epoch: int, index: int) -> tuple[list[Pair], np.random.Generator]:
        if self._order[0] != epoch:  # one permutation per epoch (2 ms each; the miner asks for 200 steps)
            self._order = (epoch, epoch_order(len(self.train_pairs), self.cfg.seed, epoch))
        order = self._order[1]
        chosen = order[index * self.global_batch : (index + 1) * self.global_batch]
        return [self.train_pairs[i] for i in chosen], step_rng(self.cfg.seed, epoch, index)

    def _candidate_lists(self, pairs: Sequence[Pair], rng: np.random.Generator) -> list[list[str]]:
        """Positive first, then delta_r negatives: the context's own turns, the pool's paraphrases of
        the last turn (never its copy), retriever-mined hard ones (each as configured), and random ones
        for the rest."""
        cfg = self.cfg
        lists = [[p.response, *own_turn_negatives(p, cfg.own_turn_negatives)] for p in pairs]
        if self.miner is not None:
            for count, by in ((cfg.paraphrase_negatives, "last_turn"), (cfg.hard_negatives, "context")):
                if not count:
                    continue
                # Mined negatives are never a copy of a context turn: the service filters those echoes,
                # and a copy (cosine 1) is the own-turn negatives' business.
                avoid = [
                    {normalize(t) for t in (*cands, *p.context)}
                    for p, cands in zip(pairs, lists, strict=True)
                ]
                for cands, mined in zip(
                    lists, self.miner.mine(self.mining_bi, pairs, rng, count, by, avoid), strict=True
                ):
                    cands.extend(mined)
        for pair, cands in zip(pairs, lists, strict=True):
            avoid = {normalize(t) for t in cands}
            cands.extend(self.sampler.sample(pair.response, cfg.num_negatives + 1 - len(cands), rng, avoid))
        return lists

    def _micro_batch(self, pairs: list[Pair], lists: list[list[str]]) -> MicroBatch:
        """Token ids for one micro-batch (on the CPU; pinned for a CUDA device)."""
        mb = MicroBatch(pairs, lists)
        contexts = [p.context for p in pairs]
        budget = self.cfg.max_batch_tokens
        retriever = self.bi if self.bi is not None else self.frozen_bi if self.cfg.cross_residual else None
        if retriever is not None:
            tok = retriever.tokenizer
            mb.contexts = single_chunks(tok, tok.context_bodies(contexts), budget)
            mb.responses = single_chunks(tok, tok.response_bodies([t for ts in lists for t in ts]), budget)
        if self.cross is not None:
            mb.cross = pair_chunks(self.cross.tokenizer, contexts, lists, budget)
        if self.teacher is not None:
            mb.teacher = pair_chunks(self.teacher.tokenizer, contexts, lists, budget)
        if self.packed:
            mb = mb.packed()
        return mb.pin_memory() if self.device.type == "cuda" else mb

    def _prepare(self, epoch: int, index: int) -> list[MicroBatch]:
        """This rank's micro-batches of global batch ``index`` of ``epoch`` (every rank draws the same
        global lists, then takes its slice)."""
        cfg = self.cfg
        pairs, rng = self._global_batch(epoch, index)
        lists = self._candidate_lists(pairs, rng)
        per_rank = cfg.batch_size * cfg.grad_accum
        mine = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        my_pairs, my_lists = pairs[mine], lists[mine]
        return [
            self._micro_batch(my_pairs[s : s + cfg.batch_size], my_lists[s : s + cfg.batch_size])
            for s in range(0, len(my_pairs), cfg.batch_size)
        ]

    def _refresh_miner(self) -> bool:
        """When due, the miner re-embeds its pool and searches the queries of this step and of the
        ``hard_refresh`` after it (the prefetch thread then never needs the retriever)."""
        if self.miner is None or not self.miner.due(self.step):
            return False
        last = min(self.planned_steps, self.step + self.cfg.hard_refresh + 1)  # a re-plan may grow
        ahead = [
            p for s in range(self.step, last) for p in self._global_batch(*divmod(s, self.steps_per_epoch))[0]
        ]
        kinds = {"last_turn": self.cfg.paraphrase_negatives, "context": self.cfg.hard_negatives}
        return self.miner.maybe_refresh(
            self.mining_bi, self.step, ahead, {k: n for k, n in kinds.items() if n}
        )

    def _take(self, epoch: int, index: int) -> list[MicroBatch]:
        """The prepared step (from the prefetch thread when it guessed right), and start the next."""
        ahead = self._prefetched
        self._prefetched = None
        batches = ahead[1].result() if ahead is not None else None  # the thread is idle from here on
        refreshed = self._refresh_miner()
        if refreshed or (ahead is not None and ahead[0] != (epoch, index)):
            batches = None  # mined before this refresh, or a wrong guess: drawn again, as without prefetch
        if batches is None:
            batches = self._prepare(epoch, index)
        if self._prefetcher is not None and self.step + 1 < self.total_steps:
            nxt = divmod(self.step + 1, self.steps_per_epoch)
            self._prefetched = (nxt, self._prefetcher.submit(self._prepare, *nxt))
        return batches

    # ------------------------------------------------------------------------------------ scores

    def _bi_scores(
        self, mb: MicroBatch, model: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> own-list scores R [B, N] (what the partner learns from and teaches) and the retriever's
        list-wise CE (over every list with in-batch negatives) of ``model`` (default the trained retriever).
        A Poly-encoder's R are its poly scores; its CE trains the pooled vector (which retrieves) and the
        codes (which rescore) together."""
        b, n = len(mb.lists), len(mb.lists[0])
        ctx, resp = (self.wrapped["bi"] if model is None else model)(
            [chunk.to(self.device, non_blocking=True) for _, chunk in mb.contexts],
            [chunk.to(self.device, non_blocking=True) for _, chunk in mb.responses],
        )
        ctx = in_row_order(ctx, mb.contexts)  # [B, D] (a Poly-encoder's [B, 1 + m, D])
        resp = in_row_order(resp, mb.responses).view(b, n, -1)  # [B, N, D]
        codes = ctx[:, 1:] if ctx.dim() == 3 else None  # Poly-encoder: [B, m, D]
        pooled = ctx[:, 0] if codes is not None else ctx  # [B, D]
        own_bi = torch.einsum("bd,bnd->bn", pooled, resp)  # [B, N]
        own = poly_scores(codes, resp) if codes is not None else own_bi  # [B, N]
        if self.cfg.in_batch:  # every list's candidates are negatives for every context
            flat = resp.reshape(-1, resp.shape[-1])  # [B*N, D]
            targets = torch.arange(b, device=ctx.device) * n
            ce = listwise_ce(pooled @ flat.T, targets)  # over [B, B*N]
            if codes is not None:
                ce = ce + listwise_ce(poly_scores(codes, flat), targets)
        else:
            ce = listwise_ce(own_bi)
            if codes is not None:
                ce = ce + listwise_ce(own)
        return own, ce

    def _cross_scores(self, model, chunks: Chunks, lists: Sequence[Sequence[str]]) -> torch.Tensor:
        """-> G [B, N], rows put back in list order after length-sorted chunks."""
        scores = model([batch.to(self.device, non_blocking=True) for _, batch in chunks])  # [B*N]
        return in_row_order(scores, chunks).view(len(lists), -1)

    # ------------------------------------------------------------------------------------ inspection

    def first_lists(self, steps: int) -> Iterator[tuple[list[Pair], list[list[str]]]]:
        """The pairs and candidate lists (gold first, then mined, then random negatives) of a fresh
        run's first ``steps`` global batches, mined as that run mines them: what it would train on.
        For inspection only: it moves the trainer's step and mines no further ahead than ``steps``."""
        self.planned_steps = min(self.planned_steps, steps)
        for index in range(steps):
            self.step = index
            self._refresh_miner()
            pairs, rng = self._global_batch(*divmod(index, self.steps_per_epoch))
            yield pairs, self._candidate_lists(pairs, rng)

    @torch.no_grad()
    def list_scores(self, pairs: list[Pair], lists: list[list[str]]) -> dict[str, torch.Tensor]:
        """Scores [B, N] of candidate lists as training computes them: "bi" by the retriever (the
        trained one, else a residual run's frozen one) and "cross" by the reranker, each put in eval
        mode (no dropout)."""
        mb = self._micro_batch(pairs, lists)
        scores = {}
        retriever = self.bi if self.bi is not None else self.frozen_bi
        if retriever is not None:
            scores["bi"] = self._bi_scores(mb, retriever.eval())[0]
        if self.cross is not None:
            scores["cross"] = self._cross_scores(self.cross.eval(), mb.cross, mb.lists)
        return scores

    # ------------------------------------------------------------------------------------ one step

    def _micro_step(self, mb: MicroBatch, scale: float, logs: StepLosses) -> tuple | None:
        """Forward/backward one micro-batch; gradients accumulate (scaled by 1 / grad_accum). In ``mutual``
        mode the reranker's backward must wait for the retriever's update: its inputs are returned."""
        cfg = self.cfg
        with autocast(self.device, cfg.cpu_bf16):
            R = R_ce = G = None
            if self.bi is not None:
                R, R_ce = self._bi_scores(mb)
            if self.cross is not None:
                G = self._cross_scores(self.wrapped["cross"], mb.cross, mb.lists)

            if cfg.mode == "independent":
                if R is not None:
                    self._backward("bi", R_ce, None, scale, logs)
                if G is not None:
                    if cfg.cross_residual:  # the list's scores: the frozen retriever's plus the correction
                        with torch.no_grad():
                            base = self._bi_scores(mb, self.frozen_bi)[0]  # [B, N]
                        G = G + base
                    self._backward("cross", listwise_ce(G), None, scale, logs)
            elif cfg.mode == "distill":
                with torch.no_grad():
                    K = self._cross_scores(self.teacher, mb.teacher, mb.lists)
                if R is not None:
                    kl = cfg.gamma_r * kl_to_target(K, R, cfg.tau)
                    self._backward("bi", R_ce, kl, scale, logs)
                else:
                    kl = cfg.gamma_g * kl_to_target(K, G, cfg.tau)
                    self._backward("cross", listwise_ce(G), kl, scale, logs)
            elif cfg.mode == "core":
                # Both losses from the same forward pass; each KL target is detached inside kl_to_target.
                self._backward("bi", R_ce, cfg.gamma_r * kl_to_target(G, R, cfg.tau), scale, logs)
                self._backward(
                    "cross", listwise_ce(G), cfg.gamma_g * kl_to_target(R, G, cfg.tau), scale, logs
                )
            else:  # mutual: the retriever's loss uses G now; the reranker's uses the *updated* retriever
                self._backward("bi", R_ce, cfg.alpha * kl_to_target(G, R, cfg.tau), scale, logs)
                return mb, G
        return None

    def _backward(
        self, name: str, ce: torch.Tensor, kl: torch.Tensor | None, scale: float, logs: StepLosses
    ) -> None:
        loss = ce if kl is None else ce + kl
        logs.add(f"{name}_ce", ce * scale)
        if kl is not None:
            logs.add(f"{name}_kl", kl * scale)
        logs.add(f"{name}_loss", loss * scale)
        loss.mul(scale).backward()

    def _optimizer_step(self, name: str) -> None:
        model = self.bi if name == "bi" else self.cross
        torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.grad_clip)
        self.optimizers[name].step()
        self.schedulers[name].step()
        self.optimizers[name].zero_grad(set_to_none=True)

    def train_step(self, epoch: int, index: int) -> StepLosses:
        """One optimizer step on global batch ``index`` of ``epoch``; returns this rank's losses, still on
        the device (:meth:`reduce_losses` reads them)."""
        cfg = self.cfg
        logs = StepLosses()
        scale = 1.0 / cfg.grad_accum
        pending = []
        for mb in self._take(epoch, index):
            for key, value in mb.counts.items():
                self.token_counts[key] = self.token_counts.get(key, 0) + value
            waiting = self._micro_step(mb, scale, logs)
            if waiting is not None:
                pending.append(waiting)
        if "bi" in self.optimizers:
            self._optimizer_step("bi")
        if cfg.mode == "mutual":
            # Algorithm 1, line 10: recompute the retriever's predictions after its update.
            for mb, G in pending:
                with torch.no_grad(), autocast(self.device, cfg.cpu_bf16):
                    A_new, _ = self._bi_scores(mb)
                self._backward(
                    "cross", listwise_ce(G), cfg.alpha * kl_to_target(A_new, G, cfg.tau), scale, logs
                )
        if "cross" in self.optimizers:
            self._optimizer_step("cross")
        self.step += 1
        self.examples_seen += self.global_batch
        return logs

    def reduce_losses(self, logs: StepLosses, steps: int = 1) -> dict[str, float]:
        """Mean per step over ``steps`` and over the ranks, as floats (one host synchronisation)."""
        keys = sorted(logs.values)
        if not keys:
            return {}
        t = torch.stack([logs.values[k] for k in keys]).double()
        if self.world > 1:
            dist.all_reduce(t)
        return {k: v / (self.world * steps) for k, v in zip(keys, t.tolist(), strict=True)}

    # ------------------------------------------------------------------------------------ validation

    def validate(self) -> dict[str, dict[str, float]]:
        if not self.valid_pairs:
            return {}
        for m in (self.bi, self.cross):
            if m is not None:
                m.eval()
        retriever = self.frozen_bi if self.cfg.cross_residual else self.bi  # a residual reranker's: its sum
        result = evaluate_lists(self.valid_pairs, self.valid_lists, retriever, self.cross)
        if self.valid_pool:
            result |= evaluate_pool(self.valid_pairs, self.valid_pool, self._pool_recall(), self.cross)
        for m in (self.bi, self.cross):
            if m is not None:
                m.train()
        return {name: r["metrics"] for name, r in result.items()}

    def _pool_recall(self) -> Retrieved:
        """The retriever's candidates over the validation pool: the trained one's anew, a frozen one's
        once."""
        if self.bi is not None:
            return recall_pool(self.valid_pairs, self.valid_pool, self.bi)
        if self._frozen_recall is None:
            self._frozen_recall = recall_pool(self.valid_pairs, self.valid_pool, self.frozen_bi)
        return self._frozen_recall

    # ------------------------------------------------------------------------------------ state

    def _provenance(self, valid: dict[str, Any] | None = None) -> dict[str, Any]:
        residual = {"residual_to": self.frozen_bi.content_hash} if self.cfg.cross_residual else {}
        return {
            **residual,
            "train_config": asdict(self.cfg),
            "step": self.step,
            "examples_seen": self.examples_seen,
            "train_seconds": round(self.train_seconds, 1),
            "valid": valid or {},
        }

    def save_state(self) -> None:
        """Resumable state: last weights (safetensors) + optimizer/scheduler/counters (tensors only)."""
        if self.rank != 0:
            return
        state_dir = self.out / "state"
        for name, model in (("bi", self.bi), ("cross", self.cross)):
            if model is not None:
                save_checkpoint(model, state_dir / name, self._provenance())
        trainer_state = {
            "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
            "schedulers": {k: s.state_dict() for k, s in self.schedulers.items()},
            "counters": torch.tensor([self.step, self.stale_evals, self.examples_seen], dtype=torch.long),
            "train_seconds": torch.tensor(self.train_seconds, dtype=torch.float64),
            "elapsed_seconds": torch.tensor(self._elapsed(), dtype=torch.float64),
            "rng": torch.get_rng_state(),  # dropout masks continue exactly after a resume
        }
        if torch.cuda.is_available():
            trainer_state["cuda_rng"] = torch.cuda.get_rng_state_all()
        tmp = state_dir / ".trainer.pt.tmp"
        torch.save(trainer_state, tmp)
        os.replace(tmp, state_dir / "trainer.pt")
        write_json_atomic(state_dir / "best.json", self.best)

    def load_state(self) -> bool:
        """Resume from ``output_dir/state`` if present. Returns whether it resumed."""
        state_dir = self.out / "state"
        if not (state_dir / "trainer.pt").is_file():
            return False
        for name, model in (("bi", self.bi), ("cross", self.cross)):
            if model is not None:
                saved = load_checkpoint(state_dir / name, expect=name, merge=False)
                model.load_state_dict(saved.state_dict())
        state = torch.load(state_dir / "trainer.pt", map_location=self.device, weights_only=True)
        for k, o in self.optimizers.items():
            o.load_state_dict(state["optimizers"][k])
        for k, s in self.schedulers.items():
            s.load_state_dict(state["schedulers"][k])
        self.step, self.stale_evals, self.examples_seen = (int(x) for x in state["counters"].tolist())
        self.train_seconds = float(state["train_seconds"])
        self._elapsed_before = float(state.get("elapsed_seconds", 0.0))  # absent in older states
        torch.set_rng_state(state["rng"].cpu())
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda_rng"]])
        self.best = json.loads((state_dir / "best.json").read_text())
        return True

    def _elapsed(self) -> float:
        return self.clock() - self._started

    def _plan_within_budget(self, bar: tqdm) -> None:
        """With ``--max-minutes``: re-plan how many steps the run takes (never more than planned) from this
        process's measured step and validation times, so that the last step's validation ends inside the
        budget; the learning-rate schedule follows (:func:`warmup_linear`). A plan of the current step
        ends the run here. Called where the GPU has just been waited for (a logged loss, a validation)."""
        if self.cfg.max_minutes is None or self._mark is None or self.step == self._mark[0]:
            return
        now = self.clock()
        step0, t0, valids0 = self._mark
        per_valid = float(np.mean(self._valid_seconds)) if self._valid_seconds else 0.0
        per_step = (now - t0 - sum(self._valid_seconds[valids0:])) / (self.step - step0)
        left = self.cfg.max_minutes * 60 - self._elapsed()
        every = self.cfg.eval_every if self.valid_pairs else None
        more = steps_within(left, self.step, per_step, per_valid, every)
        total = torch.tensor(min(self.planned_steps, self.step + more), device=self.device)
        if self.world > 1:  # every rank must stop at the same step
            dist.all_reduce(total, op=dist.ReduceOp.MIN)
        self.total_steps = max(self.step, int(total))
        bar.total = self.total_steps

    def _log(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def _selected_by(self, name: str, model: torch.nn.Module) -> str:
        """The validation row whose hits@1 chooses ``name``'s checkpoint."""
        if isinstance(model, PolyEncoder):
            return "poly"
        # Each model in its own order (a residual reranker's: the retriever's scores plus its correction),
        # over the pool where there is one, as it serves: the retriever's recall, the reranker's order of
        # the retriever's first candidates. Random 1-of-100 lists chose worse rerankers (results.md 39.1).
        own = "sum" if name == "cross" and self.cfg.cross_residual else name
        return f"{own}_pool" if self.valid_pool else own

    def _after_eval(self, valid: dict[str, dict[str, float]]) -> bool:
        """Save new bests; returns True when training should stop early."""
        improved = False
        for name, model in (("bi", self.bi), ("cross", self.cross)):
            if model is None or name not in valid:
                continue
            score = valid[self._selected_by(name, model)]["hits@1"]
            if score > self.best.get(name, -1.0):
                self.best[name] = score
                improved = True
                if self.rank == 0:
                    save_checkpoint(model, self.out / name, self._provenance(valid))
        self.stale_evals = 0 if improved else self.stale_evals + 1
        return self.stale_evals >= self.cfg.patience

    # ------------------------------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            write_json_atomic(
                self.out / "train_config.json", asdict(cfg) | ({"asked": self.asked} if self.asked else {})
            )
        resumed = self.load_state()
        if resumed and self.step >= self.total_steps:
            log.warning(
                "%s is already trained to step %d of %d: raise --max-steps (or --epochs) to train further",
                self.out,
                self.step,
                self.total_steps,
            )
        self._started = self.clock() - self._elapsed_before
        if not resumed and self.valid_pairs:
            t0 = self.clock()
            valid = self.validate()
            self._log({"step": 0, "examples_seen": 0, "valid": valid})
            self._after_eval(valid)
            self._valid_seconds.append(self.clock() - t0)
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=self.rank != 0,
            desc=f"train[{cfg.mode}]",
            dynamic_ncols=True,
        )
        stopped_early = False
        window = StepLosses()  # losses summed over the logging window, on the device
        window_start, window_steps = time.perf_counter(), 0
        while self.step < self.total_steps and not stopped_early:
            epoch, index = divmod(self.step, self.steps_per_epoch)
            t0 = time.perf_counter()
            window.merge(self.train_step(epoch, index))
            self.train_seconds += time.perf_counter() - t0
            window_steps += 1
            bar.update(1)
            if self._mark is None:  # the first step of a process warms caches up: measure from here
                self._mark = (self.step, self.clock(), len(self._valid_seconds))
            if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                means = self.reduce_losses(window, window_steps)  # waits for the GPU: the rate is true
                rate = window_steps * self.global_batch / max(1e-9, time.perf_counter() - window_start)
                window, window_start, window_steps = StepLosses(), time.perf_counter(), 0
                lrs = {name: s.get_last_lr()[0] for name, s in self.schedulers.items()}
                lr = {"lr": next(iter(lrs.values()))}  # the first model's; the reranker's too if it differs
                if len(set(lrs.values())) > 1:
                    lr["cross_lr"] = lrs["cross"]
                self._log({"step": self.step, "epoch": epoch, **lr, "examples_per_s": rate, **means})
                bar.set_postfix(
                    {k: f"{v:.3f}" for k, v in means.items() if k.endswith("_loss")} | {"ex/s": f"{rate:.1f}"}
                )
                self._plan_within_budget(bar)
            if self.step % cfg.eval_every == 0 or self.step == self.total_steps:
                t0 = self.clock()
                valid = self.validate()
                stopped_early = self._after_eval(valid) if valid else False
                self._log({"step": self.step, "examples_seen": self.examples_seen, "valid": valid})
                self.save_state()
                self._valid_seconds.append(self.clock() - t0)
                self._plan_within_budget(bar)
        bar.close()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(cancel_futures=True)
        if not self.valid_pairs and self.rank == 0:  # nothing to select on: keep the last weights
            for name, model in (("bi", self.bi), ("cross", self.cross)):
                if model is not None:
                    save_checkpoint(model, self.out / name, self._provenance())
        summary = {
            "mode": cfg.mode,
            "steps": self.step,
            "examples_seen": self.examples_seen,
            "train_seconds": round(self.train_seconds, 1),
            "tokenize_seconds": round(self.tokenize_seconds, 1),
            "tokens": self.token_counts,
            "best_valid_hits@1": self.best,
            "selected_by": {  # the validation row each best was measured on
                name: self._selected_by(name, model)
                for name, model in (("bi", self.bi), ("cross", self.cross))
                if model is not None
            },
            "stopped_early": stopped_early,
            "planned_steps": self.planned_steps,
            "max_minutes": cfg.max_minutes,
            "elapsed_seconds": round(self._elapsed(), 1),
            "device": str(self.device),
            "packed": self.packed,
            "world_size": self.world,
        }
        if self.rank == 0:
            write_json_atomic(self.out / "summary.json", summary)
            from evaluation.plots import plot_training_curves

            plot_training_curves(self.out / "metrics.jsonl", self.out / "training_curves.png")
        return summary
