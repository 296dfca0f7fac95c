"""Turning dialogue text into model inputs, with the papers' truncation rule: a context keeps its
*latest* tokens (cut from the front), a response keeps its *first* tokens (cut at the end).

Two layers, so that text is tokenised once and inputs are assembled from token ids:

* :meth:`DialogueTokenizer.pieces` turns texts into word-piece ids without special tokens, from a cache
  filled by :meth:`DialogueTokenizer.warm` (training warms it with the whole corpus, so no step calls the
  Hugging Face tokenizer) or from ids stored in a bundle (:meth:`DialogueTokenizer.attach`, so serving
  never tokenises a response); texts in neither are tokenised on the spot and not kept.
* ``context_body`` / ``response_body`` / ``pair_row`` apply the cuts and the ``[CLS]``/``[SEP]`` layout to
  ids. Every input the models ever see, in training, evaluation and serving, goes through them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from coreply.config import ModelConfig


@dataclass
class Packing:
    """Where a padded batch's real tokens are, for a model that runs them without the padding (see
    ``coreply.models.backbone_hidden``): ``index`` [T] their flat positions in the [N, L] batch, row after
    row; ``cu_seqlens`` [N + 1] (int32) where each row starts among the T; ``max_len`` the longest row."""

    index: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Packing:
        return Packing(fn(self.index), fn(self.cu_seqlens), self.max_len)


@dataclass
class Batch:
    """Padded model input. All tensors are [N, L]; ``packing`` (from :meth:`packed`) lets a model skip
    the padding."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    packing: Packing | None = None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        packing = self.packing.apply(fn) if self.packing is not None else None
        return Batch(fn(self.input_ids), fn(self.attention_mask), fn(self.token_type_ids), packing)

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return self._apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self._apply(lambda t: t.pin_memory())

    def packed(self) -> Batch:
        """This batch with its :class:`Packing` (computed where the mask is, best on the CPU: the model
        then needs no host synchronisation to learn T)."""
        lengths = self.attention_mask.sum(1)  # [N]
        cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=lengths.device)
        cu_seqlens[1:] = lengths.cumsum(0)
        index = self.attention_mask.reshape(-1).nonzero().squeeze(1)  # [T]
        return replace(self, packing=Packing(index, cu_seqlens, int(lengths.max()) if len(lengths) else 0))

    @property
    def tokens(self) -> int:
        """Real (unpadded) tokens in the batch."""
        return int(self.attention_mask.sum())

    @property
    def computed_tokens(self) -> int:
        """Tokens a model computes on: the real ones when packed, else every padded position."""
        return self.input_ids.numel() if self.packing is None else len(self.packing.index)


def pad_rows(rows: Sequence[Sequence[int]], pad: int, segment_starts: Sequence[int] | None = None) -> Batch:
    """Right-pad id rows into a :class:`Batch`. ``segment_starts[i]``: where row i's segment 1 begins
    (pairs); without it every token is segment 0."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    width = int(lengths.max()) if len(rows) else 0
    ids = np.full((len(rows), width), pad, dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    positions = np.arange(width)[None, :]  # [1, L]
    mask = positions < lengths[:, None]  # [N, L]
    types = np.zeros_like(ids)
    if segment_starts is not None:
        starts = np.asarray(segment_starts, dtype=np.int64)[:, None]
        types = ((positions >= starts) & mask).astype(np.int64)
    return Batch(torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64)), torch.from_numpy(types))


def token_budget_chunks(lengths: Sequence[int], max_tokens: int) -> list[np.ndarray]:
    """Row indices in length order, cut into chunks whose padded size (rows x longest row) stays within
    ``max_tokens`` (a chunk holds at least one row). Padding then costs little: rows of a chunk are alike."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    chunks, start = [], 0
    for end in range(1, len(order) + 1):
        # rows [start, end) padded to the length of order[end - 1], the longest so far
        if end - start > 1 and (end - start) * lengths[order[end - 1]] > max_tokens:
            chunks.append(order[start : end - 1])
            start = end - 1
    if start < len(order):
        chunks.append(order[start:])
    return chunks


def flat_pieces(pieces: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Many texts' pieces as one id array and offsets: text i is ``ids[offsets[i]:offsets[i + 1]]``."""
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.fromiter((i for p in pieces for i in p), dtype=np.int32, count=int(offsets[-1]))
    return ids, offsets


class DialogueTokenizer:
    """Formats contexts, responses and context-response pairs.

    * context:  ``[CLS] u1 [SEP] u2 [SEP] ... un [SEP]``, at most ``max_context_tokens``, cut from the front
    * response: ``[CLS] r [SEP]``, at most ``max_response_tokens``, cut at the end
    * pair:     ``[CLS] u1 [SEP] ... un [SEP] r [SEP]`` with segment 0 for the context part and 1 for the
      response part; the same two cuts apply, so a pair has at most ``max_context + max_response - 1`` tokens.
    * grounded pair (a model with ``max_knowledge_tokens > 0``, given knowledge; RecKGC Eq. 3):
      ``[CLS] k1 [SEP] ... km [SEP] u1 [SEP] ... un [SEP] r [SEP]``, all before ``r`` in segment 0. Each
      sentence is cut like a response, and the sentences together to ``max_knowledge_tokens`` (with their
      [SEP]) by dropping from the *end*: knowledge comes most relevant first. With no context turns
      (the reciprocal learner's feedback) the pair is ``[CLS] k [SEP] r [SEP]``.
    Only the last ``max_turns`` utterances of a context are used.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: ModelConfig) -> None:
        if tokenizer.cls_token_id is None or tokenizer.sep_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer must define [CLS], [SEP] and [PAD] tokens")
        self.hf = tokenizer
        self.config = config
        self.cls = tokenizer.cls_token_id
        self.sep = tokenizer.sep_token_id
        self.pad = tokenizer.pad_token_id
        self._cache: dict[str, list[int]] = {}
        self._stored: Mapping[str, int] = {}  # text -> row of the attached ids
        self._ids, self._offsets = np.zeros(0, dtype=np.int32), np.zeros(1, dtype=np.int64)

    # ------------------------------------------------------------------------------ text -> pieces

    def _tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return self.hf(list(texts), add_special_tokens=False)["input_ids"]

    def warm(self, texts: Iterable[str], chunk: int = 4096) -> int:
        """Tokenise ``texts`` once (batched) and keep their ids; returns how many were new."""
        todo = [t for t in dict.fromkeys(texts) if t not in self._cache]
        for start in range(0, len(todo), chunk):
            part = todo[start : start + chunk]
            self._cache.update(zip(part, self._tokenize(part), strict=True))
        return len(todo)

    def share_cache(self, other: DialogueTokenizer) -> bool:
        """Use ``other``'s id cache when both wrap the same tokenizer (same vocabulary, normaliser and
        pre-tokeniser): the pieces are then identical, and the corpus is tokenised once for both."""
        same = self.hf.backend_tokenizer.to_str() == other.hf.backend_tokenizer.to_str()
        if same:
            self._cache = other._cache
        return same

    @property
    def cached(self) -> int:
        return len(self._cache)

    def attach(self, rows: Mapping[str, int], ids: np.ndarray, offsets: np.ndarray) -> None:
        """Look the texts of ``rows`` (text -> row) up in stored ids instead of tokenising them: row i's
        pieces are ``ids[offsets[i]:offsets[i + 1]]`` (as :func:`flat_pieces` writes them)."""
        if offsets[-1] != len(ids) or max(rows.values(), default=-1) >= len(offsets) - 1:
            raise ValueError(f"stored token ids do not fit {len(rows)} texts")
        self._stored = rows
        self._ids, self._offsets = ids, offsets

    def _piece(self, text: str, fresh: dict[str, list[int]]) -> list[int]:
        if text in self._cache:
            return self._cache[text]
        row = self._stored.get(text)
        if row is not None:
            return self._ids[self._offsets[row] : self._offsets[row + 1]].tolist()
        return fresh[text]

    def pieces(self, texts: Sequence[str]) -> list[list[int]]:
        """Word-piece ids of each text (no special tokens, no cut)."""
        missing = [t for t in dict.fromkeys(texts) if t not in self._cache and t not in self._stored]
        fresh = dict(zip(missing, self._tokenize(missing), strict=True))
        return [self._piece(t, fresh) for t in texts]

    # ------------------------------------------------------------------------------ pieces -> rows

    def context_body(self, turns: Sequence[list[int]]) -> list[int]:
        """u1 [SEP] u2 [SEP] ... un of the last ``max_turns`` turns, cut from the front to fit
        ``[CLS] body [SEP]``."""
        body: list[int] = []
        for i, piece in enumerate(turns[-self.config.max_turns :]):
            if i:
                body.append(self.sep)
            body.extend(piece)
        keep = self.config.max_context_tokens - 2
        return body[-keep:] if len(body) > keep else body

    def response_body(self, piece: list[int]) -> list[int]:
        return piece[: self.config.max_response_tokens - 2]

    def knowledge_body(self, sentences: Sequence[list[int]]) -> list[int]:
        """k1 [SEP] k2 ... with each sentence cut like a response and the whole cut at the end to
        ``max_knowledge_tokens - 1`` (room for the [SEP] that follows it); [] when the model reads none."""
        keep = self.config.max_knowledge_tokens - 1
        body: list[int] = []
        for piece in sentences:
            if keep <= 0 or len(body) >= keep:
                break
            if body:
                body.append(self.sep)
            body.extend(self.response_body(piece))
        body = body[:keep]
        return body[:-1] if body and body[-1] == self.sep else body

    def grounded_body(self, knowledge: list[int], context: list[int]) -> list[int]:
        """Knowledge body, [SEP], context body (either may be empty): what precedes the response."""
        return [*knowledge, self.sep, *context] if knowledge and context else knowledge or context

    def single_row(self, body: list[int]) -> list[int]:
        """``[CLS] body [SEP]``: a context or a response for the bi-encoder."""
        return [self.cls, *body, self.sep]

    def pair_row(self, context_body: list[int], response_body: list[int]) -> tuple[list[int], int]:
        """``[CLS] context [SEP] response [SEP]`` and where the response segment starts."""
        return [self.cls, *context_body, self.sep, *response_body, self.sep], len(context_body) + 2

    def context_bodies(self, contexts: Sequence[Sequence[str]]) -> list[list[int]]:
        turns = [list(c[-self.config.max_turns :]) for c in contexts]
        flat = self.pieces([t for c in turns for t in c])
        out, start = [], 0
        for c in turns:
            out.append(self.context_body(flat[start : start + len(c)]))
            start += len(c)
        return out

    def response_bodies(self, responses: Sequence[str]) -> list[list[int]]:
        return [self.response_body(p) for p in self.pieces(responses)]

    # ------------------------------------------------------------------------------ batches

    def batch_singles(self, bodies: Sequence[list[int]]) -> Batch:
        return pad_rows([self.single_row(b) for b in bodies], self.pad)

    def batch_pairs(self, context_bodies: Sequence[list[int]], response_bodies: Sequence[list[int]]) -> Batch:
        """One row per (context_bodies[i], response_bodies[i])."""
        if len(context_bodies) != len(response_bodies):
            raise ValueError("pairs() needs as many contexts as responses")
        rows = [self.pair_row(c, r) for c, r in zip(context_bodies, response_bodies, strict=True)]
        return pad_rows([r for r, _ in rows], self.pad, [s for _, s in rows])

    def contexts(self, contexts: Sequence[Sequence[str]]) -> Batch:
        return self.batch_singles(self.context_bodies(contexts))

    def responses(self, responses: Sequence[str]) -> Batch:
        return self.batch_singles(self.response_bodies(responses))

    def pair_rows(
        self,
        contexts: Sequence[Sequence[str]],
        responses: Sequence[str],
        knowledge: Sequence[Sequence[str]] | None = None,
    ) -> list[tuple[list[int], int]]:
        """(row, where its response segment starts) per (contexts[i], responses[i]), grounded on
        ``knowledge[i]`` when given (and the model reads knowledge); each distinct (knowledge, context)
        is assembled once."""
        if len(contexts) != len(responses) or (knowledge is not None and len(knowledge) != len(contexts)):
            raise ValueError("pairs() needs as many contexts (and knowledge lists) as responses")
        reads = knowledge is not None and self.config.max_knowledge_tokens > 0
        grounds = knowledge if reads else [()] * len(contexts)
        keys = [(tuple(k), tuple(c)) for k, c in zip(grounds, contexts, strict=True)]
        unique = list(dict.fromkeys(keys))
        context_bodies = self.context_bodies([c for _, c in unique])
        bodies = {
            key: self.grounded_body(self.knowledge_body(self.pieces(key[0])), body)
            for key, body in zip(unique, context_bodies, strict=True)
        }
        response_bodies = self.response_bodies(responses)
        return [self.pair_row(bodies[key], r) for key, r in zip(keys, response_bodies, strict=True)]

    def pairs(
        self,
        contexts: Sequence[Sequence[str]],
        responses: Sequence[str],
        knowledge: Sequence[Sequence[str]] | None = None,
    ) -> Batch:
        """One row per (contexts[i], responses[i]) (grounded on ``knowledge[i]`` when given)."""
        rows = self.pair_rows(contexts, responses, knowledge)
        return pad_rows([r for r, _ in rows], self.pad, [s for _, s in rows])


def score_by_tokens(
    tok: DialogueTokenizer,
    contexts: Sequence[Sequence[str]],
    responses: Sequence[str],
    max_tokens: int,
    run: Callable[[Batch], np.ndarray],
    knowledge: Sequence[Sequence[str]] | None = None,
) -> np.ndarray:
    """Pair scores [N] (float32) in input order: rows assembled from ids (stored responses are not
    tokenised again), length-sorted, and ``run`` on chunks of at most ``max_tokens`` padded tokens."""
    rows = tok.pair_rows(contexts, responses, knowledge)
    out = np.empty(len(rows), dtype="float32")
    for chunk in token_budget_chunks([len(r) for r, _ in rows], max_tokens):
        batch = pad_rows([rows[i][0] for i in chunk], tok.pad, [rows[i][1] for i in chunk])
        out[chunk] = run(batch)
    return out
