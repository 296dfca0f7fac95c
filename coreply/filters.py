"""Metadata filters: which pool responses a request may be answered with, chosen by the fields the pool
file gave them (``{"text": ..., "intent": "refund", "locale": "en", "tags": ["billing", "vip"]}``).

A filter maps fields to a value or a list of values: ``{"locale": "en", "intent": ["refund", "billing"]}``
allows the responses whose ``locale`` is ``"en"`` and whose ``intent`` is one of the two. A field that
holds a list in the pool file matches when one of its items does (tags). Values compare as JSON does:
``1`` and ``1.0`` are one number, ``true`` is not ``1``, ``"1"`` is text. Objects and nulls in the pool
file are kept and returned, but never matched.

The index is built once per bundle (:attr:`coreply.bundle.Bundle.filters`); a request's filter becomes
a boolean mask over pool ids (:class:`coreply.ranking.Query` ``allow``), which the retriever searches
within, so a filter never leaves an answer short while allowed responses remain.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

Scalar = str | int | float | bool
Filter = Mapping[str, Scalar | Sequence[Scalar]]


class FilterError(ValueError):
    """A filter that cannot match as meant: a field the pool never gives as a text, number or boolean,
    an empty list of values, or a value that is none of those."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def _term(value: Any) -> tuple[str, Scalar] | None:
    """A value as the index keys it (its JSON kind and the value), or None for one never matched."""
    if isinstance(value, bool):  # before int: bool is an int in Python, not in JSON
        return ("boolean", value)
    if isinstance(value, int | float):
        return ("number", value)
    if isinstance(value, str):
        return ("text", value)
    return None


class MetadataIndex:
    """Field -> value -> the ids [n] whose metadata holds that value (or holds it in a list)."""

    def __init__(self, metadata: Sequence[Mapping[str, Any]]) -> None:
        postings: dict[str, dict[tuple[str, Scalar], list[int]]] = defaultdict(lambda: defaultdict(list))
        for i, record in enumerate(metadata):
            for name, value in record.items():
                for item in value if isinstance(value, list) else (value,):
                    if (term := _term(item)) is not None:
                        postings[name][term].append(i)
        self.size = len(metadata)
        self.fields = {
            name: {term: np.asarray(ids, dtype=np.int64) for term, ids in values.items()}
            for name, values in postings.items()
        }

    def allowed(self, where: Filter) -> np.ndarray:
        """[N] bool: the responses that match every field of ``where``. A field no response holds as a
        text, number or boolean raises :class:`FilterError` (most often a misspelt name), as does a field
        with an empty list of values; a value no response holds just matches nothing."""
        mask = np.ones(self.size, dtype=bool)
        for name, wanted in where.items():
            values = self.fields.get(name)
            if values is None:
                known = ", ".join(sorted(self.fields)[:20]) or "none"
                raise FilterError(name, f"no response in this pool has this field (fields: {known})")
            items = wanted if isinstance(wanted, list | tuple) else (wanted,)
            if not items:
                raise FilterError(name, "an empty list of values matches nothing; leave the field out")
            field_mask = np.zeros(self.size, dtype=bool)
            for item in items:
                term = _term(item)
                if term is None:
                    raise FilterError(name, f"{item!r} is not a text, number or boolean")
                if (ids := values.get(term)) is not None:
                    field_mask[ids] = True
            mask &= field_mask
        return mask
