"""A soft restatement guard: the first stage's order learned from a few features, instead of a cosine
threshold that drops candidates and a fixed dense/BM25 weight.

The served default (recipe 7) drops every candidate whose cosine with the context's last turn (or an
earlier turn) reaches the 0.98 quantile of people's replies, then reorders the first 100 by
``0.6 z(dense) + 0.4 z(BM25)``. Section 35 of docs/results.md found the two fighting: the lexical stage
alone lifts hits@1 by 0.65 on the test, and the guard takes it all back. Here the bundle's retriever
recalls ``--depth`` candidates per context with no guard (echoes still dropped), and each candidate is
described by

- ``dense``: the retriever's score (with the bundle's prior), z-scored within the list;
- ``bm25``: BM25 against the last 5 turns (the served stage's scorer and statistics), z-scored;
- ``bm25_last``: BM25 against the last turn alone, z-scored;
- ``cos_last``, ``cos_earlier``: the guard's two cosines (coreply/restatement.py);
- ``over_last``, ``over_earlier``: how far each passes the bundle's own guard threshold (0 below it);
- ``length``: log(1 + words).

A linear scorer over these is trained list-wise (softmax cross-entropy of the gold, L2) on the
validation pairs ``[0:--train)`` whose gold is among the candidates, and measured on validation pairs
``[--train:]`` and on the first ``--limit`` test pairs, beside the bundle as served and the first stage
with no guard (dense, and dense + BM25 at the served weight), with the same two restatement judges as
``restatement_guard.py`` and one-sided paired bootstrap p against the bundle as served.

    python bench/learned_fusion.py --bundle artifacts/default-bundle \
        --out docs/learned-fusion-2026-11-27.json.gz
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import numpy as np
import torch

from bench import (  # bench/bench.py: this script's directory is on sys.path
    provenance,
    refuse_below,
    responder,
)
from coreply import restatement
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_bi
from coreply.config import ZERO_SHOT
from coreply.corpus import load_chitchat
from coreply.ranking import Pipeline, zscore
from coreply.text import normalize
from coreply.vectors import TextVectors, unit
from evaluation.metrics import paired_bootstrap, per_case, summarize
from evaluation.protocols import Retrieved, ranked_ids, ranks_for, retrieve_and_rerank
from evaluation.restatement import RestatementJudge, words_rate

FEATURES = ("dense", "bm25", "bm25_last", "cos_last", "cos_earlier", "over_last", "over_earlier", "length")


def describe(pipe: Pipeline, stage, guard: restatement.Guard, pairs: list, got: Retrieved) -> list:
    """Per pair, its candidates' features [k, len(FEATURES)] (float64 arrays)."""
    turns = TextVectors(lambda texts: unit(pipe.retrieve.encode_responses(texts)))  # type: ignore[attr-defined]
    contexts = [p.context for p in pairs]
    vectors = [pipe.retrieve.vectors(c.ids) for c in got.candidates]  # type: ignore[attr-defined]
    near = restatement.closeness(turns, contexts, vectors)
    out = []
    for context, c, (last, earlier) in zip(contexts, got.candidates, near, strict=True):
        texts = [pipe.texts[i] for i in c.ids]
        columns = [
            zscore(c.retrieval),
            zscore(stage.scores(context, texts)),
            zscore(stage.bm25.scores(context[-1], texts)),
            last,
            earlier,
            np.maximum(last - guard.last, 0),
            np.maximum(earlier - guard.earlier, 0),
            np.log1p([len(t.split()) for t in texts]),
        ]
        out.append(np.stack(columns, axis=1))  # [k, F]
    return out


def gold_positions(pairs: list, keys, got: Retrieved) -> list[int]:
    """Per pair, the gold's position among its candidates (-1: not recalled)."""
    out = []
    for pair, c in zip(pairs, got.candidates, strict=True):
        gold = normalize(pair.response)
        hit = [j for j, i in enumerate(c.ids) if keys[i] == gold]
        out.append(hit[0] if hit else -1)
    return out


def fit(features: list[np.ndarray], golds: list[int], l2: float) -> np.ndarray:
    """Weights [F] of a linear scorer: softmax cross-entropy of the gold over each list that holds it."""
    lists = [(torch.from_numpy(x), g) for x, g in zip(features, golds, strict=True) if g >= 0]
    width = max(len(x) for x, _ in lists)
    X = torch.zeros(len(lists), width, len(FEATURES), dtype=torch.float64)  # [L, k, F]
    mask = torch.full((len(lists), width), float("-inf"), dtype=torch.float64)  # [L, k]
    for row, (x, _) in enumerate(lists):
        X[row, : len(x)], mask[row, : len(x)] = x, 0.0
    gold = torch.tensor([g for _, g in lists])
    w = torch.zeros(len(FEATURES), dtype=torch.float64)
    w[0] = 1.0  # start from the dense order
    w.requires_grad_(True)
    opt = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        logits = X @ w + mask  # [L, k]
        loss = torch.nn.functional.cross_entropy(logits, gold) + l2 * (w**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach().numpy()


def with_scores(got: Retrieved, scores: list[np.ndarray]) -> Retrieved:
    """``got`` with each list's ``scores`` as its rerank scores (ordered by fusion ``rerank``)."""
    lists = [copy.copy(c) for c in got.candidates]
    for c, s in zip(lists, scores, strict=True):
        c.rerank = s
    return Retrieved(lists, got.retrieve_s, 0.0)


def measure(name: str, pairs: list, keys, got: Retrieved, fusion: str, n_r: int, judge, texts) -> dict:
    """A system's row: protocol B metrics, ranks, and how often its top answer restates."""
    ranks = ranks_for(pairs, keys, got, fusion, n_r)
    top = [texts[i[0]] if len(i) else None for i in ranked_ids(got, fusion, n_r)]
    contexts = [p.context for p in pairs]
    restates = {"judge": round(judge.rate(contexts, top), 2), "words": words_rate(contexts, top)}
    return {"system": name, "metrics": summarize(ranks), "ranks": ranks, "restates": restates}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle", help="a bundle with a lexical stage")
    p.add_argument("--train", type=int, default=4000, help="validation pairs [0:N) the scorer learns on")
    p.add_argument("--limit", type=int, default=2000, help="test pairs [0:N), validation [train:train+N)")
    p.add_argument("--depth", type=int, default=100, help="candidates the scorer orders")
    p.add_argument("--l2", type=float, default=1e-3, help="weight decay of the scorer")
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = p.parse_args()
    refuse_below(args, train=100, limit=1, depth=10, l2=0)
    bot = responder(args.bundle)
    served = bot.pipeline
    if served.lexical is None or served.guard is None:
        raise SystemExit("--bundle: it needs a lexical stage and a restatement guard, as the default has")
    stage, guard = served.lexical, served.guard
    open_ = copy.copy(served)
    open_.guard = open_.lexical = None  # the first stage with echoes dropped, nothing else
    splits = load_chitchat()
    valid = splits["valid"]
    held_out = valid[args.train : args.train + args.limit]
    sets = {"valid-train": valid[: args.train], "valid": held_out, "test": splits["test"][: args.limit]}
    judge = RestatementJudge(load_bi(ZERO_SHOT))
    recalled, features, golds = {}, {}, {}
    for name, pairs in sets.items():
        start = time.perf_counter()
        recalled[name] = retrieve_and_rerank(pairs, open_, args.depth, 0)
        features[name] = describe(open_, stage, guard, pairs, recalled[name])
        golds[name] = gold_positions(pairs, open_.keys, recalled[name])
        held = np.mean([g >= 0 for g in golds[name]])
        print(f"{name}: {len(pairs)} pairs, gold recalled in {100 * held:.1f} %, "
              f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    if max(golds["valid-train"]) < 0:
        raise SystemExit(f"--train: none of the {args.train} pairs' golds is recalled; give more pairs")
    w = fit(features["valid-train"], golds["valid-train"], args.l2)
    print("weights", dict(zip(FEATURES, np.round(w, 3), strict=True)), flush=True)
    result = provenance() | {"bundle": args.bundle, "depth": args.depth, "l2": args.l2,
                             "train": f"valid[0:{args.train}]", "served_guard": vars(guard),
                             "served_lexical_weight": stage.weight,
                             "weights": dict(zip(FEATURES, w.tolist(), strict=True)), "B": []}  # fmt: skip
    for name in ("valid", "test"):
        pairs, got = sets[name], recalled[name]
        as_served = retrieve_and_rerank(pairs, served, 10, 0)
        learned = [x @ w for x in features[name]]
        blocked = [(x[:, 3] >= guard.last) | (x[:, 4] >= guard.earlier) for x in features[name]]
        guarded = [np.where(b, -np.inf, s) for s, b in zip(learned, blocked, strict=True)]
        lexical = [x[:, 0] * stage.weight + (1 - stage.weight) * x[:, 1] for x in features[name]]
        systems = {  # name: (candidates, fusion, n_r)
            "as served": (as_served, "retrieval", 10),
            "dense, no guard": (got, "retrieval", args.depth),
            "dense + BM25, no guard": (with_scores(got, lexical), "rerank", args.depth),
            "learned, no guard": (with_scores(got, learned), "rerank", args.depth),
            "learned + the served guard": (with_scores(got, guarded), "rerank", args.depth),
        }
        rows = [measure(name_, pairs, open_.keys, *how, judge, open_.texts) for name_, how in systems.items()]
        base = per_case(rows[0]["ranks"], "hits@1")
        gold = [p.response for p in pairs]
        contexts = [p.context for p in pairs]
        people = {"judge": round(judge.rate(contexts, gold), 2), "words": words_rate(contexts, gold)}
        for row in rows:
            mine = per_case(row["ranks"], "hits@1")
            row |= {"split": name, "pairs": len(pairs),
                    "against_served": {"wins": int((mine > base).sum()), "losses": int((mine < base).sum()),
                                       "p": round(paired_bootstrap(mine, base), 4)}}  # fmt: skip
            m = row["metrics"]
            print(f"{name:5} {row['system']:28} hits@1 {m['hits@1']:5.2f} hits@10 {m['hits@10']:5.2f}",
                  row["restates"], row["against_served"], flush=True)  # fmt: skip
        rows[0]["people_restate"] = people
        print(f"{name:5} people restate {people}", flush=True)
        result["B"] += rows
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
