"""Does a reranker take the user's own words for a reply? Each ``--cross`` checkpoint (PyTorch, fp32) scores,
per chitchat pair, the reply people gave and the context's own last two turns (the user's last turn and
the one before it, each where it differs from the reply): the share of pairs where an own turn scores
above the reply, per turn and either, and the mean margin (reply minus last turn). A reranker trained
without restatements among its negatives prefers the last turn to the reply in most pairs (results.md
§49: 94 % for the shipped one); the restatement guard keeps such candidates out of the default's lists,
a near-restatement it lets through is what such a reranker would lift.

With several checkpoints, each after the first is paired with it: the pairs where it ranks the reply
above the last turn and the first does not (wins), the reverse (losses), and a one-sided paired
bootstrap p that it prefers the reply no more often.

    python bench/own_turns.py --cross coreply/weights/default-cross runs/NEW/cross --split test \\
        --limit 2000 --out docs/own-turns-test.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from bench import add_pairs_args, chosen_pairs, provenance  # bench/bench.py: this directory
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_checkpoint
from coreply.checkpoint_meta import CheckpointError
from coreply.models import CrossEncoder
from coreply.text import normalize
from evaluation.metrics import paired_bootstrap


def own_turn_scores(cross: CrossEncoder, pairs: list) -> dict[str, np.ndarray]:
    """Scores [N] of each pair's reply and of its context's last and second-last turns (NaN where the
    context has no such turn or it equals the reply)."""
    contexts = [list(p.context) for p in pairs]
    out = {"reply": cross.score_pairs(contexts, [p.response for p in pairs]).numpy()}
    for name, back in (("last", 1), ("before last", 2)):
        keep = [
            i
            for i, p in enumerate(pairs)
            if len(p.context) >= back and normalize(p.context[-back]) != normalize(p.response)
        ]
        scores = np.full(len(pairs), np.nan, dtype=np.float32)
        if keep:
            turns = [pairs[i].context[-back] for i in keep]
            scores[keep] = cross.score_pairs([contexts[i] for i in keep], turns).numpy()
        out[name] = scores
    return out


def summary(scores: dict[str, np.ndarray]) -> dict[str, float | int]:
    """Shares (%) of pairs where an own turn outscores the reply: each turn's over the pairs that have it,
    either's over all pairs."""
    reply = scores["reply"]
    row: dict[str, float | int] = {}
    above = []
    for name in ("last", "before last"):
        has = ~np.isnan(scores[name])
        beats = np.where(has, scores[name] > reply, False)
        above.append(beats)
        row[f"{name} above reply %"] = round(100 * float(beats[has].mean()), 2) if has.any() else float("nan")
        row[f"pairs with a {name} turn"] = int(has.sum())
    row["either above reply %"] = round(100 * float((above[0] | above[1]).mean()), 2)
    has = ~np.isnan(scores["last"])
    row["mean margin, reply - last"] = round(float((reply - scores["last"])[has].mean()), 3)
    row["pairs"] = len(reply)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cross", type=Path, nargs="+", required=True, help="rerankers; the first is the reference"
    )
    add_pairs_args(p, "test", 0, 2000)
    args = p.parse_args()
    if len(set(args.cross)) < len(args.cross):
        raise SystemExit("--cross: a checkpoint is named twice; name each once")
    pairs = chosen_pairs(args)
    torch.set_grad_enabled(False)
    rows, prefers = {}, {}
    for path in args.cross:
        try:
            cross = load_checkpoint(path, "cpu", expect="cross").eval()
        except (CheckpointError, FileNotFoundError, ValueError) as exc:
            raise SystemExit(f"--cross {path}: {exc}") from None
        scores = own_turn_scores(cross, pairs)
        has = ~np.isnan(scores["last"])
        prefers[str(path)] = np.where(has, scores["reply"] > scores["last"], True).astype(float)
        rows[str(path)] = summary(scores)
        print(path, rows[str(path)], flush=True)
    first, *others = prefers
    for name in others:
        a, b = prefers[name], prefers[first]
        rows[name]["vs first: wins, losses"] = [int((a > b).sum()), int((a < b).sum())]
        rows[name]["vs first: p prefers the reply no more often"] = round(paired_bootstrap(a, b), 4)
        print(name, "against", first, rows[name]["vs first: wins, losses"], flush=True)
    if args.out:
        span = f"{args.split}[{args.start}:{args.start + len(pairs)}]"
        write_json_atomic(args.out, {"pairs": span, "rows": rows, **provenance()})


if __name__ == "__main__":
    main()
