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
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from coreply.adapters import add_lora
from coreply.checkpoint import load_checkpoint, save_checkpoint, write_json_atomic
from coreply.corpus import Pair
from coreply.device import autocast, resolve_device
from coreply.models import BiEncoder, CrossEncoder
from coreply.text import normalize
from training.config import TrainConfig
from training.evaluation import evaluate_lists, protocol_a_lists
from training.losses import kl_to_target, listwise_ce
from training.sampling import HardNegativeMiner, NegativeSampler, epoch_order, step_rng


@dataclass
class StepLosses:
    """Detached per-step losses for logging."""

    values: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: torch.Tensor) -> None:
        self.values[name] = self.values.get(name, 0.0) + float(value.detach())


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _scheduler(optimizer: torch.optim.Optimizer, total: int, warmup_ratio: float):
    warmup = max(1, int(total * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Trainer:
    def __init__(
        self, config: TrainConfig, train: Sequence[Pair], valid: Sequence[Pair], negative_pool: Sequence[str]
    ) -> None:
        self.cfg = config
        self.rank, self.world = _world()
        self.device = resolve_device(config.device)
        if self.world > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        self.train_pairs = list(train)
        self.valid_pairs = list(valid)[: config.valid_size]
        self.sampler = NegativeSampler(negative_pool)
        self.valid_lists = (
            protocol_a_lists(
                self.valid_pairs, [p.response for p in valid], config.valid_candidates, seed=config.seed
            )
            if self.valid_pairs
            else []
        )
        self.out = Path(config.output_dir)
        self.bi, self.cross, self.teacher = self._build_models()
        self.global_batch = config.batch_size * config.grad_accum * self.world
        self.steps_per_epoch = max(1, len(self.train_pairs) // self.global_batch)
        self.total_steps = config.max_steps or self.steps_per_epoch * config.epochs
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedulers: dict[str, Any] = {}
        self.wrapped: dict[str, torch.nn.Module] = {}
        for name, model in (("bi", self.bi), ("cross", self.cross)):
            if model is None:
                continue
            trainable = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
            self.optimizers[name] = opt
            self.schedulers[name] = _scheduler(opt, self.total_steps, config.warmup_ratio)
            self.wrapped[name] = DistributedDataParallel(model) if self.world > 1 else model
        self.miner = (
            HardNegativeMiner(
                negative_pool,
                config.hard_negatives,
                config.hard_refresh,
                config.hard_pool,
                config.hard_top,
                config.seed,
            )
            if config.hard_negatives
            else None
        )
        if self.miner is not None and self.bi is None:
            raise ValueError("hard negatives are mined by the bi-encoder, which this run does not train")
        self.step = 0
        self.best: dict[str, float] = {}
        self.stale_evals = 0
        self.examples_seen = 0
        self.train_seconds = 0.0

    # ------------------------------------------------------------------------------------ set-up

    def _build_models(self) -> tuple[BiEncoder | None, CrossEncoder | None, CrossEncoder | None]:
        cfg = self.cfg
        bi = cross = teacher = None
        if cfg.trains_bi:
            bi = (
                load_checkpoint(cfg.init_bi, expect="bi")
                if cfg.init_bi
                else BiEncoder.from_pretrained(cfg.model)
            )
            bi = bi.to(self.device).train()
        if cfg.trains_cross:
            cross = (
                load_checkpoint(cfg.init_cross, expect="cross")
                if cfg.init_cross
                else CrossEncoder.from_pretrained(cfg.model)
            )
            cross = cross.to(self.device).train()
        if cfg.lora_rank:
            for model in (bi, cross):
                if model is not None:
                    add_lora(model, cfg.lora_rank, cfg.lora_alpha)
        if cfg.mode == "distill":
            teacher = load_checkpoint(cfg.teacher, expect="cross").to(self.device).eval()
            teacher.requires_grad_(False)
        return bi, cross, teacher  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------ batches

    def _global_batch(self, epoch: int, index: int) -> tuple[list[Pair], np.random.Generator]:
        order = epoch_order(len(self.train_pairs), self.cfg.seed, epoch)
        chosen = order[index * self.global_batch : (index + 1) * self.global_batch]
        return [self.train_pairs[i] for i in chosen], step_rng(self.cfg.seed, epoch, index)

    def _candidate_lists(self, pairs: Sequence[Pair], rng: np.random.Generator) -> list[list[str]]:
        """Positive first; hard negatives (if any) then random ones, delta_r negatives in all."""
        hard = self.miner.mine(self.bi, pairs, rng) if self.miner is not None else [[] for _ in pairs]
        lists = []
        for pair, mined in zip(pairs, hard, strict=True):
            rest = self.sampler.sample(
                pair.response, self.cfg.num_negatives - len(mined), rng, avoid={normalize(t) for t in mined}
            )
            lists.append([pair.response, *mined, *rest])
        return lists

    # ------------------------------------------------------------------------------------ scores

    def _bi_scores(self, contexts: Sequence[Sequence[str]], lists: Sequence[Sequence[str]]):
        """-> own-list scores R [B, N], and the CE logits/targets (over all lists with in-batch negatives)."""
        n = len(lists[0])
        tok = self.bi.tokenizer
        flat = [t for cands in lists for t in cands]
        ctx, resp = self.wrapped["bi"](
            tok.contexts(contexts).to(self.device), tok.responses(flat).to(self.device)
        )
        resp = resp.view(len(lists), n, -1)  # [B, N, D]
        own = torch.einsum("bd,bnd->bn", ctx, resp)  # [B, N]
        if not self.cfg.in_batch:
            return own, own, None
        everything = ctx @ resp.reshape(-1, resp.shape[-1]).T  # [B, B*N]
        targets = torch.arange(len(lists), device=ctx.device) * n
        return own, everything, targets

    def _cross_scores(
        self, model, contexts: Sequence[Sequence[str]], lists: Sequence[Sequence[str]]
    ) -> torch.Tensor:
        """-> G [B, N]"""
        flat_c = [c for c, cands in zip(contexts, lists, strict=True) for _ in cands]
        flat_r = [t for cands in lists for t in cands]
        return model(model_tokenizer(model).pairs(flat_c, flat_r).to(self.device)).view(len(lists), -1)

    # ------------------------------------------------------------------------------------ one step

    def _micro_step(
        self, pairs: Sequence[Pair], lists: Sequence[Sequence[str]], scale: float, logs: StepLosses
    ) -> tuple[list, list, torch.Tensor] | None:
        """Forward/backward one micro-batch; gradients accumulate (scaled by 1 / grad_accum). In ``mutual``
        mode the reranker's backward must wait for the retriever's update: its inputs are returned."""
        cfg = self.cfg
        contexts = [p.context for p in pairs]
        with autocast(self.device):
            R = R_ce = R_targets = G = None
            if self.bi is not None:
                R, R_ce, R_targets = self._bi_scores(contexts, lists)
            if self.cross is not None:
                G = self._cross_scores(self.wrapped["cross"], contexts, lists)

            if cfg.mode == "independent":
                if R is not None:
                    self._backward("bi", listwise_ce(R_ce, R_targets), None, scale, logs)
                if G is not None:
                    self._backward("cross", listwise_ce(G), None, scale, logs)
            elif cfg.mode == "distill":
                with torch.no_grad():
                    K = self._cross_scores(self.teacher, contexts, lists)
                if R is not None:
                    kl = cfg.gamma_r * kl_to_target(K, R, cfg.tau)
                    self._backward("bi", listwise_ce(R_ce, R_targets), kl, scale, logs)
                else:
                    kl = cfg.gamma_g * kl_to_target(K, G, cfg.tau)
                    self._backward("cross", listwise_ce(G), kl, scale, logs)
            elif cfg.mode == "core":
                # Both losses from the same forward pass; each KL target is detached inside kl_to_target.
                self._backward(
                    "bi", listwise_ce(R_ce, R_targets), cfg.gamma_r * kl_to_target(G, R, cfg.tau), scale, logs
                )
                self._backward(
                    "cross", listwise_ce(G), cfg.gamma_g * kl_to_target(R, G, cfg.tau), scale, logs
                )
            else:  # mutual: the retriever's loss uses G now; the reranker's uses the *updated* retriever
                self._backward(
                    "bi", listwise_ce(R_ce, R_targets), cfg.alpha * kl_to_target(G, R, cfg.tau), scale, logs
                )
                return contexts, list(lists), G
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

    def train_step(self, epoch: int, index: int) -> dict[str, float]:
        """One optimizer step on global batch ``index`` of ``epoch``; returns the global-mean losses."""
        cfg = self.cfg
        pairs, rng = self._global_batch(epoch, index)
        if self.miner is not None:
            self.miner.maybe_refresh(self.bi, self.step)
        lists = self._candidate_lists(pairs, rng)  # every rank builds the same global lists
        local = slice(
            self.rank * cfg.batch_size * cfg.grad_accum, (self.rank + 1) * cfg.batch_size * cfg.grad_accum
        )
        my_pairs, my_lists = pairs[local], lists[local]
        logs = StepLosses()
        scale = 1.0 / cfg.grad_accum
        pending = []
        for start in range(0, len(my_pairs), cfg.batch_size):
            waiting = self._micro_step(
                my_pairs[start : start + cfg.batch_size],
                my_lists[start : start + cfg.batch_size],
                scale,
                logs,
            )
            if waiting is not None:
                pending.append(waiting)
        if "bi" in self.optimizers:
            self._optimizer_step("bi")
        if cfg.mode == "mutual":
            # Algorithm 1, line 10: recompute the retriever's predictions after its update.
            for contexts, lists_, G in pending:
                with torch.no_grad(), autocast(self.device):
                    A_new, _, _ = self._bi_scores(contexts, lists_)
                self._backward(
                    "cross", listwise_ce(G), cfg.alpha * kl_to_target(A_new, G, cfg.tau), scale, logs
                )
        if "cross" in self.optimizers:
            self._optimizer_step("cross")
        values = logs.values
        if self.world > 1:
            keys = sorted(values)
            t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            values = {k: float(v) / self.world for k, v in zip(keys, t.tolist(), strict=True)}
        self.step += 1
        self.examples_seen += len(pairs)
        return values

    # ------------------------------------------------------------------------------------ validation

    def validate(self) -> dict[str, dict[str, float]]:
        if not self.valid_pairs:
            return {}
        for m in (self.bi, self.cross):
            if m is not None:
                m.eval()
        result = evaluate_lists(self.valid_pairs, self.valid_lists, self.bi, self.cross)
        for m in (self.bi, self.cross):
            if m is not None:
                m.train()
        return {name: r["metrics"] for name, r in result.items()}

    # ------------------------------------------------------------------------------------ state

    def _provenance(self, valid: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
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
        torch.set_rng_state(state["rng"].cpu())
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda_rng"]])
        self.best = json.loads((state_dir / "best.json").read_text())
        return True

    def _log(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            with open(self.out / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def _after_eval(self, valid: dict[str, dict[str, float]]) -> bool:
        """Save new bests; returns True when training should stop early."""
        improved = False
        for name, model in (("bi", self.bi), ("cross", self.cross)):
            if model is None or name not in valid:
                continue
            score = valid[name]["hits@1"]
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
            write_json_atomic(self.out / "train_config.json", asdict(cfg))
        resumed = self.load_state()
        if not resumed and self.valid_pairs:
            valid = self.validate()
            self._log({"step": 0, "examples_seen": 0, "valid": valid})
            self._after_eval(valid)
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=self.rank != 0,
            desc=f"train[{cfg.mode}]",
            dynamic_ncols=True,
        )
        stopped_early = False
        window = StepLosses()  # losses summed over the logging window
        window_start, window_steps = time.perf_counter(), 0
        while self.step < self.total_steps and not stopped_early:
            epoch, index = divmod(self.step, self.steps_per_epoch)
            t0 = time.perf_counter()
            for name, value in self.train_step(epoch, index).items():
                window.values[name] = window.values.get(name, 0.0) + value
            self.train_seconds += time.perf_counter() - t0
            window_steps += 1
            bar.update(1)
            if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                rate = window_steps * self.global_batch / max(1e-9, time.perf_counter() - window_start)
                means = {k: v / window_steps for k, v in window.values.items()}
                window, window_start, window_steps = StepLosses(), time.perf_counter(), 0
                lr = self.schedulers[next(iter(self.schedulers))].get_last_lr()[0]
                self._log({"step": self.step, "epoch": epoch, "lr": lr, "examples_per_s": rate, **means})
                bar.set_postfix(
                    {k: f"{v:.3f}" for k, v in means.items() if k.endswith("_loss")} | {"ex/s": f"{rate:.1f}"}
                )
            if self.step % cfg.eval_every == 0 or self.step == self.total_steps:
                valid = self.validate()
                stopped_early = self._after_eval(valid) if valid else False
                self._log({"step": self.step, "examples_seen": self.examples_seen, "valid": valid})
                self.save_state()
        bar.close()
        if not self.valid_pairs and self.rank == 0:  # nothing to select on: keep the last weights
            for name, model in (("bi", self.bi), ("cross", self.cross)):
                if model is not None:
                    save_checkpoint(model, self.out / name, self._provenance())
        summary = {
            "mode": cfg.mode,
            "steps": self.step,
            "examples_seen": self.examples_seen,
            "train_seconds": round(self.train_seconds, 1),
            "best_valid_hits@1": self.best,
            "stopped_early": stopped_early,
            "device": str(self.device),
            "world_size": self.world,
        }
        if self.rank == 0:
            write_json_atomic(self.out / "summary.json", summary)
            from training.plots import plot_training_curves

            plot_training_curves(self.out / "metrics.jsonl", self.out / "training_curves.png")
        return summary


def model_tokenizer(model: torch.nn.Module):
    """The dialogue tokenizer of a model, also through a DDP wrapper."""
    return (model.module if isinstance(model, DistributedDataParallel) else model).tokenizer
