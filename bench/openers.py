"""What a bundle's restatement guard does to the replies people gave, by the kind of turn replied to: a
conversation's short first turn (an opener, ``coreply.restatement.is_opener``: "hello", "hey there!"),
any first turn, a short turn later on, and every pair. Per split, the share of people's own replies
the guard would drop (with the bundle's opener thresholds, and without them, as recipe 15 and earlier
guarded every turn alike), and the bundle's top answers to a few openers.

    python bench/openers.py --bundle artifacts/default-bundle --out docs/openers-2026-12-07/guard.json

The thresholds are calibrated on the first 5,000 validation pairs (``coreply.restatement.MAX_PAIRS``):
the test split is the held-out one.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import (  # bench/bench.py: this script's directory is on sys.path
    provenance,
    refuse_below,
    responder,
)
from coreply import restatement
from coreply.artifacts import write_json_atomic
from coreply.corpus import Pair, load_chitchat
from coreply.text import words

PROMPTS = ["hi", "hello", "hey", "hello!", "Hi!", "hi there", "good morning", "how are you?", "bye"]
KINDS = {
    "openers": lambda p: restatement.is_opener(p.context),
    "first turns": lambda p: len(p.context) == 1,
    "short turns later": lambda p: (
        len(p.context) > 1 and len(words(p.context[-1])) <= restatement.OPENER_WORDS
    ),
    "all": lambda p: True,
}


def dropped(guard: restatement.Guard, encode: Any, pairs: list[Pair]) -> dict[str, float]:
    """The share of people's replies in ``pairs`` (%; the first :data:`~coreply.restatement.MAX_PAIRS`)
    that ``guard`` drops, with its opener thresholds and without them."""
    last, earlier, overlap, opener = restatement.human_closeness(encode, pairs)
    common = replace(guard, opener=None)
    return {
        "pairs": len(last),
        "dropped_%": round(100 * float(guard.flags(last, earlier, overlap, opener).mean()), 2),
        "dropped_without_opener_thresholds_%": round(
            100 * float(common.flags(last, earlier, overlap).mean()), 2
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = p.parse_args()
    refuse_below(args)
    bot = responder(args.bundle)
    guard = bot.pipeline.guard
    if guard is None:
        raise SystemExit(f"--bundle {args.bundle}: has no restatement guard")
    splits = load_chitchat()
    result: dict[str, Any] = {**provenance(), "bundle": args.bundle, "guard": str(guard), "splits": {}}
    for split in ("valid", "test"):
        pairs = splits[split][: restatement.MAX_PAIRS] if split == "valid" else splits[split]
        rows = {}
        for kind, chosen in KINDS.items():
            rows[kind] = dropped(guard, bot.backend.encode_responses, [q for q in pairs if chosen(q)])
            print(f"{split} {kind}: {rows[kind]}", flush=True)
        result["splits"][split if split == "test" else "valid[:5000] (calibration)"] = rows
    result["answers"] = {t: [r.text for r in bot.respond([t], 3, 10)] for t in PROMPTS}
    for prompt, answers in result["answers"].items():
        print(f"  {prompt!r}: {answers}")
    if args.out is not None:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
