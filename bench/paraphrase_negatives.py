"""What the "paraphrase of the last turn" negatives are (``coreply train --paraphrase-negatives``), and
which candidate of such a training list each model puts first.

Builds training lists exactly as ``coreply train`` does (``Trainer.first_lists``: the gold, then
``--paraphrase-negatives`` (c) drawn from the mining retriever's 2c + 1 nearest responses to the last
turn in a ``--hard-pool`` sample (with ``--paraphrase-floor F`` only those at cosine F or more), then
random ones) and reports:

- the restatement judge's cosine (zero-shot all-MiniLM-L6-v2 between the candidate and the last turn,
  evaluation/restatement.py; >= 0.8 is a restatement) of the mined negatives and of the golds;
- how many responses of the mining pool reach the judge's threshold per context (copies of the
  context's turns left out: the miner never offers them);
- the share of lists whose first place is the gold, a mined negative or a random one, and the lists'
  cross-entropy, for the retriever, the reranker (``--cross``) and their sum, which is what a residual
  reranker (``--cross-residual``) trains on.

    python bench/paraphrase_negatives.py --bi coreply/weights/default-bi \\
        --cross coreply/weights/default-cross --batches 40 --out paraphrase-negatives.json   # ~11 min here
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from bench import refuse_below  # bench/bench.py: this script's directory is on sys.path
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_bi
from coreply.config import ZERO_SHOT, ModelConfig
from coreply.corpus import build_pool, load_chitchat
from coreply.text import normalize
from evaluation.restatement import THRESHOLD, RestatementJudge
from training.config import TrainConfig
from training.losses import listwise_ce
from training.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bi", required=True, help="the retriever that mines the negatives (and ranks)")
    ap.add_argument("--cross", help="a reranker to rank the lists too, alone and summed with --bi")
    ap.add_argument("--batches", type=int, default=40, help="training batches of 8 contexts")
    ap.add_argument("--paraphrase-negatives", type=int, default=4)
    ap.add_argument("--num-negatives", type=int, default=15)
    ap.add_argument("--hard-pool", type=int, default=20000)
    ap.add_argument("--paraphrase-floor", type=float, default=0.0, help="coreply train's, [0, 1)")
    ap.add_argument("--out", type=Path, help="write the numbers here as JSON")
    args = ap.parse_args()
    refuse_below(args, hard_pool=1, batches=1, paraphrase_negatives=1)
    if args.paraphrase_negatives > args.num_negatives:
        raise SystemExit(
            f"--paraphrase-negatives: at most --num-negatives ({args.num_negatives}), "
            f"got {args.paraphrase_negatives}"
        )

    with tempfile.TemporaryDirectory() as out:
        try:  # a missing or unfit checkpoint, or a nonsense size, is the user's to fix: one line
            cfg = TrainConfig(
                output_dir=out,
                mode="independent",
                models="cross",
                init_bi=args.bi,
                init_cross=args.cross,
                cross_residual=True,  # loads --bi frozen, as the residual run does
                cross_lora_rank=0,
                model=ModelConfig(num_layers=1),  # a stand-in when no --cross is given; never trained
                batch_size=8,
                num_negatives=args.num_negatives,
                paraphrase_negatives=args.paraphrase_negatives,
                paraphrase_floor=args.paraphrase_floor,
                hard_pool=args.hard_pool,
                device="cpu",
            )
            splits = load_chitchat(max_turns=cfg.model.max_turns)
            trainer = Trainer(cfg, splits["train"], [], build_pool(p.response for p in splits["train"]))
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"paraphrase_negatives.py: {e}") from None

        models = ("bi", "cross", "sum") if args.cross else ("bi",)
        firsts = {m: {k: 0 for k in ("gold", "mined", "random")} for m in models}
        ce = dict.fromkeys(models, 0.0)
        contexts, negatives, golds = [], [], []
        for pairs, lists in trainer.first_lists(args.batches):
            kinds = []  # per list: "gold", then each negative's kind
            for pair, cands in zip(pairs, lists, strict=True):
                near = set(trainer.miner.neighbours(pair, "last_turn", args.paraphrase_negatives))
                kinds.append(["gold"] + ["mined" if c in near else "random" for c in cands[1:]])
                contexts.append(pair.context)
                golds.append(pair.response)
                negatives.append([c for c, kind in zip(cands, kinds[-1], strict=True) if kind == "mined"])
            scores = trainer.list_scores(pairs, lists)  # each [B, N]
            if args.cross:
                scores["sum"] = scores["bi"] + scores["cross"]
            else:
                del scores["cross"]  # the stand-in's
            for name, S in scores.items():
                ce[name] += listwise_ce(S).item() * len(pairs)
                for kind, j in zip(kinds, S.argmax(1).tolist(), strict=True):
                    firsts[name][kind[j]] += 1

        judge = RestatementJudge(load_bi(ZERO_SHOT))  # coreply eval's judge
        flat = [n for ns in negatives for n in ns]
        neg = judge.similarity([c for c, ns in zip(contexts, negatives, strict=True) for _ in ns], flat)
        gold = judge.similarity(contexts, golds)
        pool = judge.embed(list(trainer.miner.pool))  # [P, D]
        close = judge.embed([c[-1] for c in contexts]) @ pool.T >= THRESHOLD  # [contexts, P]
        row = {key: j for j, key in enumerate(trainer.miner.keys)}
        for i, context in enumerate(contexts):  # a copy of a context turn is an echo, never mined
            close[i, [row[k] for k in map(normalize, context) if k in row]] = False
        above = close.sum(1)  # [contexts]

    n = len(contexts)

    def shares(sims: np.ndarray) -> dict[str, float]:
        if sims.size == 0:  # a floor no neighbour reached
            return {}
        return {f">={t}": round(100 * float(np.mean(sims >= t)), 1) for t in (THRESHOLD, 0.7, 0.6)} | {
            "median": round(float(np.median(sims)), 3)
        }

    result = {
        "contexts": n,
        "mined negatives per list": {
            "mean": round(float(np.mean([len(ns) for ns in negatives])), 2),
            "share with none": round(100 * float(np.mean([not ns for ns in negatives])), 1),
        },
        "judge_cosine_with_last_turn": {"mined negatives": shares(neg), "golds": shares(gold)},
        f"pool responses at >= {THRESHOLD} per context, copies of its turns left out": {
            "pool": len(pool),
            "median": float(np.median(above)),
            "share with none": round(100 * float(np.mean(above == 0)), 1),
            "share with >= 4": round(100 * float(np.mean(above >= 4)), 1),
        },
        "first place, % of lists": {
            m: {k: round(100 * v / n, 1) for k, v in f.items()} for m, f in firsts.items()
        },
        "list cross-entropy": {m: round(v / n, 3) for m, v in ce.items()},
        "command": vars(args),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        write_json_atomic(Path(args.out), result, sort_keys=False)


if __name__ == "__main__":
    main()
