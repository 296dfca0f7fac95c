import gzip, json, sys
import numpy as np
from coreply.responder import Responder
from coreply.corpus import load_chitchat
from coreply.restatement import is_opener, Guard
from coreply.checkpoint import load_bi
from coreply.config import ZERO_SHOT
from coreply.text import normalize
from evaluation.restatement import RestatementJudge, words_rate
d = json.load(gzip.open('docs/openers-2026-12-07/as-served.json.gz'))
bot = Responder.load("artifacts/default-r16")
g = bot.pipeline.guard
variants = {"A (cosine+words)": g, "B (cosine only)": Guard(g.last, g.earlier, g.words, (g.opener[0], g.words))}
judge = RestatementJudge(load_bi(ZERO_SHOT))
sp = load_chitchat()
texts = bot.bundle.texts
for span, (split, lo) in {"valid[2000:6622]": ("valid", 2000), "test[2000:6823]": ("test", 2000), "test[0:2000]": ("test", 0)}.items():
    base = d['bundles']['artifacts/default-bundle']['spans'][span]['answers']
    pairs = sp[split][lo:lo + len(base)]
    ctx = [p.context for p in pairs]
    for name, guard in variants.items():
        bot.pipeline.guard = guard
        ans = list(base)
        for i, p in enumerate(pairs):
            if is_opener(p.context):
                ans[i] = bot.respond(p.context, 1, 10)[0].id
        hits = np.mean([normalize(texts[a]) == normalize(p.response) for a, p in zip(ans, pairs)]) * 100
        at = [texts[a] for a in ans]
        print(span, name, f"hits@1 {hits:.2f}", "judge", round(judge.rate(ctx, at), 2), "words", words_rate(ctx, at), flush=True)
