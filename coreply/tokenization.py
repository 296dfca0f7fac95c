"""Turning dialogue text into model inputs, with the papers' truncation rule: a context keeps its
*latest* tokens (cut from the front), a response keeps its *first* tokens (cut at the end)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from coreply.config import ModelConfig


@dataclass
class Batch:
    """Padded model input. All tensors are [N, L]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        return Batch(
            self.input_ids.to(device), self.attention_mask.to(device), self.token_type_ids.to(device)
        )


class DialogueTokenizer:
    """Formats contexts, responses and context-response pairs.

    * context:  ``[CLS] u1 [SEP] u2 [SEP] ... un [SEP]``, at most ``max_context_tokens``, cut from the front
    * response: ``[CLS] r [SEP]``, at most ``max_response_tokens``, cut at the end
    * pair:     ``[CLS] u1 [SEP] ... un [SEP] r [SEP]`` with segment 0 for the context part and 1 for the
      response part; the same two cuts apply, so a pair has at most ``max_context + max_response - 1`` tokens.
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

    def _pieces(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return self.hf(list(texts), add_special_tokens=False)["input_ids"]

    def _context_body(self, turns: Sequence[str]) -> list[int]:
        """u1 [SEP] u2 [SEP] ... un, then cut from the front to fit ``[CLS] body [SEP]``."""
        body: list[int] = []
        for i, piece in enumerate(self._pieces(turns[-self.config.max_turns :])):
            if i:
                body.append(self.sep)
            body.extend(piece)
        keep = self.config.max_context_tokens - 2
        return body[-keep:] if len(body) > keep else body

    def _response_bodies(self, responses: Sequence[str]) -> list[list[int]]:
        keep = self.config.max_response_tokens - 2
        return [piece[:keep] for piece in self._pieces(responses)]

    def contexts(self, contexts: Sequence[Sequence[str]]) -> Batch:
        return self._pad([[self.cls, *self._context_body(c), self.sep] for c in contexts])

    def responses(self, responses: Sequence[str]) -> Batch:
        return self._pad([[self.cls, *body, self.sep] for body in self._response_bodies(responses)])

    def pairs(self, contexts: Sequence[Sequence[str]], responses: Sequence[str]) -> Batch:
        """One row per (contexts[i], responses[i])."""
        if len(contexts) != len(responses):
            raise ValueError("pairs() needs as many contexts as responses")
        rows, segments = [], []
        bodies: dict[tuple[str, ...], list[int]] = {}
        for context, body in zip(contexts, self._response_bodies(responses), strict=True):
            key = tuple(context)
            if key not in bodies:
                bodies[key] = self._context_body(context)
            head = [self.cls, *bodies[key], self.sep]
            tail = [*body, self.sep]
            rows.append(head + tail)
            segments.append([0] * len(head) + [1] * len(tail))
        return self._pad(rows, segments)

    def _pad(self, rows: list[list[int]], segments: list[list[int]] | None = None) -> Batch:
        width = max((len(r) for r in rows), default=0)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        types = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
            if segments is not None:
                types[i, : len(row)] = torch.tensor(segments[i], dtype=torch.long)
        return Batch(ids, mask, types)
