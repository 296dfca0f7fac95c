"""Dialogue pairs, the built-in chitchat corpus and its conversation-level split, and the response pool."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coreply.text import normalize

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Pair:
    """A context (oldest turn first) and its gold response. ``negatives`` are given distractors (benchmark
    formats that ship them); empty for corpora where negatives are sampled. ``knowledge``: background
    sentences the reply may draw on (a persona, facts), unlabelled: none is marked as the one used."""

    context: tuple[str, ...]
    response: str
    conversation_id: str = ""
    negatives: tuple[str, ...] = field(default=())
    knowledge: tuple[str, ...] = field(default=())


def split_of(conversation_id: str) -> str:
    """sha1(conversation_id) % 100: < 5 -> test, < 10 -> valid, else train."""
    bucket = int(hashlib.sha1(conversation_id.encode("utf-8")).hexdigest(), 16) % 100
    return "test" if bucket < 5 else "valid" if bucket < 10 else "train"


def pairs_from_turns(turns: Sequence[str], conversation_id: str, max_turns: int) -> list[Pair]:
    """For every turn i >= 1: context = the previous <= max_turns turns, response = turn i."""
    return [
        Pair(tuple(turns[max(0, i - max_turns) : i]), turns[i], conversation_id) for i in range(1, len(turns))
    ]


def speaker_turns(conversation: dict) -> list[tuple[str, str, list[str]]]:
    """(sender, turn, its messages) of a chitchat conversation: consecutive messages of one sender
    joined with a space; empty turns dropped."""
    grouped: list[tuple[str, list[str]]] = []
    for group in conversation["messages"]:
        for message in group:
            if grouped and grouped[-1][0] == message["sender"]:
                grouped[-1][1].append(message["text"])
            else:
                grouped.append((message["sender"], [message["text"]]))
    turns = ((sender, " ".join(texts).strip(), texts) for sender, texts in grouped)
    return [t for t in turns if t[1]]


def chitchat_turns(conversation: dict) -> list[str]:
    return [turn for _, turn, _ in speaker_turns(conversation)]


def chitchat_path() -> Path:
    try:
        import chitchat_dataset
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "the default corpus needs PyPI 'chitchat-dataset==0.9.0' (pip install 'coreply[data]')"
        ) from exc
    return Path(chitchat_dataset._PATH)


def load_chitchat(max_turns: int = 5, path: str | Path | None = None) -> dict[str, list[Pair]]:
    """The built-in corpus as {split: pairs}; 118,111 / 6,623 / 6,823 pairs with the package's data."""
    with open(path or chitchat_path()) as fh:
        conversations = json.load(fh)
    splits: dict[str, list[Pair]] = {name: [] for name in SPLITS}
    for conversation_id, conversation in conversations.items():
        turns = chitchat_turns(conversation)
        splits[split_of(conversation_id)].extend(pairs_from_turns(turns, conversation_id, max_turns))
    return splits


def distinct(texts: Iterable[str]) -> list[int]:
    """Positions of the first non-blank text of each :func:`normalize` form, in order."""
    seen: set[str] = set()
    keep = []
    for i, text in enumerate(texts):
        key = normalize(text)
        if key and key not in seen:
            seen.add(key)
            keep.append(i)
    return keep


def build_pool(texts: Iterable[str]) -> list[str]:
    """Distinct texts by :func:`normalize`, first spelling kept, in first-seen order (stable ids)."""
    texts = list(texts)
    return [texts[i] for i in distinct(texts)]


def responses_of(splits: dict[str, list[Pair]]) -> list[str]:
    """Every response of every split, for the retrieval pool."""
    return [pair.response for name in SPLITS for pair in splits.get(name, [])]


class NegativeSampler:
    """Random negatives from a response pool (a response that recurs is drawn as often as it occurs):
    distinct, and never equal (after normalisation) to the positive or to anything in ``avoid``."""

    def __init__(self, pool: Sequence[str]) -> None:
        self.pool = list(pool)
        self.keys = [normalize(t) for t in self.pool]
        self.distinct = len(set(self.keys) - {""})
        if self.distinct < 2:
            raise ValueError("the negative pool needs at least 2 distinct responses")

    @property
    def capacity(self) -> int:
        """The most negatives every list can have: all distinct responses but the gold."""
        return self.distinct - 1

    def sample(
        self, positive: str, count: int, rng: np.random.Generator, avoid: set[str] | None = None
    ) -> list[str]:
        taken = {normalize(positive)} | (avoid or set())
        out: list[str] = []
        for _ in range(20 * (count + 1)):  # rejection sampling: cheap when the pool is large
            if len(out) == count:
                return out
            i = int(rng.integers(len(self.pool)))
            if self.keys[i] and self.keys[i] not in taken:
                taken.add(self.keys[i])
                out.append(self.pool[i])
        first = {key: i for i, key in reversed(list(enumerate(self.keys))) if key and key not in taken}
        free = sorted(first.values())  # a small pool: draw from what is left, once per distinct response
        if len(out) + len(free) < count:
            raise ValueError(
                f"{count} negatives asked for, but the pool has only {len(out) + len(free)} distinct "
                "responses besides this list's own"
            )
        out += [self.pool[i] for i in rng.choice(free, size=count - len(out), replace=False)]
        return out
