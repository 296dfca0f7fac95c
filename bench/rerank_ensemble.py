"""Do two rerankers answer better than one? A bundle's first stage as served (guard, prior, lexical stage)
recalls 10 candidates per context once; its own reranker and each ``--cross`` checkpoint score those same
pairs as served (int8 ONNX, each pair alone); then every non-empty set of the rerankers is summed with the
first stage's score (the precursor paper's Eq. 10, a shipped reranker's default fusion, with the set's
scores added), and, since the rerankers' scores spread differently, also with every term z-scored in
its list first (equal weights). No weight is fitted, so nothing is chosen on the pairs measured.

Per set: hits@1, and wins, losses and a one-sided paired bootstrap p against the first stage alone and
against the bundle's own reranker summed with it (the single-reranker answer a bundle serves), with the
cases the gold came first in, to pair with other runs; and each score's mean spread within a list (how
much it can move a sum).

    python bench/rerank_ensemble.py --bundle artifacts/default-bundle \\
        --cross docs/lease-DATE/core-warm-cross-r32 --split test --limit 2000 \\
        --out docs/rerank-ensemble-test.json   # a lease's reranker (DATE: its folder) against the shipped

(results.md §43 ran it with the then-candidate bundle and a reranker that has since left the tree.)
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench import add_pairs_args, chosen_pairs, onnx_reranker, provenance  # bench/bench.py: this directory
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_checkpoint
from coreply.checkpoint_meta import CheckpointError
from coreply.inference import export_reranker
from coreply.ranking import zscore
from evaluation.metrics import paired_bootstrap
from evaluation.protocols import Retrieved, ranks_for, rerank, retrieve_and_rerank

N_R = 10
OWN = "the bundle's"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True, help="a bundle with a reranker")
    p.add_argument("--cross", type=Path, nargs="+", required=True, help="reranker checkpoints to add")
    add_pairs_args(p, "test", 0, 2000)
    args = p.parse_args()
    pairs = chosen_pairs(args)
    bot = onnx_reranker(args.bundle)
    backend, ranking = bot.backend, bot.pipeline
    own = load_checkpoint(bot.bundle.model_dir("cross"), "cpu", expect="cross")
    extra = {}
    for path in args.cross:
        try:
            cross = load_checkpoint(path, "cpu", expect="cross")
        except (CheckpointError, FileNotFoundError) as exc:
            raise SystemExit(f"--cross {path}: {exc}") from None
        if cross.config.to_dict() != own.config.to_dict():  # the bundle's tokenizer reads for its own
            raise SystemExit(f"--cross {path}: its model config differs from the bundle's reranker's")
        if path.name in extra:  # rows are named by folder
            raise SystemExit(f"--cross {path}: another --cross has the folder name {path.name!r}; rename one")
        extra[path.name] = cross

    recalled = retrieve_and_rerank(pairs, ranking, N_R, 0)
    print(f"{len(pairs)} contexts recalled", flush=True)
    scores = {OWN: rerank(pairs, recalled, ranking, N_R)}
    print(f"{OWN}: {1000 * scores[OWN].rerank_s / len(pairs):.0f} ms a context", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, cross in extra.items():
            graph = Path(tmp) / f"{name}.onnx"
            export_reranker(cross, graph, "int8", ranking.texts)  # type: ignore[arg-type]  # as a bundle serves it
            backend.cross = backend.cross_session(graph)
            scores[name] = rerank(pairs, recalled, ranking, N_R)
            print(f"{name}: {1000 * scores[name].rerank_s / len(pairs):.0f} ms a context", flush=True)

    def hits_at_1(members: tuple[str, ...], fusion: str = "sum") -> np.ndarray:
        """[N] 1.0 where the gold comes first under ``fusion`` of the first stage's score and the members':
        ``sum`` adds them, ``zscore`` adds their per-list z-scores (every term weighs the same)."""
        lists = []
        for i, c in enumerate(recalled.candidates):
            terms = [c.first_stage[:N_R], *(scores[m].candidates[i].rerank for m in members)]
            final = sum(zscore(t) for t in terms) if fusion == "zscore" else sum(terms)
            lists.append(replace(c, hybrid=final, rerank=None))  # its order is the first stage's now
        got = Retrieved(lists, recalled.retrieve_s, 0.0)
        return (np.array(ranks_for(pairs, ranking.keys, got, "retrieval", N_R)) == 1).astype(float)

    first, single = hits_at_1(()), hits_at_1((OWN,))
    rows: dict[str, dict] = {"first stage": {"hits@1": round(100 * float(first.mean()), 2)}}
    for k, fusion in itertools.product(range(1, len(scores) + 1), ("sum", "zscore")):
        for members in itertools.combinations(scores, k):
            hit = hits_at_1(members, fusion)
            rows[f"{fusion}: {' + '.join(members)}"] = {
                "hits@1": round(100 * float(hit.mean()), 2),
                "wins_losses_vs_first_stage": [int((hit > first).sum()), int((hit < first).sum())],
                "p_beats_first_stage": round(paired_bootstrap(hit, first), 4),
                "wins_losses_vs_own": [int((hit > single).sum()), int((hit < single).sum())],
                "p_beats_own": round(paired_bootstrap(hit, single), 4),
                "top1_cases": np.flatnonzero(hit).tolist(),
            }
    for name, row in rows.items():
        print(name, {k: v for k, v in row.items() if k != "top1_cases"}, flush=True)
    result = provenance() | {
        "bundle": args.bundle,
        "pairs": f"{args.split}[{args.start}:{args.start + len(pairs)}]",
        "n_r": N_R,
        "ms_per_context": {m: round(1000 * s.rerank_s / len(pairs), 1) for m, s in scores.items()},
        # how much each term of a sum can move an order: the mean spread of its scores within a list
        "mean_list_std": {
            name: round(float(np.mean([np.std(c.rerank) for c in s.candidates if len(c.rerank)])), 3)
            for name, s in scores.items()
        }
        | {
            "first stage": round(
                float(np.mean([np.std(c.first_stage[:N_R]) for c in recalled.candidates if len(c.ids)])), 3
            )
        },
        "rows": rows,
    }
    if args.out:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
