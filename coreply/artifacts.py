"""Artifact I/O shared by checkpoints and bundles: a directory sealed by one JSON file that records the
sha256 of every other file, written atomically and verified on load.

Writing: build the directory inside :func:`staging` (a temporary sibling, removed if anything fails),
then :func:`seal` it (hash the files, then them and the JSON's fields into a version, write the JSON
atomically, rename the directory into place). Reading: :func:`read_sealed` parses the JSON, checks its
format and, by default, every file's hash and the version. :class:`Sealing` describes one kind.
Changing one in place (read, then write a new version over it): inside :func:`exclusive` (or a function
marked with :func:`changes`), so that two writers cannot each write over the other's change.
"""

from __future__ import annotations

import fcntl
import functools
import gzip
import hashlib
import json
import os
import shutil
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def content_hash(data: Any) -> str:
    """One hash over JSON data: a directory's {relative path: sha256}, and the fields beside it."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def hash_tree(root: Path, meta: str) -> dict[str, str]:
    """sha256 of every file under ``root`` except the metadata file ``meta``, by relative posix path."""
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != meta
    }


def file_mismatch(root: Path, recorded: dict[str, str], meta: str) -> str | None:
    """None if the files under ``root`` are exactly ``recorded`` (path -> sha256); else what differs."""
    actual = hash_tree(root, meta)
    for name in sorted(set(recorded) | set(actual)):
        if recorded.get(name) != actual.get(name):
            what = "missing" if name not in actual else "unexpected" if name not in recorded else "corrupted"
            return f"{root / name}: {what} (sha256 does not match {meta})"
    return None


def dumps(data: Any, indent: str = "", sort_keys: bool = True) -> str:
    """JSON with objects and nested lists indented two spaces a level, keys sorted (unless
    ``sort_keys`` is false: a bench's rows in the order it measured them), and a list of scalars on one
    line: per-case ranks stay readable at half the size of one value a line."""
    inner = indent + "  "
    if isinstance(data, dict) and data:
        pairs = sorted(data.items()) if sort_keys else data.items()
        keys = ((k if isinstance(k, str) else json.dumps(k), v) for k, v in pairs)
        items = (f"{inner}{json.dumps(k)}: {dumps(v, inner, sort_keys)}" for k, v in keys)
        return "{\n" + ",\n".join(items) + f"\n{indent}}}"
    if isinstance(data, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in data):
        return "[\n" + ",\n".join(inner + dumps(v, inner, sort_keys) for v in data) + f"\n{indent}]"
    return json.dumps(data)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file beside it + fsync + rename: a reader sees the old
    file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(path: Path, data: Any, sort_keys: bool = True) -> None:
    """Write JSON (:func:`dumps`) to ``path`` atomically (:func:`write_atomic`); gzip-compressed where
    the name ends in ``.gz`` (raw per-case results shrink about 15 times)."""
    text = (dumps(data, sort_keys=sort_keys) + "\n").encode()
    write_atomic(path, gzip.compress(text, mtime=0) if path.name.endswith(".gz") else text)


def read_json(path: str | Path) -> Any:
    """Parse a JSON file as :func:`write_json_atomic` writes it: gzip-compressed where the name ends in
    ``.gz``. Raises OSError (also for a .gz that is not whole gzip data), UnicodeDecodeError or
    json.JSONDecodeError."""
    data = Path(path).read_bytes()
    if str(path).endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (EOFError, zlib.error) as exc:  # cut short, or not deflate inside
            raise OSError(f"not whole gzip data ({exc})") from exc
    return json.loads(data)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished directory into place; an existing one is replaced only after the new one is whole."""
    if final.exists():
        old = final.with_name(f".{final.name}.{uuid.uuid4().hex}.old")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)


def check_replaceable(final: Path, meta_name: str) -> None:
    """``final`` is free, an empty folder, or an earlier artifact (it holds ``meta_name``) that a new
    version may replace; never a file or a folder of something else (a build named after its own input,
    a folder of one's own), which replacing would delete. Raises ValueError naming it."""
    if not final.exists() or (final / meta_name).is_file() or (final.is_dir() and not any(final.iterdir())):
        return
    raise ValueError(
        f"{final} exists and holds no {meta_name}, so it is not replaced: name a new path or remove it first"
    )


def check_out_file(path: Path) -> None:
    """``path`` can take a file written at the end of slow work: its folder exists and it is not one.
    Raises ValueError saying what to do; checked before the work, not after it."""
    if not path.parent.is_dir():
        raise ValueError(f"{path.parent} is not a folder; create it or name another")
    if path.is_dir():
        raise ValueError(f"{path} is a folder; name a file in it")


@contextmanager
def staging(final: Path, meta_name: str) -> Iterator[Path]:
    """A temporary directory beside ``final`` (which must be replaceable, :func:`check_replaceable`:
    checked here, before the work, and again as it is replaced); removed if the block fails."""
    check_replaceable(final, meta_name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class Busy(ValueError):
    """Another process is changing the artifact."""


@contextmanager
def exclusive(final: Path, what: str, meta_name: str) -> Iterator[None]:
    """Hold the artifact at ``final`` (sealed by ``meta_name``) for one read-and-rewrite (``what``: the
    command, for the message a second writer gets): an advisory lock on ``.NAME.lock`` beside it, which
    the system frees if the process dies. A second writer is refused at once with :class:`Busy` instead
    of waiting."""
    if not (final / meta_name).is_file():  # no artifact there to change (nor a lock to leave): reading
        yield  # or staging says why
        return
    with open(final.with_name(f".{final.name}.lock"), "a+", encoding="utf-8") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            raise Busy(f"{final}: {holder} is changing it; try again when it ends") from None
        fh.truncate(0)
        fh.write(f"{what} (pid {os.getpid()})")
        fh.flush()
        yield


def changes(what: str, meta_name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate a function whose first argument is an artifact's path and which reads and rewrites it:
    each call runs inside :func:`exclusive`."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def run(path: str | Path, *args: Any, **kwargs: Any) -> T:
            with exclusive(Path(path), what, meta_name):
                return fn(path, *args, **kwargs)

        return run

    return wrap


def link_or_copy(src: Path, dst: Path) -> None:
    """Reuse an unchanged file in a new artifact version: a hard link when possible (files are never
    modified in place, so sharing is safe), else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@dataclass(frozen=True)
class Sealing:
    """How one kind of artifact is sealed: its JSON file, its format, where its version goes, what a
    failure raises. The version is the sha256 of the files and of every other field of the JSON but the
    ``provenance`` ones (dotted paths: when and where it was made, which never change what it does), so
    a change to a model's config or a bundle's choices is a new version and a hand edit is refused.
    ``legacy``, a format read still, hashed the files alone."""

    meta_name: str  # e.g. manifest.json
    format: str  # e.g. coreply-bundle/2
    version: str  # the field that holds the version
    error: type[Exception]
    missing: str  # what ``root`` is not when it has no ``meta_name``
    digits: int = 64  # of the hash kept in ``version``
    provenance: tuple[str, ...] = ()
    legacy: str | None = None

    def version_of(self, meta: dict[str, Any], files: dict[str, str]) -> str:
        """The version ``meta`` (as parsed from its JSON) records for ``files``."""
        if meta.get("format") == self.legacy:
            return content_hash(files)[: self.digits]
        fields = {k: v for k, v in meta.items() if k not in ("files", self.version)}
        for path in self.provenance:
            fields = _without(fields, path.split("."))
        return content_hash({"files": files, "fields": fields})[: self.digits]


def _without(data: Any, path: list[str]) -> Any:
    """``data`` without the field at ``path``, if it has one (a copy along the path only)."""
    head, *rest = path
    if not isinstance(data, dict) or head not in data:
        return data
    if not rest:
        return {k: v for k, v in data.items() if k != head}
    return {**data, head: _without(data[head], rest)}


def seal(tmp: Path, final: Path, sealing: Sealing, meta: dict[str, Any]) -> dict[str, Any]:
    """Record every file's sha256 under ``files`` in ``meta`` and its version (:class:`Sealing`), write
    it as ``tmp/meta_name`` in ``sealing.format`` and move ``tmp`` to ``final``. Returns the meta."""
    files = hash_tree(tmp, sealing.meta_name)
    meta = json.loads(dumps({**meta, "format": sealing.format, "files": files}))  # as a reader parses it
    meta[sealing.version] = sealing.version_of(meta, files)
    write_json_atomic(tmp / sealing.meta_name, meta)
    check_replaceable(final, sealing.meta_name)
    replace_dir(tmp, final)
    return meta


def read_sealed(root: Path, sealing: Sealing, verify: bool = True) -> dict[str, Any]:
    """Read ``root/meta_name``; it must be a JSON object of the sealing's format (or its legacy one).
    With ``verify``, the files under ``root`` must be exactly those recorded and the version what they
    and the fields give. Any failure raises ``sealing.error`` naming the file."""
    path = root / sealing.meta_name
    if not path.is_file():
        raise sealing.error(f"{root}: {sealing.missing}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise sealing.error(f"{path}: not valid UTF-8 JSON ({exc}); rebuild it or restore a copy") from exc
    known = (sealing.format, sealing.legacy or sealing.format)
    if not isinstance(meta, dict) or meta.get("format") not in known:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise sealing.error(f"{path}: unsupported format {found!r}, expected {sealing.format!r}")
    if verify:
        recorded = meta.get("files", {})
        if problem := file_mismatch(root, recorded, sealing.meta_name):
            raise sealing.error(problem)
        if meta.get(sealing.version) != sealing.version_of(meta, recorded):
            raise sealing.error(
                f"{path}: {sealing.version} does not match the files and fields it records (edited by "
                "hand?); rebuild it or restore a copy"
            )
    return meta
