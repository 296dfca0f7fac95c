"""The ``coreply`` command: ``train``, ``eval``, ``report`` (and ``index`` / ``serve`` once built).

Heavy modules are imported inside each subcommand so ``coreply --help`` stays instant."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from coreply.config import ZERO_SHOT, ModelConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def _load_data(spec: str, max_turns: int) -> dict[str, list]:
    """``chitchat`` -> the built-in splits; a file -> {'train': pairs} (see coreply.readers)."""
    from coreply.corpus import load_chitchat
    from coreply.readers import read_pairs

    if spec == "chitchat":
        return load_chitchat(max_turns=max_turns)
    return {"train": read_pairs(spec)}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--base-model", default="default", help="'default' (all-MiniLM-L6-v2 from PyPI) or a local HF dir"
    )
    g.add_argument("--pooling", choices=["cls", "mean"], default="mean")
    g.add_argument("--projection-dim", type=int, default=None)
    g.add_argument("--share-towers", action="store_true")
    g.add_argument("--max-context-tokens", type=int, default=ModelConfig.max_context_tokens)
    g.add_argument("--max-response-tokens", type=int, default=ModelConfig.max_response_tokens)
    g.add_argument("--max-turns", type=int, default=ModelConfig.max_turns)
    g.add_argument("--dropout", type=float, default=ModelConfig.dropout)


def _model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        base_model=args.base_model,
        pooling=args.pooling,
        projection_dim=args.projection_dim,
        share_towers=args.share_towers,
        max_context_tokens=args.max_context_tokens,
        max_response_tokens=args.max_response_tokens,
        max_turns=args.max_turns,
        dropout=args.dropout,
    )


def _train_parser(sub) -> None:
    from training.config import MODES, TrainConfig

    p = sub.add_parser("train", help="train the retriever and/or reranker (modes: " + ", ".join(MODES) + ")")
    p.add_argument("--mode", choices=MODES, default="core")
    p.add_argument("--data", default="chitchat", help="'chitchat' (built-in) or a .jsonl/.csv/.json file")
    p.add_argument("--valid-data", default=None, help="validation file (default: the corpus's valid split)")
    p.add_argument("--output-dir", "-o", required=True)
    _add_model_args(p)
    skip = {"mode", "output_dir", "model"}
    for f in fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=default)
        elif f.name == "models":
            p.add_argument(flag, choices=["both", "bi", "cross"], default=default)
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if f.name == "max_steps":
                kind = int
            p.add_argument(flag, type=kind, default=default)


def _cmd_train(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from coreply.corpus import build_pool
    from coreply.readers import read_pairs
    from training.config import TrainConfig
    from training.trainer import Trainer

    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if f.name not in {"model"}}
    config = TrainConfig(**values, model=_model_config(args))
    splits = _load_data(args.data, config.model.max_turns)
    valid = read_pairs(args.valid_data) if args.valid_data else splits.get("valid", [])
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


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate on protocol A (1-of-100) and B (full pool)")
    p.add_argument("--bi", default=None, help="bi-encoder checkpoint dir, or 'zero-shot'")
    p.add_argument("--cross", default=None, help="cross-encoder checkpoint dir")
    p.add_argument("--name", default=None)
    p.add_argument("--data", default="chitchat")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=int, default=2000, help="first N test pairs (0 = all)")
    p.add_argument(
        "--valid-limit", type=int, default=500, help="validation pairs for choosing the z-score weight"
    )
    p.add_argument("--protocol", nargs="+", choices=["A", "B"], default=["A", "B"])
    p.add_argument("--retriever", nargs="+", choices=["bi", "bm25"], default=["bi"])
    p.add_argument("--n-r", nargs="+", type=int, default=[10, 50, 100, 200])
    p.add_argument("--candidates", type=int, default=100, help="protocol A list size")
    p.add_argument("--pool-limit", type=int, default=None, help="reduced pool: test golds + a seeded sample")
    p.add_argument("--max-turns", type=int, default=ModelConfig.max_turns)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", required=True, help="JSON file to write")


def _cmd_eval(args: argparse.Namespace) -> int:
    from coreply.checkpoint import read_meta, write_json_atomic
    from coreply.corpus import responses_of
    from coreply.device import resolve_device
    from training.report import EvalSpec, pool_for_eval, run_eval

    if not args.bi and not args.cross and "bm25" not in args.retriever:
        raise CliError("eval: give --bi, --cross or --retriever bm25")
    for path in (args.bi, args.cross):  # fail fast, before minutes of data loading
        if path and path != ZERO_SHOT:
            read_meta(path)
    splits = _load_data(args.data, args.max_turns)
    if args.split not in splits:
        raise CliError(f"eval: split {args.split!r} not in the data (has {sorted(splits)})")
    test = splits[args.split][: args.limit or None]
    negatives = [p.response for p in splits[args.split]]
    valid = splits.get("valid", [])[: args.valid_limit]
    spec = EvalSpec(
        name=args.name or Path(args.out).stem,
        bi=args.bi,
        cross=args.cross,
        test=test,
        valid=valid,
        pool=pool_for_eval(responses_of(splits), test, args.pool_limit, args.seed),
        negatives=negatives,
        protocols=tuple(args.protocol),
        retrievers=tuple(args.retriever),
        n_r=tuple(args.n_r),
        candidates=args.candidates,
        seed=args.seed,
        device=str(resolve_device(args.device)),
    )
    result = run_eval(spec)
    write_json_atomic(Path(args.out), result)
    for protocol in ("A", "B"):
        for row in result[protocol]:
            m = row["metrics"]
            print(
                f"{protocol} {row['system']:<55} {row.get('n_r', ''):>4} hits@1 {m['hits@1']:5.1f} "
                f"hits@10 {m['hits@10']:5.1f} MRR {m['mrr']:5.1f}"
            )
    return 0


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="merge eval JSON files into a markdown table (+ n_r plot)")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out", required=True, help="markdown file")
    p.add_argument("--plot", default=None, help="PNG of hits@1 and ms/case against n_r")
    p.add_argument("--runs", nargs="*", default=[], help="training summary.json files for the training table")
    p.add_argument("--scale", default="", help="label for the header (e.g. cpu, gpu)")
    p.add_argument("--curves", default=None, help="PNG of every run's validation hits@1 (needs --runs)")


def _cmd_report(args: argparse.Namespace) -> int:
    from training.plots import plot_nr_sweep, plot_runs
    from training.report import merge_sweeps, render_markdown

    results = []
    for path in args.inputs:
        try:
            results.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise CliError(f"report: cannot read {path}: {exc}") from exc
    runs = {Path(p).parent.name: json.loads(Path(p).read_text()) for p in args.runs}
    Path(args.out).write_text(render_markdown(results, runs, args.scale))
    if args.curves and args.runs:
        plot_runs({Path(p).parent.name: Path(p).parent / "metrics.jsonl" for p in args.runs}, args.curves)
    if args.plot and merge_sweeps(results):
        plot_nr_sweep(merge_sweeps(results), args.plot)
    print(f"wrote {args.out}")
    return 0


def _not_built(name: str):
    def run(args: argparse.Namespace) -> int:
        print(
            f"coreply {name}: not built yet (see the index/service issue); training and eval are available."
        )
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coreply", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _eval_parser(sub)
    _report_parser(sub)
    sub.add_parser("index", help="build a serving bundle (not built yet)")
    sub.add_parser("serve", help="serve /respond (not built yet)")
    return parser


COMMANDS: dict[str, Any] = {
    "train": _cmd_train,
    "eval": _cmd_eval,
    "report": _cmd_report,
    "index": _not_built("index"),
    "serve": _not_built("serve"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from coreply.checkpoint import CheckpointError
    from coreply.readers import DataError

    try:
        return COMMANDS[args.command](args)
    except (CliError, DataError, CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"coreply {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
