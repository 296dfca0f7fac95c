"""Does a bundle answer better than another as served? The test a candidate passes before it ships.

Each ``--bundles`` entry answers every context of the ``--measure`` spans through its
:class:`~coreply.responder.Responder`: the path ``POST /respond`` takes for a request that names no
fusion (echo filter, restatement guard, response prior, lexical stage, the rerank gate and reach, the
bundle's calibrated fusion), one context at a time. A top answer is a hit where it is the test reply.
Every bundle after the first is compared with the first pair for pair: hits@1, the contexts it wins and
loses, and the one-sided paired bootstrap p that it is not better, on each span and pooled over all of
them (a gain too small to show on one span may show on all: docs/results.md §48). Each bundle's top
answers are also judged for restating the context's last turn (``restates_%``: the zero-shot model judge
and shared words, :mod:`evaluation.restatement`), beside people's own replies on the span (``people``):
issue #12 asks for at most 1.5 times people's rate.

This is what a lease's reranker has to pass: built into a candidate bundle beside the shipped first
stage, it must beat the shipped default as served, on the pairs no choice was made on (the defaults:
test[0:2000] apart, as issue #12 states its targets there, the rest of the test split, valid[2000:]).
A lease's retriever too (``build_default_bundle(out, bi=...)``), on the test spans alone: its guard and
prior are chosen on the whole validation split.
``bench/rerank_ensemble.py`` (the rerankers' sums, ungated) and ``bench/rerank_gate.py`` (a bundle
against its own first stage, every gate) say why; this says whether. About 90-105 ms a context and bundle
on a 2-vCPU AMD Zen 3 host: 17-20 minutes a bundle over the 11,445 default pairs.

    python bench/as_served.py --bundles artifacts/default-bundle artifacts/cand-core-warm \\
        --out docs/lease-DATE/as-served.json
    python bench/as_served.py --bundles artifacts/default-bundle artifacts/cand-core-warm \\
        --exclude-conversation --out docs/lease-DATE/as-served-apart.json   # a pool without the conversation

A team's own pairs in place of chitchat's spans (``--pairs``, each file a span; bundles over that team's
pool, docs/results.md §67 measures the built-in models over another corpus this way):

    python bench/as_served.py --bundles bare.bundle pinned.bundle --pairs support.jsonl chat.jsonl
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench import (  # bench/bench.py: this script's directory is on sys.path
    disjoint_spans,
    paired_hits,
    provenance,
    refuse_below,
    responder,
    span_name,
    span_pairs,
)
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_bi
from coreply.config import ZERO_SHOT
from coreply.corpus import load_chitchat
from coreply.readers import DataError, read_pairs
from coreply.responder import Responder
from coreply.text import normalize
from evaluation.protocols import conversation_others
from evaluation.restatement import RestatementJudge, words_rate

N_R = 10  # candidates recalled, as the service's default (COREPLY_DEFAULT_CANDIDATES)


def top1(
    bot: Responder, pairs: list, exclude: list[tuple[str, ...]] | None
) -> tuple[list[int | None], np.ndarray]:
    """The bundle's top answer to each pair's context as served (a pool id, or None where nothing is
    left), and [N] 1.0 where it is the pair's test reply; ``exclude``: per pair, texts its request may
    not answer."""
    texts = exclude if exclude is not None else [()] * len(pairs)
    ids: list[int | None] = []
    for pair, other in zip(pairs, texts, strict=True):
        replies = bot.respond(list(pair.context), n_candidates=N_R, exclude_texts=other)
        ids.append(replies[0].id if replies else None)
    golds = [normalize(pair.response) for pair in pairs]
    hit = [i is not None and bot.bundle.keys[i] == g for i, g in zip(ids, golds, strict=True)]
    return ids, np.array(hit, dtype=float)


def restates(judge: RestatementJudge, pairs: list, answers: list[str | None]) -> dict[str, float]:
    """% of ``answers`` (None: none) that restate their pair's last turn, by the model judge and by words."""
    contexts = [list(pair.context) for pair in pairs]
    return {"judge": round(judge.rate(contexts, answers), 2), "words": words_rate(contexts, answers)}


def chitchat_spans(measure: list[str]) -> dict[str, tuple[list, list]]:
    """``--measure``'s spans: name -> (its pairs, the whole split they come from)."""
    splits = load_chitchat()
    spans = disjoint_spans("--measure", measure)
    return {span_name(*s): (span_pairs("--measure", splits, s), splits[s[0]]) for s in spans}


def own_spans(files: list[str]) -> dict[str, tuple[list, list]]:
    """``--pairs``' files: name (the file's) -> (every pair of it, twice); a one-line exit for one that
    cannot be read, or for two of one name."""
    if len({Path(f).name for f in files}) < len(files):
        raise SystemExit("--pairs: two files have one name (a span's); give files with distinct names")
    spans = {}
    for path in files:
        try:
            pairs = read_pairs(path)
        except DataError as exc:
            raise SystemExit(f"--pairs: {exc}") from None
        spans[Path(path).name] = (pairs, pairs)
    return spans


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundles", nargs="+", required=True, help="the first is the one the others must beat")
    p.add_argument(
        "--measure",
        nargs="+",
        default=["test:0:2000", "test:2000:4823", "valid:2000:4622"],
        help="split:start:limit, disjoint; with more than one, also pooled",
    )
    p.add_argument(
        "--pairs",
        nargs="+",
        default=None,
        metavar="FILE",
        help="pairs files (as `coreply eval --data` reads), each a span, in place of --measure",
    )
    p.add_argument(
        "--exclude-conversation",
        action="store_true",
        help="each context excludes the other lines of its conversation, as a pool would that does not "
        "hold the conversation being served (docs/results.md §60)",
    )
    p.add_argument("--threads", type=int, default=2, help="each bundle's intra-op threads")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = p.parse_args()
    if len(set(args.bundles)) < len(args.bundles) or len(args.bundles) < 2:
        raise SystemExit("--bundles: give two or more different ones, the first the one the others must beat")
    refuse_below(args, threads=1)
    spans = own_spans(args.pairs) if args.pairs else chitchat_spans(args.measure)  # checked before any runs
    bots = {path: responder(path, threads=args.threads) for path in args.bundles}  # all load before any runs
    judge = RestatementJudge(load_bi(ZERO_SHOT))

    hits: dict[str, dict[str, np.ndarray]] = {path: {} for path in bots}  # bundle -> span -> [N] 0/1
    result: dict = provenance() | {"exclude_conversation": args.exclude_conversation, "n_r": N_R}
    result["bundles"] = {
        path: {"version": bot.bundle.version, "fusion": bot.default_fusion, "spans": {}}
        for path, bot in bots.items()
    }
    result["people"] = {}  # span -> the restatement rates of its test replies
    for name, (pairs, whole) in spans.items():
        exclude = conversation_others(pairs, whole) if args.exclude_conversation else None
        result["people"][name] = restates(judge, pairs, [pair.response for pair in pairs])
        for path, bot in bots.items():
            began = time.perf_counter()
            answers, hit = top1(bot, pairs, exclude)
            hits[path][name], seconds = hit, time.perf_counter() - began
            texts = [None if i is None else bot.bundle.texts[i] for i in answers]
            result["bundles"][path]["spans"][name] = row = {
                "hits@1": round(100 * float(hit.mean()), 2),
                "ms_per_context": round(1000 * seconds / len(pairs), 1),
                "restates_%": restates(judge, pairs, texts),
                "top1_cases": np.flatnonzero(hit).tolist(),  # to pair with other runs on the same span
                "answers": answers,  # each context's top answer, a row of the bundle's pool (null: none)
            }
            print(
                f"{name} {path}: hits@1 {100 * hit.mean():.2f}, restating {row['restates_%']} (people "
                f"{result['people'][name]}) ({seconds:.0f} s)",
                flush=True,
            )

    names = list(spans)
    first, *others = bots
    result["against_first"] = {}
    for path in others:
        rows = {name: paired_hits(hits[path][name], hits[first][name], "p_beats_first") for name in names}
        if len(names) > 1:
            mine, theirs = (np.concatenate([hits[b][n] for n in names]) for b in (path, first))
            rows["pooled"] = paired_hits(mine, theirs, "p_beats_first") | {
                "first's hits@1": round(100 * float(theirs.mean()), 2),
                "pairs": len(mine),
            }
        result["against_first"][path] = rows
        for name, row in rows.items():
            print(f"{path} against {first}, {name}: {row}", flush=True)
    if args.out:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
