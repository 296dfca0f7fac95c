"""The ``coreply`` command: ``train``, ``eval``, ``report``, ``index`` (build / add / verify), ``serve``.

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
    g.add_argument("--normalize", action="store_true", help="L2-normalise embeddings (cosine scores)")
    g.add_argument(
        "--score-scale", type=float, default=ModelConfig.score_scale, help="bi-encoder scores = scale * dot"
    )
    g.add_argument("--max-context-tokens", type=int, default=ModelConfig.max_context_tokens)
    g.add_argument("--max-response-tokens", type=int, default=ModelConfig.max_response_tokens)
    g.add_argument("--max-turns", type=int, default=ModelConfig.max_turns)
    g.add_argument("--dropout", type=float, default=ModelConfig.dropout)
    g.add_argument(
        "--num-layers", type=int, default=None, help="keep the base model's first k layers (default: all)"
    )
    g.add_argument(
        "--poly-codes",
        type=int,
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
            p.add_argument(
                flag, action=argparse.BooleanOptionalAction if default else "store_true", default=default
            )
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
    p.add_argument(
        "--judge",
        default=ZERO_SHOT,
        help="bi-encoder that judges restatements of the last turn ('zero-shot', a checkpoint, or 'none')",
    )
    p.add_argument("--out", required=True, help="JSON file to write")


def _cmd_eval(args: argparse.Namespace) -> int:
    from coreply.artifacts import write_json_atomic
    from coreply.checkpoint import read_meta
    from coreply.corpus import responses_of
    from coreply.device import resolve_device
    from evaluation.report import EvalSpec, pool_for_eval, run_eval

    if not args.bi and not args.cross and "bm25" not in args.retriever:
        raise CliError("eval: give --bi, --cross or --retriever bm25")
    for path in (args.bi, args.cross, args.judge if args.judge != "none" else None):  # fail fast
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
        judge=None if args.judge == "none" else args.judge,
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
    if "restatement" in result:
        print(f"gold replies restate the last turn in {result['restatement']['gold']:.1f}% of cases")
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
    from evaluation.plots import plot_nr_sweep, plot_runs
    from evaluation.report import merge_sweeps, render_markdown

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


def _index_parser(sub) -> None:
    p = sub.add_parser("index", help="build, extend or verify a serving bundle")
    isub = p.add_subparsers(dest="index_command", required=True)
    b = isub.add_parser(
        "build", help="encode a response pool into a bundle (models + FAISS index + manifest)"
    )
    b.add_argument("--output", "-o", required=True, help="bundle directory to write (replaced atomically)")
    b.add_argument("--bi", default=ZERO_SHOT, help="bi-encoder checkpoint dir, or 'zero-shot' (default)")
    b.add_argument("--cross", default=None, help="cross-encoder checkpoint dir (none: retrieval only)")
    b.add_argument("--pool", default="chitchat", help="'chitchat' (built-in) or a .txt / .jsonl pool file")
    b.add_argument("--queries", default=None, help="pairs file whose contexts measure ANN recall")
    b.add_argument("--factory", default="Flat", help="FAISS factory string, e.g. Flat, IVF1024,Flat, HNSW32")
    b.add_argument("--search-params", default="", help="e.g. nprobe=16 or efSearch=128")
    b.add_argument("--onnx", choices=["int8", "fp32", "none"], default="int8")
    b.add_argument("--calibrate", type=int, default=200, help="valid pairs for the z-score weight (chitchat)")
    b.add_argument("--device", default="auto")
    a = isub.add_parser("add", help="append responses to a bundle without re-encoding the others")
    a.add_argument("bundle")
    a.add_argument("pool", help=".txt (one per line) or .jsonl ({'text': ...}) file")
    v = isub.add_parser("verify", help="check a bundle's hashes, counts and model ties")
    v.add_argument("bundle")


def _cmd_index(args: argparse.Namespace) -> int:
    from coreply.readers import read_pairs, read_pool

    if args.index_command == "verify":
        from index_builder.build import verify_bundle

        manifest = verify_bundle(args.bundle)
        count = manifest["index"]["count"]
        print(f"{args.bundle}: ok (version {manifest['bundle_version']}, {count} responses)")
        return 0
    if args.index_command == "add":
        from index_builder.build import add_responses

        manifest = add_responses(args.bundle, read_pool(args.pool))
        print(f"{args.bundle}: version {manifest['bundle_version']}, {manifest['index']['count']} responses")
        return 0
    from index_builder.build import build_bundle

    if args.pool == "chitchat":
        from coreply.corpus import load_chitchat, responses_of

        splits = load_chitchat()
        texts = responses_of(splits)
        queries = [p.context for p in splits["valid"][:500]]
        calibration = splits["valid"][: args.calibrate] if args.cross else []
    else:
        texts, queries, calibration = read_pool(args.pool), [], []
    if args.queries:
        queries = [p.context for p in read_pairs(args.queries)][:500]
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
    )
    info = manifest["index"]
    print(
        f"wrote {args.output}: {info['count']} responses, dim {info['dim']}, {info['factory']}, "
        f"recall vs exact {info['recall_vs_exact'] or 'not measured (no queries)'}, "
        f"{manifest['build']['total_seconds']} s"
    )
    return 0


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve POST /respond (builds the default bundle on first use)")
    p.add_argument(
        "--bundle", default=None, help="bundle dir (env COREPLY_BUNDLE; default: the built-in one)"
    )
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--backend", choices=["auto", "onnx", "torch"], default=None)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (0 = measure at start)")
    p.add_argument("--device", default=None)


def _cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from coreply.bundle import MANIFEST
    from service.server import serve
    from service.settings import DEFAULT_BUNDLE, Settings

    overrides = {
        k: getattr(args, k)
        for k in ("bundle", "host", "port", "backend", "threads", "device")
        if getattr(args, k) is not None
    }
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:  # one line naming the setting, not pydantic's report
        first = exc.errors()[0]
        name = f"COREPLY_{str(first['loc'][0]).upper()}" if first["loc"] else "the settings"
        raise CliError(f"{name}: {first['msg']}") from None
    if settings.bundle == DEFAULT_BUNDLE:
        from index_builder.default import ensure_default_bundle

        ensure_default_bundle(settings.bundle)
    elif not (settings.bundle / MANIFEST).is_file():
        raise CliError(f"no bundle at {settings.bundle}; build one with `coreply index build -o DIR`")
    else:  # fail fast with a clear message rather than inside the server's lifespan
        from coreply.bundle import read_manifest

        read_manifest(settings.bundle)
    serve(settings)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coreply", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _eval_parser(sub)
    _report_parser(sub)
    _index_parser(sub)
    _serve_parser(sub)
    return parser


COMMANDS: dict[str, Any] = {
    "train": _cmd_train,
    "eval": _cmd_eval,
    "report": _cmd_report,
    "index": _cmd_index,
    "serve": _cmd_serve,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from coreply.bundle import BundleError
    from coreply.checkpoint import CheckpointError
    from coreply.readers import DataError

    try:
        return COMMANDS[args.command](args)
    except (CliError, DataError, CheckpointError, BundleError, FileNotFoundError, ValueError) as exc:
        print(f"coreply {args.command}: error: {exc}", file=sys.stderr)
        return 2
