"""performance.md §45 and results.md §73: the default built on an AMD Zen 5 host, as served on the 11,445
held-out pairs of ``bench/as_served.py``'s spans, with and without passing over the replies that say
nothing (``coreply.text.says_nothing``, ``Pipeline.passed_over``), and beside the recipe 16 reference
build's answers (results.md §72, an Intel host). Ran 2026-12-07 with the commit that added it:

    python docs/zen5-2026-12-07/says_nothing.py
"""

import gzip
import json
import sys

sys.path.insert(0, "bench")
from as_served import top1

from coreply.corpus import load_chitchat
from coreply.responder import Responder
from coreply.text import says_nothing

with gzip.open("docs/openers-2026-12-07/as-served.json.gz") as fh:
    REFERENCE = json.load(fh)["bundles"]["artifacts/default-r16"]["spans"]
SPANS = {"test[0:2000]": ("test", 0, 2000), "test[2000:6823]": ("test", 2000, 6823)}
SPANS["valid[2000:6622]"] = ("valid", 2000, 6622)

bot = Responder.load("artifacts/default-bundle")
splits = load_chitchat()
silent = [i for i, text in enumerate(bot.bundle.texts) if says_nothing(text)]
out: dict = {"bundle_version": bot.bundle.version, "says_nothing": [bot.bundle.texts[i] for i in silent]}
with_rule = bot.pipeline.passed_over


def text(i: int | None) -> str | None:
    return None if i is None else bot.bundle.texts[i]


for name, (split, start, stop) in SPANS.items():
    pairs = splits[split][start:stop]
    rows = {}
    for form, passed_over in (("passed over", with_rule), ("answered", frozenset())):
        bot.pipeline.passed_over = passed_over
        answers, hit = top1(bot, pairs, None)
        rows[form] = {"hits@1": round(100 * float(hit.mean()), 2), "answers": answers}
    reference = REFERENCE[name]["answers"]
    mine, theirs = rows["answered"]["answers"], rows["passed over"]["answers"]
    changed = [j for j, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b]
    out[name] = {
        "hits@1": {form: row["hits@1"] for form, row in rows.items()},
        "reference hits@1": REFERENCE[name]["hits@1"],
        "answered as the reference (rule off)": sum(a == b for a, b in zip(mine, reference, strict=True)),
        "pairs": len(pairs),
        "changed by the rule": [
            {"context": pairs[j].context, "was": text(mine[j]), "now": text(theirs[j])} for j in changed
        ],
        "answers": theirs,
    }
    print(name, {k: v for k, v in out[name].items() if k != "answers"}, flush=True)
with gzip.open("docs/zen5-2026-12-07/says-nothing.json.gz", "wt") as fh:
    json.dump(out, fh)
