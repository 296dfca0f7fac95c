"""``coreply index`` (build / add / withdraw / info / verify) and ``compact``."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from cli.common import (
    DEFAULTS_SHOWN,
    CliError,
    add_checkpoint_args,
    at_least,
    filter_json,
    gate_fidelity,
    guard_quantile,
    knowledge_file,
    lexical_weight,
    out_dir,
    read_prior_pairs,
)
from coreply.config import ZERO_SHOT
from coreply.filters import FilterError
from coreply.gate import GATE_FIDELITY, REACH_FIDELITY
from coreply.lexical import DEPTH as LEXICAL_DEPTH
from coreply.lexical import PAIRS as LEXICAL_PAIRS
from coreply.prior import REFERENCE
from coreply.restatement import DEFAULT_QUANTILE


def index_parser(sub) -> None:
    p = sub.add_parser("index", help="build, extend, describe or verify a serving bundle")
    isub = p.add_subparsers(dest="index_command", required=True)
    b = isub.add_parser(
        "build", help="encode a response pool into a bundle (models + FAISS index + manifest)"
    )
    b.add_argument(
        "--output", "-o", type=out_dir, required=True, help="bundle directory to write (replaced atomically)"
    )
    add_checkpoint_args(b, ZERO_SHOT, "retrieval only")
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
        "for responses close to every context, weighted by hits@1 on --queries (without them, the built-in "
        "retriever's weight is the default bundle's); 'none': no prior (default: the built-in train split "
        "for the chitchat pool or the built-in retriever, none otherwise)",
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
    w.add_argument(
        "--filter",
        type=filter_json,
        metavar="JSON",
        help="""the responses whose metadata matches, as /respond's "filter": '{"intent": "retired"}'""",
    )
    w.add_argument("--restore", action="store_true", help="put the given responses back")
    v = isub.add_parser("verify", help="check a bundle's hashes, counts and model ties")
    v.add_argument("bundle")
    i = isub.add_parser("info", help="what a bundle holds: pool, index, models, fusion, sizes, build command")
    i.add_argument("bundle")
    instead = i.add_mutually_exclusive_group()
    instead.add_argument("--json", action="store_true", help="print the manifest instead")
    instead.add_argument(
        "--withdrawn",
        action="store_true",
        help="print the withdrawn responses instead, one JSON line each ({'id': ..., 'text': ...}: a file "
        "`index withdraw --texts` reads, to withdraw them from another bundle or put them back)",
    )
    instead.add_argument(
        "--filter",
        type=filter_json,
        metavar="JSON",
        help="""print the responses whose metadata matches instead, as /respond's "filter" allows them """
        """(withdrawn ones too), one JSON line each ({'id': ..., 'text': ..., 'metadata': ...})""",
    )


def _withdraw(args: argparse.Namespace) -> int:
    from coreply.readers import read_pool
    from index_builder.withdraw import withdraw

    if not args.ids and not args.texts and not args.filter:
        raise CliError("withdraw: name the responses with --ids, --texts or --filter (or several)")
    texts = read_pool(args.texts)[0] if args.texts else []
    manifest, changed, unknown = withdraw(args.bundle, args.ids, texts, args.restore, args.filter)
    if unknown:
        print(f"note: {len(unknown)} of the --texts are not in the bundle (the first: {unknown[0]!r})")
    out = manifest.get("withdrawn", {}).get("count", 0)
    verb = "restored" if args.restore else "withdrawn"
    print(
        f"{args.bundle}: version {manifest['bundle_version']}, {changed} {verb}; {out} of "
        f"{manifest['index']['count']} responses withdrawn in all"
    )
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    try:
        return _index(args)
    except FilterError as exc:  # `info --filter`, `withdraw --filter`
        raise CliError(f"--filter: {exc}") from None


def _index(args: argparse.Namespace) -> int:
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
        elif args.filter:
            from index_builder.info import matching

            for i, text, metadata in matching(args.bundle, args.filter):
                print(json.dumps({"id": i, "text": text, "metadata": metadata}, ensure_ascii=False))
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
    from coreply.corpus import load_chitchat, responses_of
    from index_builder.default import builtin_pins

    if args.pool == "chitchat":
        splits = load_chitchat()
        texts, metadata, pairs = responses_of(splits), [], splits["valid"]
    else:
        (texts, metadata), pairs = read_pool(args.pool), []
    if args.queries:
        pairs = read_pairs(args.queries)
    pinned = None if pairs else builtin_pins(args.bi, args.cross)
    builtin_train = None  # the reference contexts of the built-in retriever's prior, as the default's
    if args.pool == "chitchat" or (pinned and args.prior_pairs is None):
        builtin_train = (splits if args.pool == "chitchat" else load_chitchat())["train"]
    prior_pairs = read_prior_pairs(args.prior_pairs, builtin_train)
    if pinned and not prior_pairs:  # --prior-pairs none
        del pinned["prior"]
    if pinned and "prior" in pinned:
        source = "--prior-pairs" if args.prior_pairs else "chitchat's training split"
        contexts = min(REFERENCE, len(prior_pairs))
        print(
            f"note: no --queries pairs to weigh the response prior on: the default bundle's weight for the "
            f"built-in retriever; its values are measured on this pool against {contexts} contexts of "
            f"{source} (about a minute; '--prior-pairs none': no prior)"
        )
    elif prior_pairs and not pairs:
        print("note: no --queries pairs to weigh the response prior on: the bundle has no prior")
    queries = [p.context for p in pairs[:500]]
    calibration = pairs[: args.calibrate] if args.cross else []
    if pinned and "fusion" in pinned:
        print(
            "note: no --queries pairs to calibrate on: requests get the sum of the built-in models' scores "
            "(the default bundle's fusion for them), all reranked; the z-score weight stays at its default"
        )
    elif args.cross and not calibration:
        print("note: no --queries pairs to calibrate on: the z-score fusion weight stays at its default")
    if args.restatement_quantile is not None and not pairs:
        print("note: no --queries pairs to calibrate on: the bundle has no restatement guard")
    if args.lexical == "auto" and not pairs:
        print("note: no --queries pairs to choose the lexical weight on: the bundle has no lexical stage")
    knowledge = knowledge_file(args.knowledge) if args.knowledge else ()
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
        pinned=pinned,
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
    from index_builder.info import stages

    for label, value in stages(manifest):  # what it chose, as `coreply index info` says it
        print(f"{label:<10} {value}")
    return 0


def compact_parser(sub) -> None:
    p = sub.add_parser(
        "compact",
        help="shrink a checkpoint trained in full to low-rank adapters (a few MB, for git); check its "
        "quality with `coreply eval` before shipping it",
        **DEFAULTS_SHOWN,
    )
    p.add_argument("checkpoint", help="a checkpoint dir trained in full (or its fp16 copy)")
    p.add_argument("-o", "--out", type=out_dir, required=True, help="the compact checkpoint dir to write")
    p.add_argument("--rank", type=at_least(1), default=32, help="the adapters' rank")


def cmd_compact(args: argparse.Namespace) -> int:
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
