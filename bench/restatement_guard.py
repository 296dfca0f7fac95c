"""Reply or restatement, as served: a bundle's answers to chitchat contexts with its restatement guard
off and on (coreply/restatement.py), through the code the service runs (``Responder``'s pipeline).

Per setting: hits@1 and hits@10 of the gold reply over the bundle's whole pool (protocol B, in the
order of the first stage and, for a bundle with a reranker, also in the order it serves: its first 10
reranked and fused as calibrated, always and, with a rerank gate, only where the first stage does not
lead past it), the latency per context (answers batched by 64, and whole requests one at a time), and
two restatement rates of the top answer, each beside the rate of the human replies themselves:

- *judge*: cosine with the last turn >= 0.8 under zero-shot all-MiniLM-L6-v2 (``coreply eval``'s
  metric, evaluation/restatement.py). The default bundle's retriever starts from that model, so its
  guard and this judge agree by construction to a degree;
- *words*: unigram F1 with the last turn >= 0.6, a judge that shares nothing with any model (human
  replies reach it in 0.24 % of the validation split).

It also gives one-sided paired bootstrap p-values for "the guard costs hits@1" and, with a reranker,
"reranking gains no hits@1", the cases each setting answers with the gold (``--against`` other runs'
files: p that this bundle ranks better than each, per setting both measured), and prints the top
answer to the prompts of issue #12 in each setting.

    python bench/restatement_guard.py --bundle artifacts/default-bundle --split test --limit 2000 \\
        --out docs/restate-guard-default.json

``--quantiles Q ...`` instead re-calibrates the guard at each quantile (on the pairs the bundle's own
guard was calibrated on: the first 5,000 validation pairs for the built-in corpus) and reports hits@1,
hits@10 and both restatement rates of the guarded answers per quantile. In either mode ``--start``
skips the first pairs of the split, e.g. those a quantile or a weight was chosen on.
``--backend`` runs the models as ``coreply serve --backend`` would (e.g. ``torch``: fp32, against the
bundle's int8 ONNX), and ``--fusion sum zscore`` measures each fusion of the reranked candidates.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import refuse_below, responder  # bench/bench.py: this script's directory is on sys.path
from coreply.artifacts import read_json, write_json_atomic
from coreply.bundle import BACKENDS
from coreply.checkpoint import load_bi
from coreply.config import ZERO_SHOT
from coreply.corpus import load_chitchat
from coreply.gate import gated
from coreply.ranking import FUSIONS, Query, order
from coreply.text import normalize
from evaluation.metrics import paired_bootstrap
from evaluation.restatement import RestatementJudge, words_rate

PROMPTS = [
    ["what do you do for a living?"],
    ["i just got a new puppy!"],
    ["what's your favorite movie?"],
    ["hi! how was your weekend?", "great, i went hiking. you?"],
]


def top_answers(
    ranking: Any, pairs: list, allow: bool = False, fusion: str = "retrieval", as_served: bool = False
) -> tuple[list[list[str]], list[str | None]]:
    """Answer through ``ranking`` in batches of 64, 10 candidates each, reranked and fused by ``fusion``
    unless it is ``retrieval`` (``as_served``: behind the bundle's rerank gate and reach, as
    ``Responder.respond`` does one at a time): per pair the keys of its top 10 and its top text."""
    ids = []
    gate, reach = (ranking.gate, ranking.reach) if as_served else (None, None)
    for s in range(0, len(pairs), 64):
        queries = [Query(tuple(p.context), allow_restatements=allow) for p in pairs[s : s + 64]]
        candidates = ranking.recall(queries, [10] * len(queries))
        plans = [gated(c, fusion, gate, reach) for c in candidates]  # (fusion, candidates reranked)
        todo = [i for i, (f, _) in enumerate(plans) if f != "retrieval"]
        if todo:
            ranking.rerank(
                [queries[i] for i in todo], [candidates[i] for i in todo], [plans[i][1] for i in todo]
            )
        for c, (used, reranked) in zip(candidates, plans, strict=True):
            ids.append(c.ids[order(c, used, 10, ranking.weight, reranked)[0]])
    ranked = [[ranking.keys[j] for j in i] for i in ids]
    return ranked, [ranking.texts[i[0]] if len(i) else None for i in ids]


def setting(allow: bool, fusion: str, gated: bool = False) -> str:
    """A setting's name: the guard off or on, in the first stage's order or reranked by ``fusion`` (where
    the bundle's rerank gate lets it, when ``gated``)."""
    name = "guard off" if allow else "guard on"
    return name if fusion == "retrieval" else f"{name}, reranked ({fusion}{', gated' if gated else ''})"


def sweep(args: argparse.Namespace) -> None:
    """The guard re-calibrated at each of ``args.quantiles``, measured on the split's pairs."""
    from coreply import restatement

    bot = responder(args.bundle, backend=args.backend)
    ranking = bot.pipeline
    if ranking.guard is None:
        raise SystemExit(f"{args.bundle}: this bundle has no restatement guard (rebuild it)")
    splits = load_chitchat()
    last, earlier, overlap, openers = restatement.human_closeness(
        bot.backend.encode_responses, splits["valid"]
    )
    pairs = splits[args.split][args.start : args.start + args.limit]
    contexts = [p.context for p in pairs]
    gold = [normalize(p.response) for p in pairs]
    judge = RestatementJudge(load_bi(ZERO_SHOT))
    result: dict[str, Any] = {
        "gold": {
            "judge": round(judge.rate(contexts, [p.response for p in pairs]), 2),
            "words": words_rate(contexts, [p.response for p in pairs]),
        },
        "quantiles": {},
    }
    print("gold replies", result["gold"], flush=True)
    for q in args.quantiles:
        entry = restatement.guard_entry(last, earlier, overlap, q, openers)  # as a build calibrates
        ranking.guard = restatement.Guard.of(entry)
        ranked, top = top_answers(ranking, pairs)
        hits = np.array([r[:1] == [g] for r, g in zip(ranked, gold, strict=True)], dtype=float)
        result["quantiles"][str(q)] = row = {
            "guard": entry,
            "hits@1": round(100 * float(hits.mean()), 2),
            "hits@10": round(100 * float(np.mean([g in r for r, g in zip(ranked, gold, strict=True)])), 2),
            "restates_judge": round(judge.rate(contexts, top), 2),
            "restates_words": words_rate(contexts, top),
            "top1_cases": np.flatnonzero(hits).tolist(),
        }
        print(q, {k: v for k, v in row.items() if k not in ("top1_cases", "guard")}, flush=True)
    result["meta"] = {
        "bundle": args.bundle,
        "backend": bot.backend.name,
        "split": args.split,
        "pairs": f"[{args.start}:{args.start + len(pairs)}]",
        "pool": len(ranking.texts),
        "calibrated_on": f"valid[:{len(last)}]",
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.system()}",
    }
    if args.out:
        write_json_atomic(Path(args.out), result, sort_keys=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle")
    p.add_argument("--split", default="test", choices=["valid", "test"])
    p.add_argument("--limit", type=int, default=2000, help="N pairs of the split, from --start")
    p.add_argument("--single", type=int, default=200, help="contexts timed one at a time")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    p.add_argument("--against", nargs="+", default=[], help="other runs' --out files (same split and limit)")
    p.add_argument("--quantiles", type=float, nargs="+", default=[], help="sweep the guard's quantile")
    p.add_argument("--start", type=int, default=0, help="skip the split's first N pairs")
    p.add_argument("--backend", default="auto", help=f"the models' runtime, as served: {', '.join(BACKENDS)}")
    allowed = [f for f in FUSIONS if f != "retrieval"]
    p.add_argument(
        "--fusion",
        nargs="+",
        default=[],
        help=f"rerank and fuse by each of {', '.join(allowed)} (default: as served, the bundle's default)",
    )
    args = p.parse_args()
    refuse_below(args, limit=1, single=1, start=0)
    if args.backend not in BACKENDS:
        raise SystemExit(f"--backend: one of {', '.join(BACKENDS)}, got {args.backend!r}")
    if any(f not in allowed for f in args.fusion):
        raise SystemExit(f"--fusion: each one of {', '.join(allowed)}, got {' '.join(args.fusion)}")
    if args.quantiles:
        from coreply.restatement import check_quantile

        try:
            [check_quantile(q) for q in args.quantiles]
        except ValueError as e:
            raise SystemExit(f"--quantiles: {e}") from None
        return sweep(args)
    others = {}
    for path in args.against:
        try:
            others[path] = other = read_json(path)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--against {path}: cannot read it ({e})") from None
        meta = other.get("meta", {}) if isinstance(other, dict) else {}
        if (
            "top1_cases" not in other
            or meta.get("split") != args.split
            or meta.get("pairs") != args.limit
            or meta.get("start", 0) != args.start
        ):
            span = f"{args.split}[{args.start}:{args.start + args.limit}]"
            raise SystemExit(f"--against {path}: not a run of this bench on {span}")

    bot = responder(args.bundle, backend=args.backend)
    ranking = bot.pipeline
    if ranking.guard is None:
        raise SystemExit(f"{args.bundle}: this bundle has no restatement guard (rebuild it)")
    pairs = load_chitchat()[args.split][args.start : args.start + args.limit]
    contexts = [p.context for p in pairs]
    judge = RestatementJudge(load_bi(ZERO_SHOT))

    result: dict = {
        "gold": {
            "judge": round(judge.rate(contexts, [p.response for p in pairs]), 2),
            "words": words_rate(contexts, [p.response for p in pairs]),
        },
        "settings": {},
        "prompts": {},
    }
    top1: dict[str, np.ndarray] = {}  # per case: the gold is the top answer
    gold = [normalize(p.response) for p in pairs]
    if args.fusion and ranking.reranker is None:
        raise SystemExit(f"--fusion: {args.bundle} has no reranker; leave --fusion out")
    reranked = (args.fusion or [bot.default_fusion]) if ranking.reranker else []
    # the first stage, then each fusion of the reranked candidates; as served, also behind the gate
    runs: list[tuple[str, bool]] = [("retrieval", False), *[(f, False) for f in reranked]]
    if ranking.reranker and not args.fusion and ranking.gate is not None:
        runs.append((bot.default_fusion, True))
    for (fusion, as_served), allow in [(r, a) for r in runs for a in (True, False)]:
        start = time.perf_counter()
        ranked, top = top_answers(ranking, pairs, allow, fusion, as_served)
        ms = 1000 * (time.perf_counter() - start) / len(pairs)
        name = setting(allow, fusion, as_served)
        named = None if as_served else fusion  # a request that names no fusion is gated
        top1[name] = np.array([r[:1] == [g] for r, g in zip(ranked, gold, strict=True)], dtype=float)
        result["settings"][name] = {
            "hits@1": round(100 * float(top1[name].mean()), 2),
            "hits@10": round(100 * float(np.mean([g in r for r, g in zip(ranked, gold, strict=True)])), 2),
            "restates_judge": round(judge.rate(contexts, top), 2),
            "restates_words": words_rate(contexts, top),
            "ms_per_context_batched": round(ms, 2),
        }
        answers = [bot.respond(c, fusion=named, allow_restatements=allow) for c in PROMPTS]
        result["prompts"][name] = [a[0].text if a else None for a in answers]
        one = []  # one context at a time, as a lone client's request is answered
        for c in contexts[: args.single]:
            start = time.perf_counter()
            bot.respond(c, fusion=named, allow_restatements=allow)
            one.append(1000 * (time.perf_counter() - start))
        result["settings"][name]["ms_one_context_p50"] = round(float(np.median(one)), 2)
        print(name, result["settings"][name], flush=True)
    # one-sided paired bootstrap: is hits@1 without the guard higher than with it?
    result["p_guard_costs_hits@1"] = round(paired_bootstrap(top1["guard off"], top1["guard on"]), 4)
    if len(runs) > 1:  # and is it higher reranked than in the first stage's order?
        result["p_rerank_gains_hits@1"] = {  # per reranked setting, against the same guard unreranked
            setting(allow, f, g is not None): round(
                paired_bootstrap(top1[setting(allow, f, g is not None)], top1[setting(allow, "retrieval")]), 4
            )
            for f, g in runs[1:]
            for allow in (True, False)
        }
    result["top1_cases"] = {name: np.flatnonzero(hit).tolist() for name, hit in top1.items()}
    result["against"] = []
    for path, other in others.items():
        against: dict[str, Any] = {"file": path}
        for name, hit in top1.items():
            if name not in other["top1_cases"]:  # a setting the other bundle has not (a reranker)
                continue
            theirs = np.zeros_like(hit)
            theirs[other["top1_cases"][name]] = 1
            against[f"p_better_{name}"] = round(paired_bootstrap(hit, theirs), 4)
        result["against"].append(against)
        print("against", against)
    print("gold replies", result["gold"], "p (guard costs hits@1)", result["p_guard_costs_hits@1"])
    if "p_rerank_gains_hits@1" in result:
        print("p (the reranker gains no hits@1)", result["p_rerank_gains_hits@1"])
    for i, prompt in enumerate(PROMPTS):
        print(" / ".join(prompt), {name: answers[i] for name, answers in result["prompts"].items()})
    result["meta"] = {
        "bundle": args.bundle,
        "backend": bot.backend.name,
        "guard": bot.bundle.manifest["restatement"],
        "split": args.split,
        "start": args.start,
        "pairs": len(pairs),
        "lexical": bot.bundle.manifest.get("lexical"),
        "pool": len(ranking.texts),
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.system()}",
    }
    if args.out:
        write_json_atomic(Path(args.out), result, sort_keys=False)


if __name__ == "__main__":
    main()
