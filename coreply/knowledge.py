"""Knowledge-grounded ranking (``../shared/papers/reckgc-knowledge-grounded.md``): background sentences
(a persona, an operator's facts) that steer which reply is chosen.

* :class:`KnowledgeSelector`: the knowledge retriever's pick, the top-m sentences for a context by the
  scaled dot product of one shared encoder (paper Eq. 1-2); the reranker then reads them before the
  context (:meth:`~coreply.tokenization.DialogueTokenizer.knowledge_body`).
* :func:`coreply.text.unigram_f1`: the heuristic rho(k, r) the reciprocal learner adds to the ranker's
  feedback (Eq. 10).
* :func:`load_chitchat_persona`: knowledge for the built-in corpus without labels. For every reply, the
  conversation's prompt and what the *replying speaker* wrote in other (training) conversations.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coreply.corpus import SPLITS, Pair, chitchat_path, speaker_turns, split_of
from coreply.text import normalize, words
from coreply.vectors import TextVectors

DEFAULT_TOP_M = 5  # RecKGC's m


def trained_top_m(cross_dir: str | Path) -> int:
    """How many knowledge sentences the ranker in ``cross_dir`` was trained to read (``coreply ground
    train`` records it), else :data:`DEFAULT_TOP_M`: what evaluation and bundles pick unless told."""
    from coreply.checkpoint import read_meta

    trained = read_meta(cross_dir, verify=False).get("extra", {}).get("grounded_config", {})
    return int(trained.get("top_m") or DEFAULT_TOP_M)


class KnowledgeSelector:
    """Top-m knowledge sentences per context by a knowledge retriever (a bi-encoder; RecKGC uses one
    encoder for both sides): score = E(C) . E(k), ranked best first (Eq. 1's 1/sqrt(d) does not change
    the order). Sentence vectors are cached, so a bundle's default knowledge is encoded once."""

    def __init__(self, retriever: Any, top_m: int, cache_size: int = 50_000) -> None:
        if top_m < 1:
            raise ValueError(f"top_m must be >= 1, got {top_m}")
        self.retriever, self.top_m = retriever, top_m
        self.vectors = TextVectors(lambda s: retriever.embed_responses(s).numpy(), cache_size)

    def scores(
        self, contexts: Sequence[Sequence[str]], knowledge: Sequence[Sequence[str]]
    ) -> list[np.ndarray]:
        """Per context, the retriever's score of each of its knowledge sentences [n_k]."""
        self.vectors.warm([s for k in knowledge for s in k])
        queries = self.retriever.embed_contexts(contexts).numpy()  # [B, D]
        return [
            self.vectors(k) @ q if len(k) else np.zeros(0, dtype="float32")
            for q, k in zip(queries, knowledge, strict=True)
        ]

    def __call__(
        self, contexts: Sequence[Sequence[str]], knowledge: Sequence[Sequence[str]]
    ) -> list[tuple[str, ...]]:
        """Per context, its top-m sentences, best first."""
        out = []
        for k, s in zip(knowledge, self.scores(contexts, knowledge), strict=True):
            best = np.argsort(-s, kind="stable")[: self.top_m]
            out.append(tuple(k[i] for i in best))
        return out


# ------------------------------------------------------------------------------------- persona data


def _stable_seed(*parts: str) -> int:
    return int(hashlib.sha1("\x00".join(parts).encode("utf-8")).hexdigest()[:8], 16)


def load_chitchat_persona(
    max_turns: int = 5, max_knowledge: int = 32, min_words: int = 4, path: str | Path | None = None
) -> dict[str, list[Pair]]:
    """The built-in corpus with knowledge per reply, split as :func:`coreply.corpus.load_chitchat` does
    (same pairs, same order). A reply's knowledge is its conversation's prompt (when it has one) and up to
    ``max_knowledge - 1`` distinct messages of at least ``min_words`` words that the replying speaker wrote
    in *training* conversations other than this one, drawn with a seed fixed per (speaker, conversation).
    So no test or validation text is ever knowledge, a conversation never grounds itself, and the
    sentences are what this person tends to talk about, not labels of what they said next."""
    with open(path or chitchat_path()) as fh:
        conversations = json.load(fh)
    # speaker -> their distinct messages in training conversations, and the conversations each is in
    said: dict[str, dict[str, tuple[str, set[str]]]] = defaultdict(dict)
    for cid, conversation in conversations.items():
        if split_of(cid) != "train":
            continue
        for sender, _, messages in speaker_turns(conversation):
            for m in messages:
                if len(words(m)) >= min_words:
                    said[sender].setdefault(normalize(m), (m.strip(), set()))[1].add(cid)
    splits: dict[str, list[Pair]] = {name: [] for name in SPLITS}
    for cid, conversation in conversations.items():
        turns = speaker_turns(conversation)
        prompt = (conversation.get("prompt") or "").strip()
        personas: dict[str, tuple[str, ...]] = {}
        for i in range(1, len(turns)):
            sender = turns[i][0]
            if sender not in personas:
                own = [m for m, where in said.get(sender, {}).values() if where - {cid}]
                rng = np.random.default_rng(_stable_seed(sender, cid))
                room = max_knowledge - (1 if prompt else 0)
                picked = [own[j] for j in sorted(rng.permutation(len(own))[:room])] if room > 0 else []
                personas[sender] = ((prompt,) if prompt else ()) + tuple(picked)
            context = tuple(t for _, t, _ in turns[max(0, i - max_turns) : i])
            splits[split_of(cid)].append(Pair(context, turns[i][1], cid, knowledge=personas[sender]))
    return splits


def knowledge_stats(pairs: Sequence[Pair]) -> dict[str, float]:
    """What a grounded split holds: sentences per pair, the share with more than the prompt, and how
    often the gold reply is itself one of the knowledge sentences (a speaker repeating themselves)."""
    if not pairs:
        return {"pairs": 0}
    sizes = np.array([len(p.knowledge) for p in pairs])
    gold_in = np.mean([normalize(p.response) in {normalize(k) for k in p.knowledge} for p in pairs])
    return {
        "pairs": len(pairs),
        "mean_sentences": round(float(sizes.mean()), 2),
        "share_with_persona": round(float(np.mean(sizes > 1)), 4),
        "share_gold_in_knowledge": round(float(gold_in), 4),
    }


def select_for_pairs(
    selector: KnowledgeSelector | None, pairs: Sequence[Pair], batch_size: int = 64
) -> list[tuple[str, ...]]:
    """The knowledge the reranker reads for each pair: the selector's top-m, or (no selector) all of
    it in the given order (the tokenizer's budget then cuts the tail)."""
    if selector is None:
        return [p.knowledge for p in pairs]
    import torch  # here: reading grounded data needs no model, and a bad file is said before torch loads

    out: list[tuple[str, ...]] = []
    with torch.inference_mode():
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start : start + batch_size]
            out.extend(selector([p.context for p in chunk], [p.knowledge for p in chunk]))
    return out
