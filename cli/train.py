"""``coreply train``, ``pretrain`` and ``ground`` (train / eval)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from cli.common import (
    DEFAULTS_SHOWN,
    CliError,
    add_model_args,
    at_least,
    checkpoint,
    load_data,
    model_config,
    out_file,
    result_name,
    run_dir,
)
from coreply.artifacts import read_json, write_json_atomic


def train_parser(sub) -> None:
    from training.config import HELP, MODES, TrainConfig

    p = sub.add_parser(
        "train",
        help="train the retriever and/or reranker (modes: " + ", ".join(MODES) + ")",
        **DEFAULTS_SHOWN,
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="core",
        help="core: both models, each also learning from the other; independent: each alone; distill: a "
        "trained reranker teaches; mutual: the precursor's alternating updates",
    )
    p.add_argument("--data", default="chitchat", help="'chitchat' (built-in) or a .jsonl/.csv/.json file")
    p.add_argument("--valid-data", default=None, help="validation file (default: the corpus's valid split)")
    p.add_argument(
        "--output-dir", "-o", type=run_dir, required=True, help="run directory (checkpoints bi/ and cross/)"
    )
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue the run already in --output-dir")
    again.add_argument("--overwrite", action="store_true", help="delete the run in --output-dir, start anew")
    add_model_args(p)
    skip = {"mode", "output_dir", "model"}
    none_default = {  # the type of a field whose default (None) does not say it
        "max_steps": int,
        "max_minutes": float,
        "cross_lora_rank": int,
        "cross_lr": float,
        "init_bi": checkpoint("bi"),
        "init_cross": checkpoint("cross"),
        "teacher": checkpoint("cross"),
    }
    for f in fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        help_ = HELP[f.name]
        if isinstance(default, bool) or f.name == "packed":  # packed: None, i.e. by device
            action = argparse.BooleanOptionalAction if default is not False else "store_true"
            p.add_argument(flag, action=action, default=default, help=help_)
        elif f.name == "models":
            p.add_argument(flag, choices=["both", "bi", "cross"], default=default, help=help_)
        else:
            kind = none_default.get(f.name) or {int: int, float: float}.get(type(default), str)
            p.add_argument(flag, type=kind, default=default, help=help_)


def cmd_train(args: argparse.Namespace) -> int:
    from coreply.readers import read_pairs
    from training.config import TrainConfig

    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if f.name not in {"model"}}
    config = TrainConfig(**values, model=model_config(args))
    splits = load_data(args.data, config.model.max_turns)  # a bad file is said before torch's imports
    valid = read_pairs(args.valid_data) if args.valid_data else splits.get("valid", [])
    import torch.distributed as dist

    from coreply.corpus import build_pool
    from coreply.device import resolve_device
    from training.trainer import Trainer

    resolve_device(config.device)
    config = _prepare_run_dir(Path(config.output_dir), config, args.resume, args.overwrite)  # may delete
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        import torch

        dist.init_process_group("nccl" if torch.cuda.is_available() and config.device != "cpu" else "gloo")
    try:
        trainer = Trainer(config, splits["train"], valid, build_pool(p.response for p in splits["train"]))
        summary = trainer.fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(json.dumps(summary, indent=2))
    return 0


def _prepare_run_dir(out: Path, config: Any, resume: bool, overwrite: bool) -> Any:
    """A run directory holds one run: continuing it needs ``--resume`` (and the same recipe), starting
    again ``--overwrite``; without either, an existing run is refused. Returns ``config``, whose
    ``packed`` a resume that does not set it takes from the run (as trained, on whatever device)."""
    import shutil

    from training.config import RESUMABLE

    saved_path = out / "train_config.json"
    if not saved_path.is_file():
        if resume:
            raise CliError(f"--resume: no run in {out} (no train_config.json); drop --resume to start one")
        return config
    if overwrite:
        for name in ("bi", "cross", "state", "metrics.jsonl", "summary.json", "train_config.json"):
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        return config
    if not resume:
        raise CliError(
            f"{out} already holds a run; pass --resume to continue it or --overwrite to start again"
        )
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CliError(f"--resume: cannot read {saved_path} ({exc}); use --overwrite") from None
    if config.packed is None:
        config = replace(config, packed=saved.get("packed"))
    new = json.loads(json.dumps(asdict(config)))
    asked = saved.get("asked", {})  # values the data capped (Trainer.asked): either is the run's
    changed = sorted(
        k for k in new if k not in RESUMABLE and new[k] not in (saved.get(k), asked.get(k, saved.get(k)))
    )
    if changed:
        flags = ", ".join("--" + k.replace("_", "-") for k in changed)
        raise CliError(f"--resume: {flags} differ from the run in {out}; keep its values or --overwrite")
    return config


def pretrain_parser(sub) -> None:
    p = sub.add_parser(
        "pretrain",
        help="post-train the retriever's encoder on dialogue before fine-tuning (Dial-MAE)",
        **DEFAULTS_SHOWN,
    )
    p.add_argument("--objective", choices=["dial-mae"], default="dial-mae", help="post-training objective")
    p.add_argument("--data", default="chitchat", help="'chitchat' (its train split) or a pairs file")
    p.add_argument(
        "--output-dir", "-o", type=run_dir, required=True, help="run directory; the encoder lands in bi/"
    )
    p.add_argument("--enc-mask", type=float, default=0.30, help="share of context tokens masked (encoder)")
    p.add_argument("--dec-mask", type=float, default=0.75, help="share of response tokens masked (decoder)")
    p.add_argument("--decoder-layers", type=at_least(1), default=1, help="depth of the throw-away decoder")
    p.add_argument("--batch-size", type=at_least(1), default=16, help="pairs per step")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (the paper's for English)")
    p.add_argument("--max-steps", type=at_least(1), default=1000, help="optimizer steps")
    p.add_argument("--seed", type=at_least(0), default=42, help="seed of the batches and the masks")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add_model_args(p)


def cmd_pretrain(args: argparse.Namespace) -> int:
    if (Path(args.output_dir) / "bi").exists():
        raise CliError(f"{args.output_dir} already holds a post-trained encoder (bi/); choose another -o")
    pairs = load_data(args.data, args.max_turns)["train"]  # a bad file is said before torch's imports
    from coreply.device import resolve_device
    from training.dialmae import DialMAEConfig, pretrain

    config = DialMAEConfig(
        output_dir=args.output_dir,
        model=model_config(args),
        enc_mask=args.enc_mask,
        dec_mask=args.dec_mask,
        decoder_layers=args.decoder_layers,
        batch_size=args.batch_size,
        lr=args.lr,
        max_steps=args.max_steps,
        seed=args.seed,
        device=args.device,
    )
    resolve_device(config.device)
    print(json.dumps(pretrain(config, pairs), indent=2))
    print(f"fine-tune from it: coreply train --init-bi {Path(config.output_dir) / 'bi'} ...")
    return 0


def ground_parser(sub) -> None:
    from training.config import SELECTIONS, GroundedConfig

    d = GroundedConfig()
    p = sub.add_parser("ground", help="knowledge-grounded ranking: train (RecKGC and baselines), evaluate")
    gsub = p.add_subparsers(dest="ground_command", required=True)
    t = gsub.add_parser(
        "train",
        help="train a ranker that reads knowledge, and its knowledge retriever by reciprocal learning",
        **DEFAULTS_SHOWN,
    )
    t.add_argument(
        "--output-dir", "-o", type=run_dir, required=True, help="run directory: cross/ (+ knowledge/)"
    )
    t.add_argument(
        "--knowledge",
        choices=SELECTIONS,
        default=d.knowledge,
        help="what the ranker reads: the retriever's top-m trained reciprocally, a frozen retriever's "
        "top-m, all sentences as given, or none",
    )
    t.add_argument(
        "--data",
        default="chitchat",
        help="'chitchat' (persona knowledge) or a JSONL file with 'knowledge' lists",
    )
    t.add_argument("--init-cross", default=None, help="start the ranker from this cross-encoder checkpoint")
    t.add_argument(
        "--init-retriever", default=None, help="start the knowledge retriever from this checkpoint"
    )
    t.add_argument("--top-m", type=at_least(1), default=d.top_m, help="knowledge sentences the ranker reads")
    t.add_argument(
        "--max-knowledge-tokens",
        type=at_least(3),
        default=d.model.max_knowledge_tokens,
        help="tokens of knowledge in a ranker pair (before the context)",
    )
    t.add_argument(
        "--feedback",
        choices=["both", "ranker", "f1"],
        default=d.feedback,
        help="the retriever's target: the ranker's p(r+|k) plus unigram F1 (Eq. 10), or one of them",
    )
    t.add_argument("--tau", type=float, default=d.tau, help="temperature of the retriever's top-m softmax")
    t.add_argument("--num-negatives", type=at_least(1), default=d.num_negatives, help="negatives per list")
    t.add_argument("--batch-size", type=at_least(1), default=d.batch_size, help="contexts per step")
    t.add_argument("--lr", type=float, default=d.lr, help="ranker learning rate")
    t.add_argument(
        "--retriever-lr", type=float, default=d.retriever_lr, help="knowledge retriever learning rate"
    )
    t.add_argument("--max-steps", type=at_least(1), default=d.max_steps, help="optimizer steps")
    t.add_argument("--eval-every", type=at_least(1), default=d.eval_every, help="steps between validations")
    t.add_argument("--valid-size", type=at_least(0), default=d.valid_size, help="validation pairs (0: none)")
    t.add_argument(
        "--valid-candidates", type=at_least(2), default=d.valid_candidates, help="validation list size"
    )
    t.add_argument("--log-every", type=at_least(1), default=d.log_every, help="steps between metrics lines")
    t.add_argument("--seed", type=at_least(0), default=d.seed, help="seed of batches and negatives")
    t.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add_model_args(t)
    e = gsub.add_parser(
        "eval", help="protocol A with and without knowledge, with significance", **DEFAULTS_SHOWN
    )
    e.add_argument("--cross", required=True, help="ranker checkpoint (reads knowledge or not)")
    e.add_argument(
        "--knowledge-retriever",
        default=None,
        help="knowledge retriever checkpoint; without it the ranker reads all sentences as given",
    )
    e.add_argument("--no-knowledge", action="store_true", help="withhold the knowledge (an ablation)")
    e.add_argument(
        "--top-m", type=at_least(1), default=None, help="sentences the retriever picks (default: as trained)"
    )
    e.add_argument(
        "--data", default="chitchat", help="'chitchat' (persona knowledge, test split) or a JSONL file"
    )
    e.add_argument("--limit", type=at_least(0), default=0, help="first N test pairs (0: all)")
    e.add_argument("--candidates", type=at_least(2), default=100, help="protocol A list size")
    e.add_argument("--against", nargs="*", default=[], help="eval JSONs of the same cases to test against")
    e.add_argument(
        "--name", default=None, help="row name (default: the --out file's name without .json or .json.gz)"
    )
    e.add_argument(
        "--out", type=out_file, required=True, help="where the JSON (metrics, per-case ranks) goes"
    )
    e.add_argument("--seed", type=at_least(0), default=0, help="seed of the negatives")
    e.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def _grounded_data(spec: str, max_turns: int) -> dict[str, list]:
    from coreply.knowledge import load_chitchat_persona
    from coreply.readers import read_pairs

    if spec == "chitchat":
        return load_chitchat_persona(max_turns=max_turns)
    pairs = read_pairs(spec)
    if not any(p.knowledge for p in pairs):
        raise CliError(f"--data {spec}: no pair has a 'knowledge' list; grounded ranking needs some")
    return {"train": pairs, "test": pairs}


def cmd_ground(args: argparse.Namespace) -> int:
    from dataclasses import replace

    if args.ground_command == "eval":
        return _ground_eval(args)
    from training.config import GroundedConfig

    model = replace(model_config(args), max_knowledge_tokens=args.max_knowledge_tokens)
    keys = (
        "knowledge",
        "init_cross",
        "init_retriever",
        "top_m",
        "feedback",
        "tau",
        "num_negatives",
        "batch_size",
        "lr",
        "retriever_lr",
        "max_steps",
        "eval_every",
        "valid_size",
        "valid_candidates",
        "log_every",
        "seed",
        "device",
    )
    config = GroundedConfig(output_dir=args.output_dir, model=model, **{k: getattr(args, k) for k in keys})
    if (Path(config.output_dir) / "summary.json").exists():
        raise CliError(f"{config.output_dir} already holds a grounded run; choose another -o")
    data = _grounded_data(args.data, model.max_turns)  # a bad file is said before torch's imports
    from coreply.device import resolve_device
    from training.reciprocal import train_grounded

    resolve_device(config.device)
    command = shlex.join(["coreply", *(args.argv or sys.argv[1:])])
    summary = train_grounded(config, data["train"], data.get("valid", []), command)
    print(json.dumps(summary, indent=2))
    return 0


def _ground_eval(args: argparse.Namespace) -> int:
    from coreply.checkpoint_meta import read_meta

    for path in (args.cross, args.knowledge_retriever):  # what a typo names is said before the imports
        if path:
            read_meta(path, verify=False)  # loading verifies every hash
    from coreply.checkpoint import load_checkpoint
    from coreply.device import resolve_device
    from coreply.knowledge import trained_top_m
    from coreply.text import normalize
    from evaluation.grounded import evaluate_grounded, significance

    device = resolve_device(args.device)
    cross = load_checkpoint(args.cross, device, expect="cross")
    retriever = (
        load_checkpoint(args.knowledge_retriever, device, expect="bi") if args.knowledge_retriever else None
    )
    data = _grounded_data(args.data, cross.config.max_turns)
    test = data["test"][: args.limit or None]
    negatives = [p.response for p in data["test"]]
    if len({normalize(t) for t in negatives}) < 2:
        raise CliError(f"--data {args.data}: the test responses need at least 2 distinct texts")
    name = args.name or result_name(args.out)
    others = []  # read before the evaluation, so that a bad one is said before the work, not after
    for path in args.against:
        try:
            other = read_json(path)
        except (OSError, ValueError) as exc:
            raise CliError(f"--against {path}: cannot read it ({exc})") from exc
        meta = other.get("meta") if isinstance(other, dict) else None
        if not isinstance(meta, dict) or not {"name", "seed"} <= meta.keys() or "ranks" not in other:
            raise CliError(
                f"--against {path}: not a `coreply ground eval` JSON (no ranks, meta.name, meta.seed)"
            )
        if meta["seed"] != args.seed or len(other["ranks"]) != len(test):
            raise CliError(f"--against {path}: evaluated on other cases (its --seed or --limit differ)")
        others.append(other)
    top_m = args.top_m or trained_top_m(args.cross)
    result = evaluate_grounded(
        name, cross, retriever, test, negatives, args.candidates, top_m, not args.no_knowledge, args.seed
    )
    result["against"] = {other["meta"]["name"]: significance(result, other) for other in others}
    write_json_atomic(Path(args.out), result)
    shown = {k: round(v, 2) for k, v in result["metrics"].items() if k in ("hits@1", "hits@5", "mrr")}
    print(
        json.dumps(
            {"name": name, "knowledge": result["meta"]["knowledge"], **shown, "p_vs": result["against"]}
        )
    )
    return 0
