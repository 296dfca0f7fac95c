"""Training throughput per mode: contexts/s, tokens/s, padding and model-FLOP utilisation (MFU).

Each mode trains a few warm-up steps, then ``--steps`` timed optimizer steps (the GPU is synchronised
at both ends of the window). FLOPs count the useful (unpadded) work of every transformer pass: per
sequence of L tokens and per layer, 2·L·P_layer for the weight matrices plus 4·L²·d for attention,
times 3 for a trained model (forward + backward) and 1 for a forward without gradient (the frozen
teacher; mutual learning's recomputed retriever scores). MFU divides by the device's nominal dense
bf16 peak (H100/H200) and, on any device, by a measured large-matmul peak.

    python bench/train_speed.py --out docs/train-speed-gpu.json            # CUDA: all-MiniLM-L6-v2
    python bench/train_speed.py --steps 3 --pairs 2000 --out /tmp/ts.json  # CPU: the tiny test model

``--variant`` adds ablations of the same mode: ``no-cache`` (every step calls the tokenizer, as before
the id cache), ``no-prefetch``, ``chunks=N`` (reranker pairs in token-budget chunks of N), ``batch=N``,
``compile``, ``packed`` (every model input without padding: ``--packed``; ``packed-compile`` with
``compile``), ``cpu-bf16`` (bf16 autocast on a CPU: ``--cpu-bf16``; ``packed-cpu-bf16`` with
``packed``), ``mined=N`` (N of the negatives are the pool's paraphrases of the last turn, mined by the
retriever as the lease's runs do; the miner's refresh, every ``hard_refresh`` steps, falls in the warm-up,
so the timed steps show the per-step cost of mining, not the refresh's).

With a packed variant the result also says whether packed and padded input score alike on this device
(``packed_check``: the untrained reranker on 256 training pairs under the run's autocast, and whether
CUDA's variable-length attention ran): a lease turns ``--packed`` on only when they do and it is faster.

``--profile N`` runs N more steps of each row under ``torch.profiler``: where a step's time goes (the
top operators by device time on CUDA, host time on the CPU) and, on CUDA, the share of the wall the
device was busy (well below 1: the host or synchronisation holds the GPU back).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from bench import (  # bench/bench.py: this directory is on sys.path
    device_busy_share,
    operators,
    provenance,
    refuse_below,
)
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import save_checkpoint
from coreply.config import ModelConfig
from coreply.corpus import build_pool, load_chitchat
from coreply.device import autocast, resolve_device
from coreply.models import CrossEncoder, varlen_runs_on
from training.config import MODES, TrainConfig
from training.trainer import Trainer

NOMINAL_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, SXM parts


def nominal_peak() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    if "H100" in name and "PCIe" in name:
        return 756e12
    return next((v * 1e12 for k, v in NOMINAL_BF16_TFLOPS.items() if k in name), None)


def measured_peak(device: torch.device) -> float:
    """FLOP/s of a large square matmul: bf16 on CUDA, fp32 on CPU."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    reps = 20 if device.type == "cuda" else 5
    a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def layer_flops(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, weight FLOPs per token per layer = 2 x matrix parameters, hidden size)."""
    backbone = getattr(model, "backbone", None) or model.context_tower
    layers = backbone.encoder.layer
    params = sum(p.numel() for n, p in layers[0].named_parameters() if p.dim() == 2 and "lora" not in n)
    return len(layers), 2 * params, backbone.config.hidden_size


def pass_flops(model: torch.nn.Module, lengths: torch.Tensor) -> float:
    """One forward pass over sequences of these real lengths."""
    n_layers, per_token, hidden = layer_flops(model)
    lengths = lengths.double()
    return float(n_layers * (per_token * lengths.sum() + 4 * hidden * (lengths**2).sum()))


def step_flops(trainer: Trainer, batches: list) -> float:
    """Useful FLOPs of one optimizer step (see the module docstring)."""
    total = 0.0
    mode = trainer.cfg.mode
    for mb in batches:
        if trainer.bi is not None:
            bi_lengths = torch.cat([b.attention_mask.sum(1) for _, b in mb.contexts + mb.responses])
            total += (4 if mode == "mutual" else 3) * pass_flops(trainer.bi, bi_lengths)
        if trainer.cross is not None:
            total += 3 * pass_flops(trainer.cross, torch.cat([b.attention_mask.sum(1) for _, b in mb.cross]))
        if trainer.teacher is not None:
            total += pass_flops(trainer.teacher, torch.cat([b.attention_mask.sum(1) for _, b in mb.teacher]))
    return total


def train(trainer: Trainer, first: int, steps: int) -> dict[str, float]:
    """``steps`` optimizer steps from step ``first``, with one host synchronisation, as a run logs."""
    window = None
    for i in range(first, first + steps):
        logs = trainer.train_step(*divmod(i, trainer.steps_per_epoch))
        window = logs if window is None else (window.merge(logs) or window)
    losses = trainer.reduce_losses(window, steps)
    _sync(trainer.device)
    return losses


def profiled(trainer: Trainer, first: int, steps: int, top: int = 15) -> dict[str, Any]:
    """``steps`` more steps under ``torch.profiler``: the wall per step, the device's busy share, and
    the ``top`` operators per step."""
    cuda = trainer.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        train(trainer, first, steps)
        wall = time.perf_counter() - start
    return {
        "steps": steps,
        "ms_per_step": round(1000 * wall / steps, 1),
        "device_busy_share": device_busy_share(prof, wall) if cuda else None,
        "operators": operators(prof, cuda, steps, top),
    }


def measure(
    cfg: TrainConfig, pairs, pool, variant: str, warmup: int, steps: int, epoch: int, profile_steps: int = 0
) -> dict[str, Any]:
    """Throughput of ``steps`` optimizer steps (then ``profile_steps`` under the profiler); ``epoch``:
    contexts in one epoch, for its duration."""
    trainer = Trainer(cfg, pairs, [], pool)
    if variant == "no-cache":
        for model in (trainer.bi, trainer.cross, trainer.teacher):
            if model is not None:
                model.tokenizer._cache.clear()
    flops, real_take = [0.0], trainer._take

    def counted_take(epoch: int, index: int):
        batches = real_take(epoch, index)
        flops[0] += step_flops(trainer, batches)
        return batches

    trainer._take = counted_take  # type: ignore[method-assign]
    for i in range(warmup):
        trainer.reduce_losses(trainer.train_step(0, i))
    _sync(trainer.device)
    flops[0], trainer.token_counts = 0.0, {}
    start = time.perf_counter()
    losses = train(trainer, warmup, steps)
    seconds = time.perf_counter() - start
    counts = trainer.token_counts
    real = sum(v for k, v in counts.items() if k.endswith("_tokens"))
    padded = sum(v for k, v in counts.items() if k.endswith("_padded"))
    memory = torch.cuda.max_memory_allocated() / 2**30 if trainer.device.type == "cuda" else None
    result = {
        "contexts_per_s": round(steps * trainer.global_batch / seconds, 1),
        "steps_per_s": round(steps / seconds, 2),
        "tokens_per_s": round(real / seconds),
        "padding_share": round(1 - real / padded, 3) if padded else None,
        "model_tflops_per_s": float(f"{flops[0] / seconds / 1e12:.4g}"),
        "tokenize_seconds": round(trainer.tokenize_seconds, 1),
        "epoch_minutes": round(epoch / (steps * trainer.global_batch / seconds) / 60, 1),
        "peak_memory_gib": round(memory, 1) if memory is not None else None,
        "losses": {k: round(v, 4) for k, v in losses.items()},
    }
    if profile_steps:
        result["profile"] = profiled(trainer, warmup + steps, profile_steps)
    return result


@torch.no_grad()
def packed_check(model: ModelConfig, pairs, device: torch.device, n: int = 256) -> dict[str, Any]:
    """How far packed input's scores are from padded input's, beside how far the training autocast's are
    from float32 (``autocast_noise``: what rounding alone moves): the untrained reranker in eval mode on
    the first ``n`` (context, gold) pairs; ``varlen``: whether ``varlen_attn`` runs here."""
    cross = CrossEncoder.from_pretrained(model).to(device).eval()
    batch = cross.tokenizer.pairs([p.context for p in pairs[:n]], [p.response for p in pairs[:n]])
    fp32 = cross(batch.to(device)).float()
    with autocast(device):
        padded = cross(batch.to(device)).float()
        packed = cross(batch.packed().to(device)).float()
    return {
        "pairs": len(batch.input_ids),
        "max_abs_diff": round(float((packed - padded).abs().max()), 5),
        "autocast_noise": round(float((padded - fp32).abs().max()), 5),
        "score_std": round(float(padded.std()), 5),
        "varlen": varlen_runs_on(device),  # autocast: half-precision queries there
    }


def config_for(base: TrainConfig, mode: str, variant: str, teacher: str) -> TrainConfig:
    cfg = replace(base, mode=mode, teacher=teacher if mode == "distill" else None, packed=False)
    if variant.endswith("cpu-bf16"):  # bf16 autocast on a CPU too (CUDA always has it)
        cfg = replace(cfg, cpu_bf16=True)
        variant = variant.removesuffix("cpu-bf16").rstrip("-") or "base"
    if variant == "no-prefetch":
        cfg = replace(cfg, prefetch=False)
    elif variant in ("compile", "packed", "packed-compile"):
        cfg = replace(cfg, compile="compile" in variant, packed="packed" in variant)
    elif variant.startswith("chunks="):
        cfg = replace(cfg, max_batch_tokens=int(variant.split("=")[1]))
    elif variant.startswith("batch="):
        cfg = replace(cfg, batch_size=int(variant.split("=")[1]))
    elif variant.startswith("mined="):  # the lease recipe's paraphrase negatives: a retriever pass per step
        cfg = replace(cfg, paraphrase_negatives=int(variant.split("=")[1]))
    elif variant not in ("base", "no-cache"):
        raise SystemExit(f"train_speed: unknown --variant {variant!r}")
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["independent", "distill", "core", "mutual"], choices=MODES)
    p.add_argument(
        "--variant",
        nargs="+",
        default=["base"],
        help="base, no-cache, no-prefetch, chunks=N, batch=N, compile, packed, packed-compile, cpu-bf16, "
        "packed-cpu-bf16, mined=N",
    )
    p.add_argument(
        "--base-model", default=None, help="default: all-MiniLM-L6-v2 on CUDA, the tiny model on CPU"
    )
    p.add_argument("--batch-size", type=int, default=64, help="contexts per step")
    p.add_argument("--num-negatives", type=int, default=31, help="delta_r: each list is 1 gold + this many")
    p.add_argument("--max-batch-tokens", type=int, default=0)
    p.add_argument("--in-batch", action="store_true", help="the retriever also ranks other contexts' lists")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", type=int, default=0, help="then N steps under torch.profiler, per row")
    p.add_argument("--pairs", type=int, default=0, help="use the first N training pairs (0 = all 118,111)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    refuse_below(args)  # --out
    if min(args.steps, args.batch_size, args.num_negatives) < 1:
        raise SystemExit("train_speed: --steps, --batch-size and --num-negatives must be >= 1")
    if min(args.warmup, args.pairs, args.max_batch_tokens, args.profile) < 0:
        raise SystemExit("train_speed: --warmup, --pairs, --max-batch-tokens and --profile must be >= 0")

    device = resolve_device(args.device)
    work = Path(tempfile.mkdtemp(prefix="train-speed-"))
    base_model = args.base_model
    if base_model is None:
        if device.type == "cuda":
            base_model = "default"
        else:
            sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
            from tiny import write_tiny_model

            base_model = str(write_tiny_model(work / "tiny"))
    model = ModelConfig(base_model=base_model)
    splits = load_chitchat(model.max_turns)
    pairs = splits["train"][: args.pairs or None]
    pool = build_pool(p.response for p in pairs)
    teacher = work / "teacher"
    save_checkpoint(CrossEncoder.from_pretrained(model), teacher, {"note": "untrained: timing only"})
    base = TrainConfig(
        output_dir=str(work / "run"),
        model=model,
        num_negatives=args.num_negatives,
        batch_size=args.batch_size,
        max_batch_tokens=args.max_batch_tokens,
        in_batch=args.in_batch,
        max_steps=10**9,
        valid_size=0,
        device=str(device),
    )
    peak = measured_peak(device)
    nominal = nominal_peak()
    rows: list[dict[str, Any]] = []
    result = {
        **provenance(),
        "base_model": base_model,
        "device": str(device),
        "train_pairs": len(pairs),
        "list_size": args.num_negatives + 1,
        "measured_matmul_tflops": round(peak / 1e12, 2),
        "nominal_bf16_tflops": nominal and nominal / 1e12,
        "rows": rows,
    }
    if any(v.startswith("packed") for v in args.variant):
        result["packed_check"] = packed_check(model, pairs, device)
        print(f"packed against padded: {result['packed_check']}", flush=True)
    for mode in args.modes:
        for variant in args.variant:
            try:
                cfg = config_for(base, mode, variant, str(teacher))
            except ValueError as exc:  # e.g. mined=N with fewer negatives than N
                raise SystemExit(f"train_speed: --variant {variant}: {exc}") from None
            r = measure(
                cfg, pairs, pool, variant, args.warmup, args.steps, len(splits["train"]), args.profile
            )
            gc.collect()  # the run's models go before the next one starts
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            r |= {"mode": mode, "variant": variant, "batch_size": cfg.batch_size}
            r["mfu_vs_measured_matmul"] = float(f"{r['model_tflops_per_s'] * 1e12 / peak:.4g}")
            if nominal:
                r["mfu"] = round(r["model_tflops_per_s"] * 1e12 / nominal, 4)
            rows.append(r)
            print(
                f"{mode:<12} {variant:<12} {r['contexts_per_s']:>9.1f} ctx/s {r['tokens_per_s']:>10} tok/s "
                f"pad {r['padding_share']} {r['model_tflops_per_s']:.2f} TFLOP/s "
                f"MFU {r.get('mfu', r['mfu_vs_measured_matmul']):.3f} epoch {r['epoch_minutes']} min",
                flush=True,
            )
            if "profile" in r:
                prof = r["profile"]
                busy = prof["device_busy_share"]
                print(
                    f"  {prof['ms_per_step']} ms a step"
                    + (f", device busy {busy:.0%}" if busy is not None else "")
                )
                for op in prof["operators"][:8]:
                    ms = f"{op['self_device_ms']:>8} device / {op['self_host_ms']:>8} host ms a step"
                    print(f"  {op['op'][:48]:<48} {op['calls_per_batch']:>7} calls {ms}")
            write_json_atomic(args.out, result)  # after every row: a run cut off keeps what it measured
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
