"""How much reranking can a bundle's rerank gate skip, and what does it cost? A gate lets a request that
names no fusion skip the reranker where the first stage's best candidate leads its second by at least
the gate (``coreply.gate.confident``); a bundle's gate is chosen on its calibration pairs as the
smallest lead that changes at most a share (the *fidelity*) of their top answers against always
reranking (``evaluation.protocols.choose_gate``). Where it reranks, a bundle's reach lets the reranker
read only the candidates within a first-stage margin of the best (``evaluation.protocols.choose_reach``:
chosen to change at most a further share of those answers); each ``--reach-fidelity`` is chosen behind
the bundle's own gate and scored the same way.

The bundle's first stage as served (guard, prior, lexical stage) recalls 10 candidates per context of
each span once and its reranker (as served: int8 ONNX unless ``--backend`` says otherwise) scores them
all; a gate is then chosen on the ``--calibrate`` span at each ``--fidelity``, and on every
``--measure`` span each gate, the bundle's own, none (always rerank) and the first stage alone are
scored: hits@1, the share of contexts the gate skips, the candidates the reranker reads a context,
the share of top answers that differ from always reranking, and one-sided paired bootstrap p-values
that the gated answer beats the first stage's and that always reranking beats the gated answer; with
several ``--measure`` spans, the same over all of them pooled (a gain too small to show on one span
may show on all: docs/results.md §48). With several ``--n-r``, all of it at each: the candidates are
recalled and reranked once, at the largest, and a smaller n_r reorders only the first n_r of them, as
serving it would (its gates chosen at that n_r). With ``--exclude-conversation`` each measured context
excludes the other lines of its own conversation, as a request would over a pool that does not hold the
conversation being served (docs/results.md §60).

    python bench/rerank_gate.py --bundle artifacts/cand-r11-hard-gate --out docs/rerank-gate-r11-hard.json
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np

from bench import (  # bench/bench.py: this script's directory is on sys.path
    disjoint_spans,
    paired_hits,
    provenance,
    refuse_below,
    responder,
    span,
    span_name,
    span_pairs,
)
from coreply.artifacts import write_json_atomic
from coreply.bundle import BACKENDS
from coreply.corpus import load_chitchat
from coreply.gate import confident
from coreply.text import normalize
from evaluation.metrics import paired_bootstrap
from evaluation.protocols import (
    Retrieved,
    choose_gate,
    choose_reach,
    conversation_others,
    ranked_ids,
    reranked_per_context,
    retrieve_and_rerank,
)


def top1(
    got: Retrieved,
    golds: Sequence[str],
    keys: Sequence[str],
    n_r: int,
    weight: float,
    fusion: str,
    gate: float | None,
    reach: float | None = None,
) -> tuple[list[int | None], np.ndarray]:
    """Each context's top answer under ``fusion`` of its first ``n_r`` (gated past ``gate``, within
    ``reach``; a pool id, or None) and whether it is the gold (``golds``: normalised; ``keys``: the
    pool's), [N] of 0/1."""
    ranked = ranked_ids(got, fusion, n_r, weight, gate, reach)
    answers = [int(ids[0]) if len(ids) else None for ids in ranked]
    hit = [a is not None and keys[a] == g for a, g in zip(answers, golds, strict=True)]
    return answers, np.array(hit, dtype=float)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True, help="a bundle with a reranker")
    p.add_argument("--backend", default="auto", help=f"as served: {', '.join(BACKENDS)}")
    p.add_argument("--calibrate", default="valid:0:2000", help="split:start:limit the gates are chosen on")
    p.add_argument(
        "--measure",
        nargs="+",
        default=["test:0:2000", "test:2000:4823", "valid:2000:4622"],
        help="split:start:limit, disjoint; with more than one, also pooled (default: every pair no choice "
        "was made on, the first 2,000 test pairs apart as the issue states its targets there)",
    )
    p.add_argument("--fidelity", type=float, nargs="+", default=[0.01, 0.02, 0.05, 0.1, 0.2])
    p.add_argument(
        "--reach-fidelity",
        type=float,
        nargs="+",
        default=[0.01, 0.02, 0.05],
        help="reaches chosen behind the bundle's own gate, each changing at most this share more answers",
    )
    p.add_argument("--n-r", type=int, nargs="+", default=[10], help="candidates reranked, one or several")
    p.add_argument(
        "--exclude-conversation",
        action="store_true",
        help="each --measure context excludes the other lines of its conversation, as a served pool would "
        "be that does not hold the conversation being served (the --calibrate span as a bundle is built)",
    )
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = p.parse_args()
    args.calibrate = span("--calibrate", args.calibrate)
    args.measure = disjoint_spans("--measure", args.measure, (args.calibrate,), "--calibrate")
    for flag, shares in (("--fidelity", args.fidelity), ("--reach-fidelity", args.reach_fidelity)):
        if bad := [f for f in shares if not 0 <= f < 1]:
            raise SystemExit(f"{flag}: each in [0, 1), got {bad}")
    if bad := [n for n in args.n_r if n < 1]:
        raise SystemExit(f"--n-r: each at least 1, got {bad}")
    if args.backend not in BACKENDS:
        raise SystemExit(f"--backend: one of {', '.join(BACKENDS)}, got {args.backend!r}")
    refuse_below(args)
    bot = responder(args.bundle, backend=args.backend)
    ranking, fusion, weight = bot.pipeline, bot.default_fusion, bot.pipeline.weight
    if ranking.reranker is None:
        raise SystemExit(f"--bundle {args.bundle}: has no reranker, so nothing to gate")

    splits = load_chitchat()
    spans = [args.calibrate, *args.measure]
    chosen = [span_pairs("--calibrate" if s is args.calibrate else "--measure", splits, s) for s in spans]
    got, golds = {}, {}
    for given, pairs in zip(spans, chosen, strict=True):
        name = span_name(*given)
        golds[name] = [normalize(p.response) for p in pairs]
        apart = args.exclude_conversation and given != args.calibrate
        exclude = conversation_others(pairs, splits[given[0]]) if apart else None
        got[name] = retrieve_and_rerank(pairs, ranking, max(args.n_r), max(args.n_r), exclude)
        print(f"{name}: {len(pairs)} contexts recalled and reranked", flush=True)
    calibration = span_name(*args.calibrate)
    measured = [span_name(*m) for m in args.measure]

    def at(n_r: int) -> dict:
        """Gates and reaches chosen at ``n_r`` on the calibration span, each scored on every span and
        pooled."""
        own = ranking.gate
        gates: dict[str, tuple[float | None, float | None]] = {  # label -> (gate, reach)
            "always rerank": (None, None),
            "the bundle's own": (own, None),
            "the bundle's own, with its reach": (own, ranking.reach),
        }
        gates |= {
            f"fidelity {f:g}": (choose_gate(got[calibration], fusion, n_r, weight, f), None)
            for f in args.fidelity
        }
        reaches = {
            f: choose_reach(got[calibration], fusion, n_r, weight, own, f) for f in args.reach_fidelity
        }
        gates |= {f"the bundle's own, reach {f:g}": (own, reach) for f, reach in reaches.items()}
        out: dict = {"gates": gates, "spans": {}}
        hits: dict[str, dict[str, np.ndarray]] = {}  # span -> setting -> per-pair hits@1 [N]
        for name, retrieved in got.items():
            answer = partial(top1, retrieved, golds[name], ranking.keys, n_r, weight)  # (fusion, gate, reach)
            (_, first), (answers, full) = answer("retrieval", None), answer(fusion, None)
            rows: dict = {"first stage": {"hits@1": round(100 * float(first.mean()), 2)}}
            hits[name] = {"first stage": first}
            for label, (gate, reach) in gates.items():
                gated_answers, hit = answer(fusion, gate, reach)
                hits[name][label] = hit
                rows[label] = {
                    "gate": gate,
                    "reach": reach,
                    "skipped_%": round(
                        100 * float(np.mean([confident(c, gate) for c in retrieved.candidates])), 2
                    ),
                    "reranked_per_context": round(
                        reranked_per_context(retrieved, fusion, n_r, gate, reach), 2
                    ),
                    "changed_%": round(
                        100 * float(np.mean([a != b for a, b in zip(gated_answers, answers, strict=True)])), 2
                    ),
                    **paired_hits(hit, first, "p_beats_first_stage"),
                    "p_always_better": round(paired_bootstrap(full, hit), 4),
                }
            out["spans"][name] = rows
            print(
                f"n_r {n_r}",
                name,
                {k: (v["hits@1"], v.get("skipped_%")) for k, v in rows.items()},
                flush=True,
            )
        if len(measured) > 1:
            pooled = {
                label: np.concatenate([hits[n][label] for n in measured]) for label in hits[measured[0]]
            }
            first = pooled.pop("first stage")
            out["pooled"] = {
                "spans": measured,
                "pairs": len(first),
                "first stage": round(100 * float(first.mean()), 2),
            }
            out["pooled"] |= {
                label: paired_hits(hit, first, "p_beats_first_stage") for label, hit in pooled.items()
            }
            print(
                f"n_r {n_r} pooled", {k: v["hits@1"] for k, v in out["pooled"].items() if isinstance(v, dict)}
            )
        return out

    result: dict = provenance() | {"bundle": args.bundle, "fusion": fusion, "calibrated_on": calibration}
    result["exclude_conversation"] = args.exclude_conversation
    result["n_r"] = {str(n): at(n) for n in sorted(set(args.n_r), reverse=True)}
    if args.out:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
