"""results.md §72: the two forms of an opener's own guard thresholds, compared on every opener of the
three spans (every other context is answered as recipe 15 answers it: its answers are read from the
first form's as_served run). Ran 2026-12-07 against the code of commit 5eed803, where ``Guard.opener``
was a (last-turn, words) pair and artifacts/default-r16 the first form's bundle:

    python docs/openers-2026-12-07/variants.py
"""

import gzip
import json

import numpy as np

from coreply.checkpoint import load_bi
from coreply.config import ZERO_SHOT
from coreply.corpus import load_chitchat
from coreply.responder import Responder
from coreply.restatement import Guard, is_opener
from coreply.text import normalize
from evaluation.restatement import RestatementJudge, words_rate

with gzip.open("docs/openers-2026-12-07/as-served-both-thresholds.json.gz") as fh:
    RUN = json.load(fh)
SPANS = {"valid[2000:6622]": ("valid", 2000), "test[2000:6823]": ("test", 2000), "test[0:2000]": ("test", 0)}

bot = Responder.load("artifacts/default-r16")
g = bot.pipeline.guard
forms = {"A (cosine+words)": g, "B (cosine only)": Guard(g.last, g.earlier, g.words, (g.opener[0], g.words))}
judge = RestatementJudge(load_bi(ZERO_SHOT))
splits = load_chitchat()
texts = bot.bundle.texts
for span, (split, lo) in SPANS.items():
    base = RUN["bundles"]["artifacts/default-bundle"]["spans"][span]["answers"]
    pairs = splits[split][lo : lo + len(base)]
    contexts = [p.context for p in pairs]
    for name, guard in forms.items():
        bot.pipeline.guard = guard
        answer = lambda p: bot.respond(p.context, 1, 10)[0].id  # noqa: E731
        ids = [answer(p) if is_opener(p.context) else a for a, p in zip(base, pairs, strict=True)]
        hits = 100 * np.mean(
            [normalize(texts[a]) == normalize(p.response) for a, p in zip(ids, pairs, strict=True)]
        )
        answers = [texts[a] for a in ids]
        rates = f"judge {judge.rate(contexts, answers):.2f} words {words_rate(contexts, answers)}"
        print(span, name, f"hits@1 {hits:.2f}", rates, flush=True)
