"""Metadata filters: which pool responses a request may be answered with, chosen by the fields the pool
file gave them (``{"text": ..., "intent": "refund", "tags": ["billing", "vip"], "price": 12}``).

A filter maps fields to conditions, and a response must meet every one. A condition is a value (the field
equals it), a list of values (it equals one of them), or an object of operators, as vector databases and
MongoDB write them, all of which must hold:

- ``$eq`` / ``$ne``: equal / not equal to a value; ``$in`` / ``$nin``: one of / none of a list of values;
- ``$gt``, ``$gte``, ``$lt``, ``$lte``: a number above / at least / below / at most a number;
- ``$exists``: ``true``, the field holds a text, number or boolean; ``false``, it does not.

``{"locale": "en", "intent": {"$ne": "refund"}, "price": {"$gte": 10, "$lt": 20}}``. Filters combine with
``$and`` and ``$or`` (a list of filters) and ``$not`` (one filter), at most :data:`NESTED` deep:
``{"$or": [{"intent": "refund"}, {"tags": "vip"}], "$not": {"locale": "de"}}``. A field that holds a
list in the pool file (tags) matches when one of its items does, each operator on its own; the negations
are the complements of their positive forms, so ``$ne`` and ``$nin`` also allow the responses that lack
the field (``$exists`` tells them apart). Values compare as JSON does: ``1`` and ``1.0`` are one number,
``true`` is not ``1``, ``"1"`` is text; the ranges compare numbers as float64. Objects and nulls in the
pool file are kept and returned, but never matched.

The index is built once per bundle (:attr:`coreply.bundle.Bundle.filters`); a request's filter becomes
a boolean mask over pool ids (:class:`coreply.ranking.Query` ``allow``), which the retriever searches
within, so a filter never leaves an answer short while allowed responses remain.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

Scalar = str | int | float | bool
Condition = Scalar | Sequence[Scalar] | Mapping[str, Scalar | Sequence[Scalar]]
Filter = Mapping[str, Any]
"""Field -> :data:`Condition`; or a :data:`LOGICAL` operator -> a list of filters, or one for ``$not``."""

RANGES = {"$gt": ("right", False), "$gte": ("left", False), "$lt": ("left", True), "$lte": ("right", True)}
"""A range operator -> (the side ``np.searchsorted`` puts its bound on, whether it keeps what lies below)."""
LISTED = {"$eq": "$in", "$ne": "$nin"}
"""An operator on one value -> its form on a list of values."""
OPERATORS = ("$eq", "$ne", "$in", "$nin", *RANGES, "$exists")
"""A field's operators: ``{"price": {"$lt": 20}}``."""
LOGICAL = ("$and", "$or", "$not")
"""A filter's operators, whose operands are filters: ``{"$or": [{"intent": "refund"}, {"tags": "vip"}]}``."""
NESTED = 4
"""The most filters one filter may hold one within another (``$and``, ``$or``, ``$not``)."""
CONDITIONS = 64
"""The most conditions one filter may hold in all (each field's value, list or operator, and each filter
within ``$and``, ``$or`` or ``$not``): each is a pass over the pool, so a request's filter stays cheap."""
VALUES = 256
"""The most values one list may hold (a field's list of values, ``$in``, ``$nin``)."""


class FilterError(ValueError):
    """A filter that cannot match as meant: a field the pool never gives as a text, number or boolean,
    an unknown operator, an operand of the wrong kind (an empty list, a range bound that is not a finite
    number, a range over a field that holds no number), or a value that is no text, number or boolean.
    ``field`` names where: the field, or ``field.$op`` for an operator."""

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


def _number(value: int | float) -> float:
    """A JSON number as float64; an integer too large for one is the infinity on its side."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _is_list(value: Any) -> bool:
    return isinstance(value, list | tuple)


class MetadataIndex:
    """Field -> value -> the ids [n] whose metadata holds that value (or holds it in a list); per field
    also the ids that hold any value (``$exists``) and its numbers sorted with their ids (the ranges)."""

    def __init__(self, metadata: Sequence[Mapping[str, Any]]) -> None:
        postings: dict[str, dict[tuple[str, Scalar], list[int]]] = defaultdict(lambda: defaultdict(list))
        present: dict[str, list[int]] = defaultdict(list)
        numbers: dict[str, tuple[list[float], list[int]]] = defaultdict(lambda: ([], []))
        for i, record in enumerate(metadata):
            for name, value in record.items():
                held = False
                for item in value if isinstance(value, list) else (value,):
                    if (term := _term(item)) is None:
                        continue
                    postings[name][term].append(i)
                    held = True
                    if term[0] == "number":
                        numbers[name][0].append(_number(item))
                        numbers[name][1].append(i)
                if held:
                    present[name].append(i)
        self.size = len(metadata)
        self.fields = {
            name: {term: np.asarray(ids, dtype=np.int64) for term, ids in values.items()}
            for name, values in postings.items()
        }
        self.present = {name: np.asarray(ids, dtype=np.int64) for name, ids in present.items()}
        # field -> (its numbers [m] in ascending order, the id holding each [m])
        self.numbers: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, (values, rows) in numbers.items():
            order = np.argsort(values, kind="stable")
            self.numbers[name] = (np.asarray(values)[order], np.asarray(rows, dtype=np.int64)[order])

    def describe(self) -> str:
        """The fields a filter can name, each with its count of values and, where it holds numbers, their
        range: ``intent (12 values), price (40 values, numbers 0.5 to 99)``."""
        if not self.fields:
            return "none (the pool file gave no fields besides the text)"
        said = []
        for name, values in sorted(self.fields.items()):
            numbers = self.numbers.get(name)
            span = "" if numbers is None else f", numbers {numbers[0][0]:g} to {numbers[0][-1]:g}"
            said.append(f"{name} ({len(values):,} value{'s' * (len(values) != 1)}{span})")
        return ", ".join(said)

    def allowed(self, where: Filter) -> np.ndarray:
        """[N] bool: the responses that meet every condition of ``where``. A field no response holds as a
        text, number or boolean raises :class:`FilterError` (most often a misspelt name), as does a
        condition that cannot match as meant; a value no response holds just matches nothing."""
        return self._all(where, "", 0, [CONDITIONS])

    def _all(self, where: Filter, at: str, depth: int, left: list[int]) -> np.ndarray:
        """[N] bool: ``where`` met. ``at`` is the path to it, for errors; ``left`` holds the count of
        conditions the whole filter may still hold, one list shared down the walk."""
        mask = np.ones(self.size, dtype=bool)
        for name, condition in where.items():
            if name.startswith("$"):
                mask &= self._logical(name, condition, at + name, depth, left)
            else:
                mask &= self._field(name, condition, at + name, left)
        return mask

    @staticmethod
    def _spend(where: str, left: list[int], n: int = 1) -> None:
        left[0] -= n
        if left[0] < 0:
            raise FilterError(where, f"the filter holds more than {CONDITIONS} conditions in all")

    def _logical(self, op: str, operand: Any, where: str, depth: int, left: list[int]) -> np.ndarray:
        """[N] bool: ``{op: operand}`` for a logical operator, whose operands are whole filters."""
        if op not in LOGICAL:
            raise FilterError(where, f"not a logical operator ({', '.join(LOGICAL)}); a field's operators go "
                              'inside it: {"price": {"$lt": 20}}')  # fmt: skip
        if depth == NESTED:
            raise FilterError(where, f"filters nested more than {NESTED} deep")
        if op == "$not":
            if not isinstance(operand, Mapping):
                raise FilterError(where, "takes a filter (a JSON object of fields)")
            self._spend(where, left)
            return ~self._all(operand, f"{where}.", depth + 1, left)
        if not _is_list(operand) or not operand or not all(isinstance(f, Mapping) for f in operand):
            raise FilterError(where, "takes a list of 1 or more filters (JSON objects of fields)")
        self._spend(where, left, len(operand))
        masks = [self._all(f, f"{where}.{i}.", depth + 1, left) for i, f in enumerate(operand)]
        return np.logical_and.reduce(masks) if op == "$and" else np.logical_or.reduce(masks)

    def _field(self, name: str, condition: Condition, where: str, left: list[int]) -> np.ndarray:
        """[N] bool: the responses whose field ``name`` meets ``condition``."""
        if name not in self.fields:
            known = ", ".join(sorted(self.fields)[:20]) or "none"
            raise FilterError(where, f"no response in this pool has this field (fields: {known})")
        if isinstance(condition, Mapping):
            if not condition:
                raise FilterError(where, f"an object of operators names none ({', '.join(OPERATORS)})")
            self._spend(where, left, len(condition))
            mask = np.ones(self.size, dtype=bool)
            for op, operand in condition.items():
                mask &= self._operator(name, op, operand, f"{where}.{op}")
            return mask
        self._spend(where, left)
        if _is_list(condition):
            if not condition:
                raise FilterError(where, "an empty list of values matches nothing; leave the field out")
            return self._any_of(name, where, condition)
        return self._any_of(name, where, (condition,))

    def _operator(self, name: str, op: str, operand: Any, where: str) -> np.ndarray:
        """[N] bool: the responses whose field ``name`` meets ``{op: operand}``."""
        if op in ("$eq", "$ne"):
            if _is_list(operand):
                raise FilterError(where, f"takes one value; {LISTED[op]} takes a list")
            match = self._any_of(name, where, (operand,))
            return match if op == "$eq" else ~match
        if op in ("$in", "$nin"):
            if not _is_list(operand) or not operand:
                raise FilterError(where, "takes a list of 1 or more values")
            match = self._any_of(name, where, operand)
            return match if op == "$in" else ~match
        if op in RANGES:
            return self._range(name, where, op, operand)
        if op == "$exists":
            if not isinstance(operand, bool):
                raise FilterError(where, f"takes true or false, not {operand!r}")
            match = np.zeros(self.size, dtype=bool)
            match[self.present[name]] = True
            return match if operand else ~match
        raise FilterError(where, f"not an operator (operators: {', '.join(OPERATORS)})")

    def _any_of(self, name: str, where: str, items: Sequence[Any]) -> np.ndarray:
        """[N] bool: the responses whose field ``name`` holds one of ``items``."""
        if len(items) > VALUES:
            raise FilterError(where, f"{len(items)} values; a list may hold at most {VALUES}")
        values = self.fields[name]
        match = np.zeros(self.size, dtype=bool)
        for item in items:
            term = _term(item)
            if term is None:
                raise FilterError(where, f"{item!r} is not a text, number or boolean")
            if (ids := values.get(term)) is not None:
                match[ids] = True
        return match

    def _range(self, name: str, where: str, op: str, bound: Any) -> np.ndarray:
        """[N] bool: the responses whose field ``name`` holds a number on ``op``'s side of ``bound``."""
        if isinstance(bound, bool) or not isinstance(bound, int | float) or not math.isfinite(_number(bound)):
            raise FilterError(where, f"takes a finite number, not {bound!r}")
        if name not in self.numbers:
            raise FilterError(where, "compares numbers, and no response holds a number in this field")
        values, ids = self.numbers[name]
        side, below = RANGES[op]
        cut = int(np.searchsorted(values, _number(bound), side=side))
        match = np.zeros(self.size, dtype=bool)
        match[ids[:cut] if below else ids[cut:]] = True
        return match
