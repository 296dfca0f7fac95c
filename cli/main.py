"""The ``coreply`` command: ``train``, ``pretrain``, ``eval``, ``ground`` (train / eval), ``report``,
``index`` (build / add / withdraw / info / verify), ``compact``, ``serve``, ``chat``.

Heavy modules are imported inside each subcommand so ``coreply --help`` stays instant."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, NoReturn

from coreply.artifacts import check_out_file, read_json, write_atomic, write_json_atomic
from coreply.config import ZERO_SHOT, ModelConfig
from coreply.gate import GATE_FIDELITY, REACH_FIDELITY
from coreply.lexical import DEPTH as LEXICAL_DEPTH
from coreply.lexical import PAIRS as LEXICAL_PAIRS
from coreply.restatement import DEFAULT_QUANTILE, check_quantile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


DEFAULTS_SHOWN = {"formatter_class": argparse.ArgumentDefaultsHelpFormatter}


class _Parser(argparse.ArgumentParser):
    """Refuses a bad command line in one line naming the flag, like every other CLI error, instead of
    argparse's usage block (40 lines for ``train``) above it; subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """As argparse's, but a flag the command does not know is refused by that command's parser, so the
        message points at its ``--help`` rather than the top one's."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            parser: argparse.ArgumentParser = self
            while subs := [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]:
                parser = subs[0].choices[getattr(parsed, subs[0].dest)]
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed


def at_least(low: int):
    """An argparse type: an int >= ``low`` (argparse names the flag in its one-line error)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def result_name(out: str) -> str:
    """A result's default name: its ``--out`` file's name without ``.json`` or ``.json.gz``."""
    return Path(Path(out).name.removesuffix(".gz")).stem


def out_file(text: str) -> str:
    """An argparse type: a file to write whose folder exists, checked before the slow work, not after."""
    try:
        check_out_file(Path(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def out_dir(text: str) -> str:
    """An argparse type: a folder to write, which may exist but not as a file, and whose nearest existing
    parent can take it; checked before the slow work, not after."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; name a folder")
    made = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())  # where mkdir starts
    if not made.is_dir() or not os.access(made, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text} cannot be made: {made} is not a folder you can write to")
    return text


def run_dir(text: str) -> str:
    """An argparse type: a training run's directory (:func:`out_dir`), but not a bundle or a checkpoint
    (the run's files and checkpoints written into one would break its seal)."""
    from coreply.bundle import MANIFEST
    from coreply.checkpoint_meta import META

    path = Path(out_dir(text))
    for name, kind in ((MANIFEST, "bundle"), (META, "checkpoint")):
        if (path / name).is_file():
            raise argparse.ArgumentTypeError(f"{text} is a {kind} ({name}); name a folder for the run")
    return text


def base_model(text: str) -> str:
    """An argparse type: 'default', or a local Hugging Face model folder (checked before the slow work)."""
    if text != "default" and not (Path(text) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a local Hugging Face model folder (no config.json)")
    return text


def service_url(text: str) -> str:
    """An argparse type: a service's http(s) address (``coreply chat --url``)."""
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) address, e.g. http://127.0.0.1:8000")
    return text


def guard_quantile(text: str) -> float | None:
    """An argparse type: 'off', or the restatement guard's quantile in [0.5, 1)."""
    if text == "off":
        return None
    try:
        return check_quantile(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'off' or in [0.5, 1), got {text}") from None


def in_unit_interval(text: str, words: dict[str, Any], wanted: str) -> Any:
    """An argparse type's body: one of ``words`` (text -> value), or a number in [0, 1); else the
    one-line error ``must be <wanted>, got <text>``."""
    if text in words:
        return words[text]
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
    return value


def gate_fidelity(text: str) -> float | None:
    """An argparse type: 'off', or the share of calibration answers the rerank gate (or reach) may change,
    in [0, 1)."""
    return in_unit_interval(text, {"off": None}, "'off' or a share in [0, 1)")


def lexical_weight(text: str) -> float | str | None:
    """An argparse type: 'off', 'auto', or the lexical stage's z-score weight of the dense score in [0, 1)."""
    return in_unit_interval(text, {"off": None, "auto": "auto"}, "'auto', 'off' or a weight in [0, 1)")


def _load_data(spec: str, max_turns: int) -> dict[str, list]:
    """``chitchat`` -> the built-in splits; a file -> {'train': pairs} (see coreply.readers)."""
    from coreply.corpus import load_chitchat
    from coreply.readers import read_pairs

    if spec == "chitchat":
        return load_chitchat(max_turns=max_turns)
    return {"train": read_pairs(spec)}


def _prior_pairs(flag: str | None, builtin_train: list | None) -> list:
    """--prior-pairs: a pairs file, 'none', or (not given) the built-in train split where one applies."""
    from coreply.readers import read_pairs

    if flag not in (None, "none"):
        return read_pairs(flag)
    return builtin_train if builtin_train is not None and flag is None else []


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--base-model",
        type=base_model,
        default="default",
        help="'default' (all-MiniLM-L6-v2 from PyPI) or a local HF dir",
    )
    g.add_argument("--pooling", choices=["cls", "mean"], default="mean", help="how token vectors become one")
    g.add_argument(
        "--projection-dim",
        type=at_least(1),
        default=None,
        help="linear projection after pooling (bi-encoder)",
    )
    g.add_argument("--share-towers", action="store_true", help="one encoder for context and response")
    g.add_argument("--normalize", action="store_true", help="L2-normalise embeddings (cosine scores)")
    g.add_argument(
        "--score-scale", type=float, default=ModelConfig.score_scale, help="bi-encoder scores = scale * dot"
    )
    g.add_argument(
        "--max-context-tokens",
        type=at_least(4),
        default=ModelConfig.max_context_tokens,
        help="context tokens kept (the latest)",
    )
    g.add_argument(
        "--max-response-tokens",
        type=at_least(3),
        default=ModelConfig.max_response_tokens,
        help="response tokens kept",
    )
    g.add_argument("--max-turns", type=at_least(1), default=ModelConfig.max_turns, help="context turns kept")
    g.add_argument("--dropout", type=float, default=ModelConfig.dropout, help="dropout while training")
    g.add_argument(
        "--num-layers",
        type=at_least(1),
        default=None,
        help="keep the base model's first k layers (default: all)",
    )
    g.add_argument(
        "--cross-head",
        choices=["mlp", "match"],
        default=ModelConfig.cross_head,
        help="the reranker's score: 'mlp', a new head on the pooled pair; 'match', a learnt scale times the "
        "cosine of the context's and the response's mean token vectors (ranks from step 0)",
    )
    g.add_argument(
        "--poly-codes",
        type=at_least(0),
        default=0,
        metavar="M",
        help="train the retriever as a Poly-encoder with M learnt context codes (its poly stage then "
        "reranks from cached response vectors); 0: a plain bi-encoder",
    )


def _model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        base_model=args.base_model,
        pooling=args.pooling,
        projection_dim=args.projection_dim,
        share_towers=args.share_towers,
        normalize=args.normalize,
        score_scale=args.score_scale,
        max_context_tokens=args.max_context_tokens,
        max_response_tokens=args.max_response_tokens,
        max_turns=args.max_turns,
        dropout=args.dropout,
        num_layers=args.num_layers,
        poly_codes=args.poly_codes,
        cross_head=args.cross_head,
    )


def _train_parser(sub) -> None:
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
    _add_model_args(p)
    skip = {"mode", "output_dir", "model"}
    for f in fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        help_ = HELP[f.name]
        if isinstance(default, bool):
            action = argparse.BooleanOptionalAction if default else "store_true"
            p.add_argument(flag, action=action, default=default, help=help_)
        elif f.name == "models":
            p.add_argument(flag, choices=["both", "bi", "cross"], default=default, help=help_)
        else:
            kind = {int: int, float: float}.get(type(default), str)
            none_default = {"max_steps": int, "max_minutes": float, "cross_lora_rank": int, "cross_lr": float}
            kind = none_default.get(f.name, kind)
            p.add_argument(flag, type=kind, default=default, help=help_)


def _cmd_train(args: argparse.Namespace) -> int:
    from coreply.readers import read_pairs
    from training.config import TrainConfig

    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if f.name not in {"model"}}
    config = TrainConfig(**values, model=_model_config(args))
    splits = _load_data(args.data, config.model.max_turns)  # a bad file is said before torch's imports
    valid = read_pairs(args.valid_data) if args.valid_data else splits.get("valid", [])
    import torch.distributed as dist

    from coreply.corpus import build_pool
    from coreply.device import resolve_device
    from training.trainer import Trainer

    resolve_device(config.device)
    _prepare_run_dir(Path(config.output_dir), config, args.resume, args.overwrite)  # deletes with --overwrite
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


def _prepare_run_dir(out: Path, config: Any, resume: bool, overwrite: bool) -> None:
    """A run directory holds one run: continuing it needs ``--resume`` (and the same recipe), starting
    again ``--overwrite``; without either, an existing run is refused."""
    import shutil

    from training.config import RESUMABLE

    saved_path = out / "train_config.json"
    if not saved_path.is_file():
        if resume:
            raise CliError(f"--resume: no run in {out} (no train_config.json); drop --resume to start one")
        return
    if overwrite:
        for name in ("bi", "cross", "state", "metrics.jsonl", "summary.json", "train_config.json"):
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        return
    if not resume:
        raise CliError(
            f"{out} already holds a run; pass --resume to continue it or --overwrite to start again"
        )
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CliError(f"--resume: cannot read {saved_path} ({exc}); use --overwrite") from None
    new = json.loads(json.dumps(asdict(config)))
    asked = saved.get("asked", {})  # values the data capped (Trainer.asked): either is the run's
    changed = sorted(
        k for k in new if k not in RESUMABLE and new[k] not in (saved.get(k), asked.get(k, saved.get(k)))
    )
    if changed:
        flags = ", ".join("--" + k.replace("_", "-") for k in changed)
        raise CliError(f"--resume: {flags} differ from the run in {out}; keep its values or --overwrite")


def _pretrain_parser(sub) -> None:
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
    _add_model_args(p)


def _cmd_pretrain(args: argparse.Namespace) -> int:
    if (Path(args.output_dir) / "bi").exists():
        raise CliError(f"{args.output_dir} already holds a post-trained encoder (bi/); choose another -o")
    pairs = _load_data(args.data, args.max_turns)["train"]  # a bad file is said before torch's imports
    from coreply.device import resolve_device
    from training.dialmae import DialMAEConfig, pretrain

    config = DialMAEConfig(
        output_dir=args.output_dir,
        model=_model_config(args),
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


def _ground_parser(sub) -> None:
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
    _add_model_args(t)
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


def _cmd_ground(args: argparse.Namespace) -> int:
    from dataclasses import replace

    if args.ground_command == "eval":
        return _ground_eval(args)
    from training.config import GroundedConfig

    model = replace(_model_config(args), max_knowledge_tokens=args.max_knowledge_tokens)
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


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate on protocol A (1-of-N) and B (full pool)", **DEFAULTS_SHOWN)
    p.add_argument("--bi", default=None, help="bi-encoder checkpoint dir, or 'zero-shot'")
    p.add_argument("--cross", default=None, help="cross-encoder checkpoint dir")
    p.add_argument(
        "--name",
        default=None,
        help="system name in the report (default: the --out file's name without .json or .json.gz)",
    )
    p.add_argument(
        "--data",
        default="chitchat",
        help="'chitchat' (built-in), or a pairs file whose every pair is a test case",
    )
    p.add_argument(
        "--split", default="test", help="the built-in corpus's split to test on (train, valid, test)"
    )
    p.add_argument(
        "--valid-data", default=None, help="pairs file for the z-score weight (default: valid split)"
    )
    p.add_argument(
        "--pool",
        default=None,
        help="a .txt / .jsonl pool file: protocol B's pool and protocol A's negatives (default: every "
        "response of --data)",
    )
    p.add_argument("--limit", type=at_least(0), default=2000, help="first N test pairs (0 = all)")
    p.add_argument(
        "--valid-limit",
        type=at_least(0),
        default=500,
        help="validation pairs for choosing the z-score weight",
    )
    p.add_argument("--protocol", nargs="+", choices=["A", "B"], default=["A", "B"], help="protocols to run")
    p.add_argument(
        "--retriever", nargs="+", choices=["bi", "bm25"], default=["bi"], help="first stages for protocol B"
    )
    p.add_argument(
        "--n-r", nargs="+", type=at_least(1), default=[10, 50, 100, 200], help="candidates reranked (sweep)"
    )
    p.add_argument(
        "--candidates",
        type=at_least(2),
        default=100,
        help="protocol A list size (gold + negatives); capped, with a message, at what the pool has",
    )
    p.add_argument(
        "--pool-limit", type=at_least(1), default=None, help="reduced pool: test golds + a seeded sample"
    )
    p.add_argument("--max-turns", type=at_least(1), default=ModelConfig.max_turns, help="context turns kept")
    p.add_argument("--seed", type=at_least(0), default=0, help="seed of protocol A's negatives, pool sample")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--judge",
        default=ZERO_SHOT,
        help="bi-encoder that judges restatements of the last turn ('zero-shot', a checkpoint, or 'none')",
    )
    p.add_argument(
        "--restatement-quantile",
        type=guard_quantile,
        default=DEFAULT_QUANTILE,
        help="protocol B with the bi-encoder also recalls through the restatement guard that a bundle "
        "serves, calibrated on the validation pairs at this quantile ('off': without it)",
    )
    p.add_argument(
        "--prior-pairs",
        default=None,
        metavar="FILE",
        help="pairs file whose contexts measure the response prior a bundle serves (its weight chosen on "
        "the validation pairs), added to protocol B's bi-encoder recall; 'none': without it (default: "
        "the built-in train split for --data chitchat, none for a file)",
    )
    p.add_argument(
        "--exclude-conversation",
        action="store_true",
        help="protocol B as a served pool would be that does not hold the conversation being served: each "
        "case's query excludes the other lines of its conversation in the split (its gold kept)",
    )
    p.add_argument("--out", type=out_file, required=True, help="JSON file to write")


def _not_an_input(out: str, **inputs: str | list[str] | None) -> None:
    """Refuse an ``--out`` that names one of the command's own input files (``inputs``: flag -> path(s)),
    which writing the result would destroy."""
    for flag, paths in inputs.items():
        for path in [paths] if isinstance(paths, str) else paths or []:
            if Path(path).exists() and Path(path).resolve() == Path(out).resolve():
                name = "an input" if flag == "inputs" else "--" + flag.replace("_", "-")
                raise CliError(
                    f"--out {out} is the file {name} reads; writing the result there would destroy it"
                )


def _cmd_eval(args: argparse.Namespace) -> int:
    from coreply.checkpoint_meta import read_meta
    from coreply.corpus import responses_of
    from coreply.readers import read_pairs, read_pool

    if not args.bi and not args.cross and "bm25" not in args.retriever:
        raise CliError("give --bi, --cross or --retriever bm25")
    _not_an_input(
        args.out, data=args.data, valid_data=args.valid_data, pool=args.pool, prior_pairs=args.prior_pairs
    )
    for path in (args.bi, args.cross, args.judge if args.judge != "none" else None):  # fail fast
        if path and path != ZERO_SHOT:
            read_meta(path)
    if args.data == "chitchat":
        splits = _load_data(args.data, args.max_turns)
        if args.split not in splits:
            raise CliError(f"--split {args.split!r}: the built-in corpus has {sorted(splits)}")
        cases = splits[args.split]
    elif args.split != "test":
        raise CliError(
            f"--split {args.split}: only the built-in corpus has splits; --data {args.data} is tested whole"
        )
    else:  # a team's own test file: every pair is a test case
        cases = read_pairs(args.data)
        splits = {"test": cases}
    valid = read_pairs(args.valid_data) if args.valid_data else splits.get("valid", [])
    pool = read_pool(args.pool)[0] if args.pool else None
    from coreply.device import resolve_device  # torch's and the models' imports, after the inputs' checks
    from evaluation.protocols import conversation_others, pool_for_eval
    from evaluation.run import EvalSpec, run_eval

    device = str(resolve_device(args.device))
    test = cases[: args.limit or None]
    if pool is not None:
        from coreply.text import normalize

        keys = {normalize(t) for t in pool}
        missing = sum(normalize(p.response) not in keys for p in test)
        if missing:
            print(f"note: {missing} of {len(test)} test golds are not in {args.pool} (B cannot find them)")
    exclude = None
    if args.exclude_conversation:
        if not any(p.conversation_id for p in cases):
            raise CliError(
                f"--exclude-conversation: the pairs of --data {args.data} carry no conversation ids; "
                'give each record a "conversation_id"'
            )
        exclude = conversation_others(test, cases)
    pool_b = pool_for_eval(pool or responses_of(splits), test, args.pool_limit, args.seed)
    n_r = tuple(dict.fromkeys(min(n, len(pool_b)) for n in args.n_r))  # no more than the pool holds
    if n_r != tuple(dict.fromkeys(args.n_r)):
        asked, used = (" ".join(map(str, values)) for values in (args.n_r, n_r))
        print(f"note: --n-r {asked} over a pool of {len(pool_b)} responses: n_r {used}")
    spec = EvalSpec(
        name=args.name or result_name(args.out),
        bi=args.bi,
        cross=args.cross,
        test=test,
        valid=valid[: args.valid_limit],
        pool=pool_b,
        negatives=pool or [p.response for p in cases],
        protocols=tuple(args.protocol),
        retrievers=tuple(args.retriever),
        n_r=n_r,
        candidates=args.candidates,
        seed=args.seed,
        device=device,
        judge=None if args.judge == "none" else args.judge,
        guard_pairs=valid,
        guard_quantile=args.restatement_quantile,
        prior_pairs=_prior_pairs(args.prior_pairs, splits["train"] if args.data == "chitchat" else None),
        exclude=exclude,
    )
    result = run_eval(spec)
    write_json_atomic(Path(args.out), result)
    for protocol in ("A", "B"):
        for row in result[protocol]:
            m = row["metrics"]
            restates = f" restates {row['restates']:4.1f}%" if "restates" in row else ""
            print(
                f"{protocol} {row['system']:<55} {row.get('n_r', ''):>4} hits@1 {m['hits@1']:5.1f} "
                f"hits@10 {m['hits@10']:5.1f} MRR {m['mrr']:5.1f}{restates}"
            )
    if "gold" in result.get("restatement", {}):  # judged (a guard alone also writes "restatement")
        print(f"gold replies restate the last turn in {result['restatement']['gold']:.1f}% of cases")
    return 0


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="merge eval JSON files into a markdown table (+ n_r plot)")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out", type=out_file, required=True, help="markdown file")
    p.add_argument("--plot", type=out_file, default=None, help="PNG of hits@1 and ms/case against n_r")
    p.add_argument("--runs", nargs="*", default=[], help="training summary.json files for the training table")
    p.add_argument("--scale", default="", help="label for the header (e.g. cpu, gpu)")
    p.add_argument(
        "--curves", type=out_file, default=None, help="PNG of every run's validation hits@1 (needs --runs)"
    )
    p.add_argument(
        "--against",
        default=None,
        metavar="NAME",
        help="p of every other run's rows against this eval run's (its --name) row that measures the same "
        "thing, its models' recipe aside (default: cooperative rows against the best non-cooperative one)",
    )


def _cmd_report(args: argparse.Namespace) -> int:
    from evaluation.plots import plot_nr_sweep, plot_runs
    from evaluation.tables import check_result, check_summary, merge_sweeps, render_markdown

    def read(path: str, check: Callable[[Any], None]) -> dict:
        try:
            obj = read_json(path)
            check(obj)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CliError(f"cannot read {path}: {exc}") from exc
        except ValueError as exc:
            raise CliError(f"{path}: {exc}") from exc
        return obj

    _not_an_input(args.out, inputs=args.inputs, runs=args.runs)
    results = [read(path, check_result) for path in args.inputs]
    names = [r["meta"]["name"] for r in results]
    if args.against is not None and args.against not in names:
        raise CliError(f"--against {args.against!r} names none of the inputs' runs ({names})")
    runs = {Path(p).parent.name: read(p, check_summary) for p in args.runs}
    try:
        table = render_markdown(results, runs, args.scale, against=args.against)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    write_atomic(Path(args.out), table.encode())
    if args.curves and args.runs:
        plot_runs({Path(p).parent.name: Path(p).parent / "metrics.jsonl" for p in args.runs}, args.curves)
    elif args.curves:
        print("note: no --curves written: no --runs (training summary.json files) to plot")
    if args.plot and merge_sweeps(results):
        plot_nr_sweep(merge_sweeps(results), args.plot)
    elif args.plot:
        print("note: no --plot written: no input has an n_r sweep (`coreply eval --n-r` of several values)")
    print(f"wrote {args.out}")
    return 0


def _index_parser(sub) -> None:
    p = sub.add_parser("index", help="build, extend, describe or verify a serving bundle")
    isub = p.add_subparsers(dest="index_command", required=True)
    b = isub.add_parser(
        "build", help="encode a response pool into a bundle (models + FAISS index + manifest)"
    )
    b.add_argument(
        "--output", "-o", type=out_dir, required=True, help="bundle directory to write (replaced atomically)"
    )
    b.add_argument("--bi", default=ZERO_SHOT, help="bi-encoder checkpoint dir, or 'zero-shot' (default)")
    b.add_argument("--cross", default=None, help="cross-encoder checkpoint dir (none: retrieval only)")
    b.add_argument(
        "--knowledge-retriever",
        default=None,
        help="with a reranker that reads knowledge: the retriever that picks its top-m sentences "
        "(`coreply ground train` writes it to knowledge/); without it the reranker reads them as given",
    )
    b.add_argument(
        "--knowledge",
        default=None,
        metavar="FILE",
        help="default knowledge for requests that bring none (a persona, facts): one sentence per line",
    )
    b.add_argument(
        "--top-m",
        type=at_least(1),
        default=None,
        help="knowledge sentences the reranker reads (default: what it was trained with, else 5)",
    )
    b.add_argument("--pool", default="chitchat", help="'chitchat' (built-in) or a .txt / .jsonl pool file")
    b.add_argument(
        "--queries",
        default=None,
        help="pairs file: its contexts measure ANN recall, its pairs calibrate the restatement guard and "
        "the z-score weight (with --cross); default: the built-in valid split for the chitchat pool, none "
        "for a file",
    )
    b.add_argument(
        "--restatement-quantile",
        type=guard_quantile,
        default=DEFAULT_QUANTILE,
        help="drop answers as close to a context turn as this quantile of the human replies in --queries "
        f"are (default {DEFAULT_QUANTILE}; 'off': keep them)",
    )
    b.add_argument(
        "--prior-pairs",
        default=None,
        metavar="FILE",
        help="pairs file (e.g. the training split) whose contexts measure the response prior, a correction "
        "for responses close to every context, weighted by hits@1 on --queries; 'none': no prior "
        "(default: the built-in train split for the chitchat pool, none for a file)",
    )
    b.add_argument(
        "--lexical",
        type=lexical_weight,
        default="auto",
        help="BM25 reorders the first --lexical-depth candidates, z-score fused with the dense score at "
        f"this weight; 'auto' (default): the weight with the best hits@1 on the first {LEXICAL_PAIRS} "
        "--queries pairs (none: no lexical stage); 'off': none",
    )
    b.add_argument(
        "--lexical-depth",
        type=at_least(2),
        default=LEXICAL_DEPTH,
        help=f"candidates the lexical stage reorders (default {LEXICAL_DEPTH})",
    )
    b.add_argument(
        "--rerank-gate",
        type=gate_fidelity,
        default=GATE_FIDELITY,
        help="with --cross and --queries: a request that names no fusion skips the reranker where the first "
        "stage leads by at least the smallest margin that changes at most this share of the calibration "
        "pairs' top answers against always reranking; 'off': always rerank",
    )
    b.add_argument(
        "--rerank-reach",
        type=gate_fidelity,
        default=REACH_FIDELITY,
        help="with --cross and --queries: where such a request reranks, the reranker reads only the "
        "candidates before the first that trails the first stage's best by the smallest margin that "
        "changes at most this share more of those answers; 'off': every candidate",
    )
    b.add_argument("--factory", default="Flat", help="FAISS factory string, e.g. Flat, IVF1024,Flat, HNSW32")
    b.add_argument("--search-params", default="", help="e.g. nprobe=16 or efSearch=128")
    b.add_argument(
        "--onnx",
        choices=["int8", "fp32", "none"],
        default="int8",
        help="ONNX export for CPU serving (int8: the reranker's graph smoothed on the pool first)",
    )
    b.add_argument(
        "--calibrate",
        type=at_least(0),
        default=200,
        help="pairs (of --queries) that choose the z-score weight",
    )
    b.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    a = isub.add_parser("add", help="append responses to a bundle without re-encoding the others")
    a.add_argument("bundle")
    a.add_argument("pool", help=".txt (one per line) or .jsonl ({'text': ...}) file")
    w = isub.add_parser(
        "withdraw",
        help="stop a bundle answering some of its responses (--restore: answer them again); no id moves",
    )
    w.add_argument("bundle")
    w.add_argument("--ids", type=at_least(0), nargs="+", default=[], help="response ids (as /respond gives)")
    w.add_argument("--texts", help="response texts: .txt (one per line) or .jsonl ({'text': ...}) file")
    w.add_argument("--restore", action="store_true", help="put the given responses back")
    v = isub.add_parser("verify", help="check a bundle's hashes, counts and model ties")
    v.add_argument("bundle")
    i = isub.add_parser("info", help="what a bundle holds: pool, index, models, fusion, sizes, build command")
    i.add_argument("bundle")
    i.add_argument("--json", action="store_true", help="print the manifest instead")
    i.add_argument(
        "--withdrawn",
        action="store_true",
        help="print the withdrawn responses instead, one JSON line each ({'id': ..., 'text': ...}: a file "
        "`index withdraw --texts` reads, to withdraw them from another bundle or put them back)",
    )


def _withdraw(args: argparse.Namespace) -> int:
    from coreply.readers import read_pool
    from index_builder.withdraw import withdraw

    if not args.ids and not args.texts:
        raise CliError("withdraw: name the responses with --ids, --texts or both")
    texts = read_pool(args.texts)[0] if args.texts else []
    manifest, changed, unknown = withdraw(args.bundle, args.ids, texts, args.restore)
    if unknown:
        print(f"note: {len(unknown)} of the --texts are not in the bundle (the first: {unknown[0]!r})")
    out = manifest.get("withdrawn", {}).get("count", 0)
    verb = "restored" if args.restore else "withdrawn"
    print(
        f"{args.bundle}: version {manifest['bundle_version']}, {changed} {verb}; {out} of "
        f"{manifest['index']['count']} responses withdrawn in all"
    )
    return 0


def _cmd_index(args: argparse.Namespace) -> int:
    from coreply.readers import read_pairs, read_pool

    if args.index_command == "info":
        from coreply.bundle import read_manifest
        from index_builder.info import describe

        if args.json:
            print(json.dumps(read_manifest(Path(args.bundle)), indent=2))
        elif args.withdrawn:
            from index_builder.withdraw import withdrawn_of

            for i, text in withdrawn_of(Path(args.bundle))[1]:
                print(json.dumps({"id": i, "text": text}, ensure_ascii=False))
        else:
            for label, value in describe(args.bundle):
                print(f"{label:<10} {value}")
        return 0
    if args.index_command == "verify":
        from coreply.bundle import load_bundle

        manifest = load_bundle(args.bundle).manifest  # every hash, count and model tie checked
        count = manifest["index"]["count"]
        print(f"{args.bundle}: ok (version {manifest['bundle_version']}, {count} responses)")
        return 0
    if args.index_command == "add":
        from coreply.bundle import read_manifest
        from index_builder.build import add_responses

        texts, metadata = read_pool(args.pool)
        before = read_manifest(Path(args.bundle), verify=False)["index"]["count"]
        manifest = add_responses(args.bundle, texts, metadata=metadata)
        added = manifest["index"]["count"] - before
        print(
            f"{args.bundle}: version {manifest['bundle_version']}, {manifest['index']['count']} responses: "
            f"{added} added, {len(texts) - added} skipped (already in the bundle, repeated or blank)"
        )
        return 0
    if args.index_command == "withdraw":
        return _withdraw(args)
    from coreply.checkpoint_meta import read_meta

    for path in (args.bi, args.cross, args.knowledge_retriever):  # what a typo names is said at once
        if path and path != ZERO_SHOT:
            read_meta(path, verify=False)  # the build verifies every hash
    if args.pool == "chitchat":
        from coreply.corpus import load_chitchat, responses_of

        splits = load_chitchat()
        texts, metadata, pairs = responses_of(splits), [], splits["valid"]
    else:
        (texts, metadata), pairs = read_pool(args.pool), []
    if args.queries:
        pairs = read_pairs(args.queries)
    prior_pairs = _prior_pairs(args.prior_pairs, splits["train"] if args.pool == "chitchat" else None)
    if prior_pairs and not pairs:
        print("note: no --queries pairs to weigh the response prior on: the bundle has no prior")
    queries = [p.context for p in pairs[:500]]
    calibration = pairs[: args.calibrate] if args.cross else []
    if args.cross and not calibration:
        print("note: no --queries pairs to calibrate on: the z-score fusion weight stays at its default")
    if args.restatement_quantile is not None and not pairs:
        print("note: no --queries pairs to calibrate on: the bundle has no restatement guard")
    if args.lexical == "auto" and not pairs:
        print("note: no --queries pairs to choose the lexical weight on: the bundle has no lexical stage")
    knowledge = _knowledge_file(args.knowledge) if args.knowledge else ()
    from coreply.device import resolve_device  # torch's and the models' imports, after the inputs' checks
    from index_builder.build import build_bundle

    resolve_device(args.device)
    manifest = build_bundle(
        args.output,
        texts,
        bi=args.bi,
        cross=args.cross,
        factory=args.factory,
        search_params=args.search_params,
        onnx=args.onnx,
        queries=queries,
        device=args.device,
        pool_source=args.pool,
        calibration=calibration,
        metadata=metadata,
        command=shlex.join(["coreply", *(sys.argv[1:] if args.argv is None else args.argv)]),
        knowledge_retriever=args.knowledge_retriever,
        knowledge=knowledge,
        top_m=args.top_m,
        guard_pairs=pairs,
        guard_quantile=args.restatement_quantile,
        prior_pairs=prior_pairs,
        lexical_pairs=pairs[:LEXICAL_PAIRS] if args.lexical == "auto" else (),
        lexical_weight=None if args.lexical in ("auto", None) else args.lexical,
        lexical_depth=args.lexical_depth,
        gate_fidelity=args.rerank_gate,
        reach_fidelity=args.rerank_reach,
    )
    if args.lexical == "auto" and pairs and "lexical" not in manifest:
        print("note: BM25 did not raise hits@1 on --queries at any weight: the bundle has no lexical stage")
    info, dropped = manifest["index"], manifest["build"]["dropped_duplicates_or_blank"]
    if dropped:
        print(f"note: {dropped} of the pool's {len(texts)} texts were blank or repeats (after normalisation)")
    print(
        f"wrote {args.output}: {info['count']} responses, dim {info['dim']}, {info['factory']}, "
        f"recall vs exact {info['recall_vs_exact'] or 'not measured (no queries)'}, "
        f"{manifest['build']['total_seconds']} s"
    )
    return 0


def _knowledge_file(path: str) -> list[str]:
    """One knowledge sentence per non-blank line of a UTF-8 text file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise CliError(f"--knowledge {path}: not UTF-8 text; save it as UTF-8") from None
    except OSError as exc:
        raise CliError(f"--knowledge {path}: cannot read it ({exc.strerror})") from None
    sentences = [line.strip() for line in lines if line.strip()]
    if not sentences:
        raise CliError(f"--knowledge {path}: no sentences (one per line expected)")
    return sentences


def _serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve POST /respond, /docs and /chat (builds the default bundle on first use)"
    )
    p.add_argument(
        "--bundle", default=None, help="bundle dir (env COREPLY_BUNDLE; default: the built-in one)"
    )
    p.add_argument("--host", default=None, help="address to listen on (env COREPLY_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (env COREPLY_PORT; default 8000)")
    p.add_argument(
        "--backend",
        choices=["auto", "onnx", "torch", "torch-bf16"],
        default=None,
        help="inference backend (auto: ONNX if exported; torch-bf16: bf16 weights, for CPUs with AMX)",
    )
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (0 = measure at start)")
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N or auto (env COREPLY_DEVICE; default cpu)"
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from coreply.bundle import MANIFEST
    from service.settings import DEFAULT_BUNDLE, Settings

    flags = ("bundle", "host", "port", "backend", "threads", "device")
    overrides = {k: getattr(args, k) for k in flags if getattr(args, k) is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:  # one line naming the setting, not pydantic's report
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        flag = f"--{field.replace('_', '-')} / " if field in flags else ""  # the rest are environment only
        name = f"{flag}COREPLY_{field.upper()}" if field else "the settings"
        raise CliError(f"{name}: {first['msg'].removeprefix('Value error, ')}") from None
    built_in = settings.bundle == DEFAULT_BUNDLE
    if not built_in and not (settings.bundle / MANIFEST).is_file():  # said before torch's imports
        raise CliError(f"no bundle at {settings.bundle}; build one with `coreply index build -o DIR`")
    from coreply.device import on_own_thread, resolve_device

    try:
        resolve_device(settings.device)  # this host has it
    except ValueError as exc:
        raise CliError(f"--device / COREPLY_DEVICE: {exc}") from None
    if built_in:
        from index_builder.default import ensure_default_bundle

        on_own_thread(ensure_default_bundle, settings.bundle)  # its OpenMP threads end with it
    else:  # fail fast with a clear message rather than inside the server's lifespan
        from coreply.bundle import read_manifest

        read_manifest(settings.bundle)
    from service.server import serve

    serve(settings)
    return 0


def _chat_parser(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="talk to a bundle (or a running service) in the terminal; /reset, /quit",
        **DEFAULTS_SHOWN,
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--bundle", default=None, help="bundle dir (default: the built-in one, built if missing)"
    )
    where.add_argument(
        "--url", type=service_url, default=None, help="a running service instead, e.g. http://127.0.0.1:8000"
    )
    p.add_argument(
        "--api-key", default=os.environ.get("COREPLY_API_KEY"), help="for --url (env COREPLY_API_KEY)"
    )
    p.add_argument("--candidates", type=at_least(1), default=10, help="n_r: candidates recalled and reranked")
    p.add_argument("--show", type=at_least(1), default=1, help="replies shown per turn (best first)")
    p.add_argument(
        "--knowledge",
        default=None,
        metavar="FILE",
        help="a persona or facts (one sentence per line) sent with every turn, for a bundle whose reranker "
        "reads knowledge (default: the bundle's own)",
    )


def _remote(url: str, api_key: str | None, knowledge: list[str] | None):
    """``answer(context, said)`` against a running service's POST /respond."""
    import urllib.error
    import urllib.request

    def answer(context: list[str], said: list[int], n: int, show: int) -> list[dict]:
        body = {"context": context[-10:], "n_candidates": max(n, show), "top_k": show, "exclude": said[-50:]}
        if knowledge:
            body["knowledge"] = knowledge
        headers = {"Content-Type": "application/json"} | ({"X-API-Key": api_key} if api_key else {})
        request = urllib.request.Request(url.rstrip("/") + "/respond", json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                result = json.load(r)
        except urllib.error.HTTPError as exc:
            raise CliError(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:200]}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise CliError(f"{url}: cannot reach the service ({exc}); is `coreply serve` running?") from None
        if result.get("fallback") is not None:
            return [{"text": result["fallback"], "id": None, "score": float("nan")}]
        return result["responses"]

    return answer


def _local(path: Path, knowledge: list[str] | None):
    """``answer(context, said)`` in-process through :class:`coreply.Responder`."""
    from coreply.bundle import read_manifest

    read_manifest(path, verify=False)  # a bundle, said at once; loading it verifies every hash
    from coreply.responder import Responder

    bot = Responder.load(path)
    if knowledge and not bot.pipeline.reads_knowledge:
        raise CliError(f"--knowledge: the reranker of {path} does not read knowledge")

    def answer(context: list[str], said: list[int], n: int, show: int) -> list[dict]:
        found = bot.respond(
            context[-10:], top_k=show, n_candidates=max(n, show), exclude_ids=said[-50:], knowledge=knowledge
        )
        return [{"text": r.text, "id": r.id, "score": r.score} for r in found]

    return answer


def _cmd_chat(args: argparse.Namespace) -> int:
    knowledge = _knowledge_file(args.knowledge) if args.knowledge else None
    if args.url:
        answer = _remote(args.url, args.api_key, knowledge)
    else:
        from service.settings import DEFAULT_BUNDLE

        path = Path(args.bundle) if args.bundle else DEFAULT_BUNDLE
        if args.bundle is None:
            from index_builder.default import ensure_default_bundle

            ensure_default_bundle(path)
        answer = _local(path, knowledge)
    print("coreply chat: type a message; /reset starts over, /quit (or Ctrl-D) leaves", flush=True)
    context: list[str] = []
    said: list[int] = []
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            context, said = [], []
            continue
        if not line:
            continue
        context.append(line)
        found = answer(context, said, args.candidates, args.show)
        if not found:
            print("bot> (no answer: every candidate was excluded)")
            continue
        for rank, reply in enumerate(found):
            prefix = "bot> " if rank == 0 else f"  {rank + 1}. "
            print(f"{prefix}{reply['text']}  [{reply['score']:.2f}]", flush=True)
        context.append(found[0]["text"])
        if found[0]["id"] is not None:
            said.append(found[0]["id"])


def _compact_parser(sub) -> None:
    p = sub.add_parser(
        "compact",
        help="shrink a checkpoint trained in full to low-rank adapters (a few MB, for git); check its "
        "quality with `coreply eval` before shipping it",
        **DEFAULTS_SHOWN,
    )
    p.add_argument("checkpoint", help="a checkpoint dir trained in full (or its fp16 copy)")
    p.add_argument("-o", "--out", type=out_dir, required=True, help="the compact checkpoint dir to write")
    p.add_argument("--rank", type=at_least(1), default=32, help="the adapters' rank")


def _cmd_compact(args: argparse.Namespace) -> int:
    from coreply.checkpoint_meta import read_meta

    meta = read_meta(args.checkpoint, verify=False)  # load_checkpoint verifies it
    if "adapter" in meta:
        raise CliError(f"{args.checkpoint}: already compact (adapters of rank {meta['adapter'].get('rank')})")
    if Path(args.out).resolve() == Path(args.checkpoint).resolve():
        raise CliError("--out: must differ from the checkpoint it compacts")
    from coreply.adapters import extract_lora  # torch's and the models' imports, after the checks
    from coreply.checkpoint import load_checkpoint, model_class, save_checkpoint

    tuned = load_checkpoint(args.checkpoint)
    model = model_class(meta["kind"], tuned.config).from_pretrained(tuned.config).eval()
    try:
        kept = extract_lora(model, tuned, args.rank)
    except ValueError as exc:
        raise CliError(f"--rank: {exc}") from None
    extra = {**meta["extra"], "compacted_from": tuned.content_hash, "rank": args.rank, **kept}
    save_checkpoint(model.half(), args.out, extra)  # fp16 factors: half the bytes, loaded back as fp32
    size = sum(f.stat().st_size for f in Path(args.out).iterdir() if f.is_file())
    print(
        f"{args.out}: {size / 2**20:.1f} MiB; kept {100 * kept['kept']:.1f} % of the linear layers' change "
        f"(worst layer {100 * kept['worst_kept']:.1f} %); dropped the word embeddings' change "
        f"({100 * kept['embedding_change']:.2f} % of their norm)"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="coreply", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _pretrain_parser(sub)
    _eval_parser(sub)
    _ground_parser(sub)
    _report_parser(sub)
    _index_parser(sub)
    _compact_parser(sub)
    _serve_parser(sub)
    _chat_parser(sub)
    return parser


COMMANDS: dict[str, Any] = {
    "train": _cmd_train,
    "pretrain": _cmd_pretrain,
    "eval": _cmd_eval,
    "ground": _cmd_ground,
    "report": _cmd_report,
    "index": _cmd_index,
    "compact": _cmd_compact,
    "serve": _cmd_serve,
    "chat": _cmd_chat,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = None if argv is None else list(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(message)s"
    )  # notes from the library (capped lists...)
    from coreply.bundle import BundleError
    from coreply.checkpoint_meta import CheckpointError
    from coreply.readers import DataError

    try:
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a reader gone by now is met here, not in the flush at exit
        return code
    except BrokenPipeError:  # whoever read the output stopped (`| head`): nothing to report, and nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # left to flush at exit
        return 1
    except (CliError, DataError, CheckpointError, BundleError, ValueError, OSError) as exc:
        # OSError: a path that cannot be written (not a folder, no permission, a full disk), as the OS says
        command = " ".join(filter(None, (args.command, getattr(args, f"{args.command}_command", None))))
        print(f"coreply {command}: error: {exc}", file=sys.stderr)  # "index build", as in its flag errors
        return 2
