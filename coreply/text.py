"""Text normalisation shared by the pool de-duplication, hit matching and the echo filter, the key that
tells an answer's spelling variants apart from other answers, the test for a reply that says nothing,
and the word overlap the restatement guard and the knowledge-grounded learner measure."""

from __future__ import annotations

import re
from collections import Counter

_WS = re.compile(r"\s+")
_WORD = re.compile(r"[a-z0-9']+")
_HELD = re.compile(r"([^\W\d_])\1+")  # a letter held: the "yyy" of "heyyy"
_MARKS_ONLY = re.compile(r"[\s.?!\u2026]*")


def normalize(text: str) -> str:
    """Lowercase and collapse whitespace: two responses are 'the same' iff this is equal."""
    return _WS.sub(" ", text).strip().lower()


def variant_key(text: str) -> str:
    """What the spelling variants of a reply share: its letters and digits in lower case, a letter held
    ("heyyy") counted once. "Hey!", "heyy" and "HEY" share "hey"; "What's up?" and "whats up" share
    "whatsup"; "10" and "110" do not. A text with neither letters nor digits (":)") is its own
    :func:`normalize`."""
    return _HELD.sub(r"\1", "".join(c for c in text.casefold() if c.isalnum())) or normalize(text)


def says_nothing(text: str) -> bool:
    """Whether a reply is nothing but the marks that end a sentence ("." "?" "!" "…") and spaces:
    "...", "?", "!!!". Such a reply is an empty sentence, not an answer; an emoticon (":)") is not one."""
    return _MARKS_ONLY.fullmatch(text) is not None


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def unigram_f1(a: str, b: str) -> float:
    """Unigram F1 between two texts (lower-cased words; RecKGC's rho)."""
    x, y = Counter(words(a)), Counter(words(b))
    common = sum((x & y).values())
    if not common:
        return 0.0
    precision, recall = common / sum(x.values()), common / sum(y.values())
    return 2 * precision * recall / (precision + recall)
