"""Does an answer depend on the requests it is batched with? A bundle's backend encodes the first
``--contexts`` chitchat test contexts one at a time and in batches of ``--batch`` (as the service's
micro-batcher would group concurrent requests), and its pipeline recalls each context's top 10 both
ways: the cosine between the two vectors of each context, and how many contexts change their top answer
or their top-10 set.

    python bench/batch_effect.py --bundle artifacts/default-bundle
"""

from __future__ import annotations

import argparse

import numpy as np

from bench import responder  # bench/bench.py: this script's directory is on sys.path
from coreply.corpus import load_chitchat
from coreply.ranking import Query
from coreply.vectors import unit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle")
    p.add_argument("--contexts", type=int, default=64, help="test contexts, the first N")
    p.add_argument("--batch", type=int, default=64, help="contexts per batch")
    p.add_argument("--threads", type=int, default=2, help="the backend's threads")
    args = p.parse_args()
    if min(args.contexts, args.batch, args.threads) < 1:
        raise SystemExit("--contexts, --batch and --threads must be >= 1")
    bot = responder(args.bundle, threads=args.threads)
    contexts = [p.context for p in load_chitchat()["test"][: args.contexts]]
    chunks = [contexts[s : s + args.batch] for s in range(0, len(contexts), args.batch)]
    encode = bot.backend.encode_contexts
    batched = np.concatenate([encode(chunk) for chunk in chunks])  # [N, D]
    alone = np.concatenate([encode([c]) for c in contexts])  # [N, D]
    cosine = (unit(batched) * unit(alone)).sum(axis=1)  # [N]

    def top10(group: list) -> list[list[int]]:
        found = bot.pipeline.recall([Query(tuple(c)) for c in group], [10] * len(group))
        return [c.ids.tolist() for c in found]

    together = [ids for chunk in chunks for ids in top10(chunk)]
    apart = [ids for c in contexts for ids in top10([c])]
    first = sum(a[:1] != b[:1] for a, b in zip(together, apart, strict=True))
    sets = sum(set(a) != set(b) for a, b in zip(together, apart, strict=True))
    difference = np.abs(batched - alone).max()
    print(f"{bot.backend.name}, {args.threads} threads, {len(contexts)} contexts alone vs in batches of "
          f"{args.batch}: cosine min {cosine.min():.4f} mean {cosine.mean():.4f}; max |difference| "
          f"{difference:.2e}; top answer changed for {first}, top-10 set for {sets}")  # fmt: skip


if __name__ == "__main__":
    main()
