"""results.md §74: does a served request's answer depend on the requests it is batched with? Each of
the first 1,000 test contexts answered by the default as ``Responder.respond`` answers it alone, then
with every recall batched beside a companion request that carries ``--exclusions`` exclude texts (the
service's micro-batcher recalls a batch in one ``Pipeline.recall``, whose search depth is the batch's
deepest). Ran 2026-12-07 on the Zen 5 build of §73:

    python docs/zen5-2026-12-07/batch_mates.py --exclusions 3
    python docs/zen5-2026-12-07/batch_mates.py --exclusions 20
"""

import argparse

from coreply.corpus import load_chitchat
from coreply.ranking import Query
from coreply.responder import Responder

p = argparse.ArgumentParser()
p.add_argument("--exclusions", type=int, required=True)
p.add_argument("--contexts", type=int, default=1000)
args = p.parse_args()

bot = Responder.load("artifacts/default-bundle")
pairs = load_chitchat()["test"][: args.contexts]
companion = Query(("tell me about your day",), exclude_texts=tuple(f"zz{i}" for i in range(args.exclusions)))
alone_recall = bot.pipeline.recall


def recall_beside_companion(queries, n):
    return alone_recall([*queries, companion], [*n, 10])[: len(queries)]


def run() -> tuple[list[list[int]], list[int]]:
    """Each context's ten candidates after recall, and its top answer as served."""
    candidates = [bot.pipeline.recall([Query(tuple(p.context))], [10])[0].ids.tolist() for p in pairs]
    return candidates, [bot.respond(list(p.context), 1, 10)[0].id for p in pairs]


alone = run()
bot.pipeline.recall = recall_beside_companion
batched = run()
lists = sum(a != b for a, b in zip(alone[0], batched[0], strict=True))
firsts = sum(a[0] != b[0] for a, b in zip(alone[0], batched[0], strict=True))
answers = sum(a != b for a, b in zip(alone[1], batched[1], strict=True))
print(
    f"{len(pairs)} contexts beside a companion with {args.exclusions} exclusions: the ten candidates differ "
    f"for {lists}, the first stage's first for {firsts}, the top answer as served for {answers}"
)
