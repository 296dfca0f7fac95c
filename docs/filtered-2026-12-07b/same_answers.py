"""Performance §41's check: a filtered search in two passes (the low-precision pass masked) gives the
answers one masked float32 pass gives, on the default bundle with bench/filtered.py's fields, filters and
contexts. Run from the repository root: python docs/filtered-2026-12-07b/same_answers.py"""

import sys
from dataclasses import replace

sys.path.insert(0, "bench")
from filtered import FILTERS

from coreply import Responder
from coreply.bundle import TorchExactIndex
from coreply.corpus import load_chitchat

bot = Responder.load("artifacts/default-bundle", threads=2)
metadata = [{"shard": i % 1000, "tenth": i % 10, "half": i % 2} for i in range(len(bot.bundle.texts))]
bot.bundle = replace(bot.bundle, metadata=metadata)
two_pass = bot.pipeline.retrieve.index
one_pass = TorchExactIndex(two_pass.vectors, passes=())
pairs = load_chitchat()["test"][:300]
differ, scored, answers = 0, 0.0, 0
for where in FILTERS:
    for pair in pairs:
        got = []
        for index in (two_pass, one_pass):
            bot.pipeline.retrieve.index = index
            got.append(bot.respond(pair.context, top_k=10, filter=where))
        a, b = got
        answers += len(a)
        differ += [r.id for r in a] != [r.id for r in b]
        scored = max([scored] + [abs(x.score - y.score) for x, y in zip(a, b, strict=True)])
print(
    f"{len(FILTERS) * len(pairs)} filtered requests, {answers} answers: {differ} differ in ids or order; "
    f"largest score difference {scored:.2g}; first passes searched again: {two_pass._passes[0].again} "
    f"of {two_pass._passes[0].queries}, {two_pass._passes[-1].again} of {two_pass._passes[-1].queries}"
)
