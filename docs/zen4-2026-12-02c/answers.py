"""What the default answers on test[:2000], beside what people said (results.md §59; a scratch script
kept with its output, not a benchmark of the repo).

    COREPLY_MAX_EXCLUDE=1000 coreply serve --port 8011 &   # the default; a conversation holds up to 207 lines
    python docs/zen4-2026-12-02c/answers.py --url http://127.0.0.1:8011 \
        --out docs/zen4-2026-12-02c/answers.json

Each context is posted once (top_k 1, the bundle's own fusion); the top answer is then placed: the test
reply itself, a later line of the same conversation, an earlier line of it that the 5-turn context no
longer holds, a context turn, or elsewhere in the pool. Each context is posted a second time with every
other line of its conversation in ``exclude``, as a pool would be that does not hold the conversation
being served: hits@1 then. Beside that: length, sharing a content word (bm25s's English stopwords out,
3+ letters) with the last turn, and how often one answer repeats (and whether within one conversation's
span of consecutive pairs).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import httpx
from bm25s.stopwords import STOPWORDS_EN

from coreply.corpus import load_chitchat
from coreply.text import normalize

STOP = set(STOPWORDS_EN)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def content(text: str) -> set[str]:
    return {w for w in words(text) if w not in STOP and len(w) > 2}


def shares(answer: str, turn: str) -> bool:
    return bool(content(answer) & content(turn))


def first_answer(client: httpx.Client, url: str, body: dict) -> dict:
    """The first answer to ``body``; a refused request stops the run with the server's message."""
    answer = client.post(f"{url}/respond", json=body).json()
    if "responses" not in answer:
        raise SystemExit(f"{url}/respond refused {str(body)[:80]}...: {answer.get('error', answer)}")
    return answer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--limit", type=int, default=2000)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    test = load_chitchat()["test"]
    pairs = test[: args.limit]
    lines: dict[str, list[str]] = defaultdict(list)  # a conversation's lines in order
    for pair in test:
        if not lines[pair.conversation_id]:
            lines[pair.conversation_id].extend(pair.context)
        lines[pair.conversation_id].append(pair.response)
    tops, gated, alone = [], [], []  # alone: the top answer with the conversation's other lines excluded
    with httpx.Client(timeout=30) as client:
        for pair in pairs:
            body = {"context": list(pair.context), "top_k": 1}
            answer = first_answer(client, args.url, body)
            tops.append(answer["responses"][0]["text"])
            gated.append(answer["rerank_gated"])
            gold = normalize(pair.response)
            others = sorted({x for x in lines[pair.conversation_id] if normalize(x) != gold})
            alone.append(first_answer(client, args.url, body | {"exclude": others})["responses"][0]["text"])
    where: Counter[str] = Counter()
    for pair, top in zip(pairs, tops, strict=True):
        said = [normalize(x) for x in lines[pair.conversation_id]]
        context = [normalize(x) for x in pair.context]
        pos = next(
            i
            for i in range(len(context), len(said))
            if said[i] == normalize(pair.response) and said[i - len(context) : i] == context
        )
        t = normalize(top)
        if t == said[pos]:
            where["the test reply"] += 1
        elif t in said[pos + 1 :]:
            where["a later line of the same conversation"] += 1
        elif t in said[: pos - len(context)]:
            where["an earlier line of it, outside the context"] += 1
        elif t in context:
            where["a context turn"] += 1
        else:
            where["elsewhere in the pool"] += 1

    def profile(texts: list[str]) -> dict[str, float]:
        n, repeats = len(texts), Counter(texts)
        both = list(zip(texts, [q.context[-1] for q in pairs], strict=True))  # (answer, last turn)
        return {
            "mean_words": round(sum(len(words(t)) for t in texts) / n, 1),
            "at_most_3_words_%": round(100 * sum(len(words(t)) <= 3 for t in texts) / n, 2),
            "shares_a_content_word_with_the_last_turn_%": round(
                100 * sum(shares(t, q) for t, q in both) / n, 2
            ),
            "at_most_3_words_sharing_a_content_word_%": round(
                100 * sum(len(words(t)) <= 3 and shares(t, q) for t, q in both) / n, 2
            ),
            "distinct": len(repeats),
            "requests_answered_by_a_text_given_3_or_more_times": sum(v for v in repeats.values() if v >= 3),
        }

    at: dict[str, list[int]] = defaultdict(list)
    for i, top in enumerate(tops):
        at[top].append(i)
    repeated = [ix for ix in at.values() if len(ix) >= 3]

    hits_alone = sum(normalize(t) == normalize(q.response) for t, q in zip(alone, pairs, strict=True))
    result = {
        "pairs": len(pairs),
        "top1_is": dict(where.most_common()),
        "rerank_gated_%": round(100 * sum(gated) / len(gated), 2),
        "hits@1_with_the_conversations_other_lines_excluded": round(100 * hits_alone / len(pairs), 2),
        "texts_given_3_or_more_times": len(repeated),
        "of_them_only_within_40_consecutive_pairs": sum(max(ix) - min(ix) < 40 for ix in repeated),
        "default": profile(tops),
        "people": profile([q.response for q in pairs]),
        "tops": tops,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "tops"}, indent=1))


if __name__ == "__main__":
    main()
