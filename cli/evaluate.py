"""``coreply eval`` and ``report``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cli.common import (
    DEFAULTS_SHOWN,
    CliError,
    add_checkpoint_args,
    at_least,
    checkpoint,
    guard_quantile,
    load_data,
    not_an_input,
    out_file,
    read_prior_pairs,
    result_name,
)
from coreply.artifacts import read_json, write_atomic, write_json_atomic
from coreply.config import ZERO_SHOT, ModelConfig
from coreply.restatement import DEFAULT_QUANTILE


def eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate on protocol A (1-of-N) and B (full pool)", **DEFAULTS_SHOWN)
    add_checkpoint_args(p, None, "no reranker rows")
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
        help="first N validation pairs for choosing the z-score weight (0 = all)",
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
        type=checkpoint("bi"),
        default=ZERO_SHOT,
        help="bi-encoder that judges restatements of the last turn ('zero-shot', 'builtin', a checkpoint, or "
        "'none')",
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


def cmd_eval(args: argparse.Namespace) -> int:
    from coreply.checkpoint_meta import read_meta
    from coreply.corpus import responses_of
    from coreply.readers import read_pairs, read_pool

    if not args.bi and not args.cross and "bm25" not in args.retriever:
        raise CliError("give --bi, --cross or --retriever bm25")
    not_an_input(
        args.out, data=args.data, valid_data=args.valid_data, pool=args.pool, prior_pairs=args.prior_pairs
    )
    for path in (args.bi, args.cross, args.judge if args.judge != "none" else None):  # fail fast
        if path and path != ZERO_SHOT:
            read_meta(path, verify=False)  # loading verifies every hash
    if args.data == "chitchat":
        splits = load_data(args.data, args.max_turns)
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
        valid=valid[: args.valid_limit or None],
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
        prior_pairs=read_prior_pairs(args.prior_pairs, splits["train"] if args.data == "chitchat" else None),
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


def report_parser(sub) -> None:
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


def cmd_report(args: argparse.Namespace) -> int:
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

    not_an_input(args.out, inputs=args.inputs, runs=args.runs)
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
    sweep = merge_sweeps(results)
    if args.plot and sweep:
        plot_nr_sweep(sweep, args.plot)
    elif args.plot:
        print("note: no --plot written: no input has an n_r sweep (`coreply eval --n-r` of several values)")
    print(f"wrote {args.out}")
    return 0
