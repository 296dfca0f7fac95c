"""Readers for users' own data and the public benchmark formats the papers use. Every error names the
file, the line (or record) and the field."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from coreply.corpus import Pair


class DataError(ValueError):
    """Malformed input data; the message names the file, line/record and field."""


def _string_list(value: Any, where: str, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise DataError(f"{where}: field '{name}' must be a non-empty list of strings")
    return tuple(value)


def _string(value: Any, where: str, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: field '{name}' must be a non-empty string")
    return value


def _records(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(``file:line``, object) for every non-blank line of a JSONL file."""
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: invalid JSON ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object")
            yield where, record


def read_jsonl(path: str | Path) -> list[Pair]:
    """``{"context": [...], "response": "...", "negatives": [...]?, "knowledge": [...]?}`` per line
    (``knowledge``: background sentences for grounded ranking); blank lines skipped."""
    pairs = []
    for where, record in _records(path):
        negatives = record.get("negatives", [])
        knowledge = record.get("knowledge", [])
        pairs.append(
            Pair(
                _string_list(record.get("context"), where, "context"),
                _string(record.get("response"), where, "response"),
                str(record.get("conversation_id", "")),
                _string_list(negatives, where, "negatives") if negatives else (),
                _string_list(knowledge, where, "knowledge") if knowledge else (),
            )
        )
    if not pairs:
        raise DataError(f"{path}: no records")
    return pairs


def _need_file(path: str | Path) -> None:
    if Path(path).is_dir():
        raise DataError(f"{path}: a folder; name a file in it")
    if not Path(path).is_file():
        raise DataError(f"{path}: no such file")


def read_pool(path: str | Path) -> tuple[list[str], list[dict[str, Any]]]:
    """A response pool: one response per line (``.txt``), or JSONL with a ``text`` field per line. Returns
    the texts and, per text, its record's other fields (a team's own id, intent, template name...;
    ``{}`` for ``.txt``), which the bundle keeps and ``/respond`` returns as ``metadata``."""
    _need_file(path)
    texts: list[str] = []
    metadata: list[dict[str, Any]] = []
    with _utf8(str(path)):
        if str(path).endswith(".jsonl"):
            for where, record in _records(path):
                texts.append(_string(record.pop("text", None), where, "text"))
                metadata.append(record)
        else:
            with open(path, encoding="utf-8") as fh:
                texts = [line.rstrip("\n") for line in fh if line.strip()]
            metadata = [{} for _ in texts]
    if not texts:
        raise DataError(f"{path}: no text in it (one per line, or JSONL with a 'text' field per line)")
    return texts, metadata


def _ubuntu_context(text: str) -> tuple[str, ...]:
    """Turns end with ``__eot__``; utterances within a turn end with ``__eou__`` and are joined by a space."""
    turns = []
    for turn in text.split("__eot__"):
        utterances = [u.strip() for u in turn.split("__eou__") if u.strip()]
        if utterances:
            turns.append(" ".join(utterances))
    return tuple(turns)


def _ubuntu_response(text: str) -> str:
    return " ".join(u.strip() for u in text.split("__eou__") if u.strip())


def read_ubuntu_csv(path: str | Path) -> list[Pair]:
    """Ubuntu Dialogue Corpus v2 CSV. Training files (``Context,Utterance,Label``) give one pair per
    row with label 1 (label-0 rows are random negatives; coreply samples its own). Valid/test files
    (``Context,Ground Truth Utterance,Distractor_0..``) give pairs with their distractors as negatives."""
    pairs = []
    with open(path, encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames or []
        if "Context" not in header:
            raise DataError(f"{path}:1: missing column 'Context'")
        train = "Utterance" in header and "Label" in header
        if not train and "Ground Truth Utterance" not in header:
            raise DataError(f"{path}:1: expected columns 'Utterance,Label' or 'Ground Truth Utterance'")
        distractors = [h for h in header if h.startswith("Distractor_")]
        for number, row in enumerate(reader, 2):
            where = f"{path}:{number}"
            context = _ubuntu_context(_string(row.get("Context"), where, "Context"))
            if not context:
                raise DataError(f"{where}: field 'Context' has no utterances")
            if train:
                label = (row.get("Label") or "").strip()
                if label not in {"0", "1", "0.0", "1.0"}:
                    raise DataError(f"{where}: field 'Label' must be 0 or 1, got {label!r}")
                if float(label) == 1:
                    pairs.append(
                        Pair(context, _ubuntu_response(_string(row.get("Utterance"), where, "Utterance")))
                    )
            else:
                gold = _ubuntu_response(
                    _string(row.get("Ground Truth Utterance"), where, "Ground Truth Utterance")
                )
                negatives = tuple(_ubuntu_response(_string(row.get(d), where, d)) for d in distractors)
                pairs.append(Pair(context, gold, negatives=negatives))
    if not pairs:
        raise DataError(f"{path}: no positive pairs")
    return pairs


def read_dstc7_json(path: str | Path) -> list[Pair]:
    """DSTC7 track 1 JSON: a list of records with ``example-id``, ``messages-so-far`` (speaker,
    utterance), ``options-for-correct-answers`` and ``options-for-next`` (candidate-id, utterance).
    Consecutive messages of one speaker form one turn; the other options become negatives."""
    try:
        with open(path, encoding="utf-8") as fh:
            records = json.load(fh)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: invalid JSON at line {exc.lineno} ({exc.msg})") from exc
    if not isinstance(records, list):
        raise DataError(f"{path}: expected a JSON list of examples")
    pairs = []
    for index, record in enumerate(records):
        where = f"{path}: example {index}"
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected an object")
        where = f"{path}: example {record.get('example-id', index)}"
        messages = record.get("messages-so-far")
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: field 'messages-so-far' must be a non-empty list")
        turns: list[tuple[str, list[str]]] = []
        for m in messages:
            if not isinstance(m, dict):
                raise DataError(f"{where}: field 'messages-so-far' holds a non-object")
            speaker = _string(m.get("speaker"), where, "messages-so-far.speaker")
            text = _string(m.get("utterance"), where, "messages-so-far.utterance")
            if turns and turns[-1][0] == speaker:
                turns[-1][1].append(text)
            else:
                turns.append((speaker, [text]))
        correct = record.get("options-for-correct-answers")
        if not isinstance(correct, list) or not correct:
            raise DataError(f"{where}: field 'options-for-correct-answers' must be a non-empty list")
        gold = correct[0] if isinstance(correct[0], dict) else {}
        gold_id = gold.get("candidate-id")
        options = record.get("options-for-next", [])
        if not isinstance(options, list):
            raise DataError(f"{where}: field 'options-for-next' must be a list")
        negatives = tuple(
            _string(o.get("utterance") if isinstance(o, dict) else None, where, "options-for-next.utterance")
            for o in options
            if not (isinstance(o, dict) and o.get("candidate-id") == gold_id)
        )
        pairs.append(
            Pair(
                tuple(" ".join(texts) for _, texts in turns),
                _string(gold.get("utterance"), where, "options-for-correct-answers.utterance"),
                str(record.get("example-id", index)),
                negatives,
            )
        )
    return pairs


def read_pairs(path: str | Path) -> list[Pair]:
    """Dispatch on the file name: ``.jsonl`` (coreply's own), ``.csv`` (Ubuntu v2), ``.json`` (DSTC7)."""
    name = str(path)
    _need_file(name)
    readers = {".jsonl": read_jsonl, ".csv": read_ubuntu_csv, ".json": read_dstc7_json}
    reader = readers.get(Path(name).suffix)
    if reader is None:
        raise DataError(f"{name}: unknown data format (expected .jsonl, .csv (Ubuntu v2) or .json (DSTC7))")
    with _utf8(name):
        return reader(name)


@contextmanager
def _utf8(name: str):
    """A file that is not UTF-8 is a DataError naming it, not a bare codec error."""
    try:
        yield
    except UnicodeDecodeError as exc:
        raise DataError(f"{name}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
