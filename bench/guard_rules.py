"""Which restatement guard keeps the replies and drops the restatements? A bundle's first stage as served
(its retriever, prior and lexical stage) with the guard off recalls ``--depth`` candidates per context
once; every rule then drops the candidates it flags and answers with the first one left. Each rule's
thresholds are quantiles of the same measure over human replies (the first 5,000 validation pairs, as
the served guard is calibrated), so a rule at quantile q drops about 1 - q of what people say:

- ``served guard``: the bundle's own (coreply/restatement.py);
- ``cosine q``: the retriever's cosine of the candidate with the last turn, or its highest with an
  earlier turn, at their q quantiles (the guard before §41);
- ``words q``: F1 of the candidate's distinct words with the last turn's at its q quantile (the words
  BM25 rewards are the words a restatement repeats; the guard's third threshold since §41);
- ``cosine q1 + words q2``: either.

Per rule: hits@1 and hits@10 of the gold over the bundle's pool (among the kept candidates in the
first stage's order), the share of human replies it drops, both restatement judges of
``restatement_guard.py`` on the top answer (the *words* judge is unigram F1 >= 0.6, so it is not an
independent judge of a words rule: the model judge is), wins and losses against the served guard and a
one-sided paired bootstrap p that the rule ranks better than it.

Only an approximation of serving a rule: served, the lexical stage reorders the first 100 candidates
the guard keeps, here the first 100 of all; ``restatement_guard.py`` measures a built rule as served.

    python bench/guard_rules.py --bundle artifacts/default-bundle --split valid --start 2000 --limit 4622 \\
        --out docs/guard-rules-valid2000.json
"""

from __future__ import annotations

import argparse

import numpy as np

from bench import (  # bench/bench.py: this script's directory is on sys.path
    add_pairs_args,
    chosen_pairs,
    provenance,
    responder,
)
from coreply import restatement
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_bi
from coreply.config import ZERO_SHOT
from coreply.corpus import load_chitchat
from coreply.ranking import Query
from coreply.text import normalize
from evaluation.metrics import paired_bootstrap
from evaluation.restatement import RestatementJudge, words_rate

SERVED = "served guard"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle", help="a bundle with a restatement guard")
    add_pairs_args(p, "valid", 2000, 4622)
    p.add_argument("--depth", type=int, default=30, help="candidates recalled per context, guard off")
    p.add_argument("--cosine", type=float, nargs="+", default=[0.98, 0.99, 0.995], help="cosine quantiles")
    p.add_argument("--words", type=float, nargs="+", default=[0.99, 0.995, 0.999], help="words quantiles")
    args = p.parse_args()
    if args.depth < 10:
        raise SystemExit(f"--depth: at least 10 (hits@10 is counted among them), got {args.depth}")
    for flag, qs in (("--cosine", args.cosine), ("--words", args.words)):
        if bad := [q for q in qs if not 0.5 <= q < 1]:
            raise SystemExit(f"{flag}: each quantile in [0.5, 1), got {bad}")
    pairs = chosen_pairs(args)
    bot = responder(args.bundle)
    ranking = bot.pipeline
    if ranking.guard is None or ranking.turn_vectors is None:
        raise SystemExit(f"--bundle {args.bundle}: has no restatement guard to compare with (rebuild it)")
    served = ranking.guard

    # human replies: the measures every threshold is a quantile of
    held_out = load_chitchat()["valid"][: restatement.MAX_PAIRS]
    h_last, h_earlier, h_words, _ = restatement.human_closeness(bot.backend.encode_responses, held_out)

    # the candidates, guard off, and each one's measures
    contexts = [p.context for p in pairs]
    candidates = []
    for s in range(0, len(pairs), 64):
        queries = [Query(tuple(c), allow_restatements=True) for c in contexts[s : s + 64]]
        candidates += ranking.recall(queries, [args.depth] * len(queries))
    ids = [c.ids for c in candidates]
    vectors = ranking.retrieve.vectors  # type: ignore[attr-defined]
    near = restatement.closeness(ranking.turn_vectors, contexts, [vectors(i) for i in ids])
    pool_words = ranking.word_sets()
    words = [pool_words.overlap(c[-1], i) for c, i in zip(contexts, ids, strict=True)]
    print(f"{len(pairs)} contexts recalled", flush=True)

    def drops(guard: restatement.Guard) -> tuple[list[np.ndarray], float]:
        """Per context the mask of candidates ``guard`` drops, and the share of human replies it drops."""
        masks = [guard.flags(ls, es, ws) for (ls, es), ws in zip(near, words, strict=True)]
        return masks, float(np.mean(guard.flags(h_last, h_earlier, h_words)))

    def rule(cos_q: float | None, words_q: float | None) -> tuple[list[np.ndarray], float]:
        """A guard with these quantiles of the human replies' measures (None: that check off)."""
        return drops(
            restatement.Guard(
                np.inf if cos_q is None else float(np.quantile(h_last, cos_q)),
                np.inf if cos_q is None else float(np.quantile(h_earlier, cos_q)),
                np.inf if words_q is None else float(np.quantile(h_words, words_q)),
            )
        )

    rules: dict[str, tuple[list[np.ndarray], float]] = {"guard off": rule(None, None), SERVED: drops(served)}
    for q in args.cosine:
        rules[f"cosine {q}"] = rule(q, None)
    for w in args.words:
        rules[f"words {w}"] = rule(None, w)
        for q in args.cosine:
            rules[f"cosine {q} + words {w}"] = rule(q, w)

    judge = RestatementJudge(load_bi(ZERO_SHOT))
    gold = [normalize(p.response) for p in pairs]
    hits: dict[str, np.ndarray] = {}
    rows: dict[str, dict] = {}
    for name, (masks, human) in rules.items():
        kept = [i[~m] for i, m in zip(ids, masks, strict=True)]
        keys = [[ranking.keys[j] for j in k[:10]] for k in kept]
        top = [ranking.texts[k[0]] if len(k) else None for k in kept]
        hits[name] = np.array([k[:1] == [g] for k, g in zip(keys, gold, strict=True)], dtype=float)
        rows[name] = {
            "hits@1": round(100 * float(hits[name].mean()), 2),
            "hits@10": round(100 * float(np.mean([g in k for k, g in zip(keys, gold, strict=True)])), 2),
            "human_replies_dropped_%": round(100 * human, 2),
            "restates_judge": round(judge.rate(contexts, top), 2),
            "restates_words": words_rate(contexts, top),
            "unanswered": sum(t is None for t in top),
        }
    for name, row in rows.items():
        row["wins"] = int(((hits[name] == 1) & (hits[SERVED] == 0)).sum())
        row["losses"] = int(((hits[name] == 0) & (hits[SERVED] == 1)).sum())
        row["p_better_than_served"] = round(paired_bootstrap(hits[name], hits[SERVED]), 4)
        row["top1_cases"] = np.flatnonzero(hits[name]).tolist()
        print(name, {k: v for k, v in row.items() if k != "top1_cases"}, flush=True)
    people = [p.response for p in pairs]
    result = provenance() | {
        "bundle": args.bundle,
        "pairs": f"{args.split}[{args.start}:{args.start + len(pairs)}]",
        "depth": args.depth,
        "calibrated_on": f"valid[:{len(held_out)}]",
        "served_guard": bot.bundle.manifest["restatement"],
        "people": {"judge": round(judge.rate(contexts, people), 2), "words": words_rate(contexts, people)},
        "rows": rows,
    }
    print("people", result["people"])
    if args.out:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
