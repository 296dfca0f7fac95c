"""Spelling variants in a bundle's answer lists: how often its best ``--top-k`` answers to chitchat
contexts held a variant of a better answer ("heyy" after "Hey!", ``coreply.text.variant_key``) when
variants were allowed, and what a request gets now that they are passed over by default: the lists
that changed, how many answers were replaced from further down, and the lists left short (the
``--n-candidates`` held fewer distinct answers). The first answer never changes.

    python bench/variants.py --bundle artifacts/default-bundle --split test --limit 2000 \\
        --out docs/variants-default.json
    python bench/variants.py --max-turns 1 ...   # conversation openers only
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import (  # bench/bench.py: this script's directory is on sys.path
    provenance,
    refuse_below,
    responder,
)
from coreply.artifacts import write_json_atomic
from coreply.corpus import load_chitchat
from coreply.text import variant_key


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle")
    p.add_argument("--split", default="test", choices=["valid", "test"])
    p.add_argument("--limit", type=int, default=2000, help="the split's first N contexts")
    p.add_argument("--max-turns", type=int, default=None, help="only contexts of at most N turns (1: first)")
    p.add_argument("--top-k", type=int, default=5, help="answers a request asks for")
    p.add_argument("--n-candidates", type=int, default=10, help="candidates a request ranks")
    p.add_argument("--examples", type=int, default=5, help="lists with variants to print and keep")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = p.parse_args()
    turns = {} if args.max_turns is None else {"max_turns": 1}
    refuse_below(args, limit=1, top_k=2, n_candidates=args.top_k, examples=0, **turns)
    bot = responder(args.bundle)
    most = args.max_turns or float("inf")
    contexts = [p.context for p in load_chitchat()[args.split] if len(p.context) <= most][: args.limit]
    changed = replaced = short = 0
    examples = []
    start = time.perf_counter()
    for context in contexts:
        allowed = [r.text for r in bot.respond(context, args.top_k, args.n_candidates, allow_variants=True)]
        served = [r.text for r in bot.respond(context, args.top_k, args.n_candidates)]
        assert served[:1] == allowed[:1], context
        keys = [variant_key(t) for t in allowed]
        variants = sum(key in keys[:i] for i, key in enumerate(keys))
        if variants:
            changed += 1
            replaced += variants
            short += len(served) < args.top_k
            if len(examples) < args.examples:
                examples.append({"context": list(context), "allowed": allowed, "served": served})
    seconds = time.perf_counter() - start
    n = len(contexts)
    result = {
        **provenance(),
        "bundle": args.bundle,
        "split": args.split,
        "max_turns": args.max_turns,
        "contexts": n,
        "top_k": args.top_k,
        "n_candidates": args.n_candidates,
        "lists_with_variants_pct": round(100 * changed / n, 2),
        "variants_replaced": replaced,
        "lists_left_short": short,
        "seconds": round(seconds, 1),
        "examples": examples,
    }
    print(
        f"{changed} of {n} top-{args.top_k} lists ({result['lists_with_variants_pct']} %) held a spelling "
        f"variant of a better answer: {replaced} answers replaced, {short} lists left short ({seconds:.0f} s)"
    )
    for example in examples:
        print(f"  {example['context'][-1]!r}: {example['allowed']} -> {example['served']}")
    if args.out is not None:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
