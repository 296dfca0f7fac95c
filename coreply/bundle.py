"""The serving bundle: everything the service needs, tied together by ``manifest.json``.

Layout::

    manifest.json     format, version, model hashes, index facts, build stats, sha256 of every file;
                      the version hashes the files and every other field (the choices a build made)
    bi/               bi-encoder checkpoint (context tower for queries, response tower for ``add``)
    cross/            cross-encoder checkpoint (absent for a retrieval-only bundle)
    onnx/             ONNX exports of both (fp32 or int8; absent when built with ``--onnx none``)
    index.faiss       FAISS index over the response embeddings; row i is response id i
    responses.jsonl   {"id": i, "text": ..., "metadata": {...}?} per line, in id order; metadata: the pool
                      file's other fields (a team's own id, intent, template), returned by /respond
    tokens/           with a cross-encoder: every response's word-piece ids (``ids.npy``, int32) and
                      where each starts (``offsets.npy``, N + 1), so requests never tokenise a response
    knowledge/        optional, with a reranker that reads knowledge: the knowledge retriever that picks
                      the top-m sentences for it (run on PyTorch; its pick is ``manifest.knowledge.top_m``)
    knowledge.json    optional: {"sentences": [...]}, the default knowledge (a persona, an operator's
                      facts) used when a request brings none
    prior.npy         optional: the response prior (float32, one value per response; its weight is
                      ``manifest.prior.alpha``), subtracted from retrieval scores (:mod:`coreply.prior`)
    lexical.json      optional: the pool's BM25 statistics for the lexical stage (its weight, depth and
                      query turns are ``manifest.lexical``; :mod:`coreply.lexical`)
    withdrawn.json    optional: {"ids": [...]}, responses the bundle no longer answers (``coreply index
                      withdraw``): they keep their rows, so every other id stays as it was

A bundle is written to a temporary directory and renamed into place, and is verified on load: every
file's sha256, the index dimension and count, the response count and the model hashes must agree with
the manifest, or :class:`BundleError` says which one does not.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from coreply.artifacts import Sealing, read_sealed, seal
from coreply.checkpoint_meta import CheckpointError, read_meta
from coreply.filters import MetadataIndex
from coreply.lexical import BM25
from coreply.lexical import Stage as LexicalStage
from coreply.prior import Prior
from coreply.restatement import Guard
from coreply.text import normalize, says_nothing

if TYPE_CHECKING:  # the ranking stages import torch: loaded where a bundle is served, not to read one
    from coreply.ranking import Allow, Hits, Pipeline

FORMAT = "coreply-bundle/2"
MANIFEST = "manifest.json"
INDEX = "index.faiss"
RESPONSES = "responses.jsonl"
TOKENS = "tokens"
KNOWLEDGE = "knowledge.json"
PRIOR = "prior.npy"
LEXICAL = "lexical.json"
WITHDRAWN = "withdrawn.json"
CALIBRATED = ("restatement", "prior", "lexical", "fusion")
"""The manifest entries that hold choices calibrated on held-out pairs when a bundle is built; each may
instead be pinned from another build's (``"pinned"``: which build; index_builder.build.pins_of)."""
MAX_WITHDRAWN = 1000
"""The most responses a bundle may withdraw: each one may hide a hit, so every search fetches that many
more; a pool that loses more is better rebuilt without them."""
BACKENDS = ("auto", "onnx", "torch", "torch-bf16")


class BundleError(ValueError):
    """A bundle that is missing, malformed, corrupted or inconsistent with its manifest."""


def write_responses(path: Path, texts: Sequence[str], metadata: Sequence[dict[str, Any]] = ()) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for i, text in enumerate(texts):
            record = {"id": i, "text": text} | ({"metadata": metadata[i]} if i < len(metadata) else {})
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_responses(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """The texts in id order and each one's metadata (``{}`` where none was given)."""
    texts, metadata = [], []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BundleError(f"{path}:{number}: invalid JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or record.get("id") != number - 1:
                raise BundleError(f"{path}:{number}: expected id {number - 1}")
            if not isinstance(record.get("text"), str):
                raise BundleError(f"{path}:{number}: field 'text' must be a string")
            if not isinstance(record.get("metadata", {}), dict):
                raise BundleError(f"{path}:{number}: field 'metadata' must be an object")
            texts.append(record["text"])
            metadata.append(record.get("metadata", {}))
    return texts, metadata


def pool_filters(root: Path) -> MetadataIndex:
    """The metadata of the bundle at ``root`` indexed for filters, read without loading its index or
    models (:attr:`Bundle.filters` is the same index of a loaded bundle)."""
    return MetadataIndex(read_responses(root / RESPONSES)[1])


def write_tokens(root: Path, ids: np.ndarray, offsets: np.ndarray) -> None:
    """``root/tokens/``: the responses' word-piece ids and offsets, in id order (:func:`flat_pieces`)."""
    (root / TOKENS).mkdir(exist_ok=True)
    np.save(root / TOKENS / "ids.npy", ids)
    np.save(root / TOKENS / "offsets.npy", offsets)


def read_tokens(root: Path, count: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The stored ids and offsets of ``count`` responses, or None for a bundle without them."""
    if not (root / TOKENS).is_dir():
        return None
    ids = np.load(root / TOKENS / "ids.npy", allow_pickle=False)
    offsets = np.load(root / TOKENS / "offsets.npy", allow_pickle=False)
    ok = offsets.ndim == 1 and len(offsets) == count + 1 and offsets[0] == 0 and offsets[-1] == len(ids)
    _check(
        bool(ok) and bool(np.all(np.diff(offsets) >= 0)), root, f"{TOKENS}/ does not fit {count} responses"
    )
    return ids, offsets


SEALING = Sealing(
    MANIFEST,
    FORMAT,
    "bundle_version",
    BundleError,
    f"not a coreply bundle (no {MANIFEST}); build one with `coreply index`",
    digits=16,
    provenance=("build", "models.bi.source", "models.cross.source"),  # when, where, from which path
    legacy="coreply-bundle/1",  # its version hashed the files alone, not the choices
)


def finish(tmp: Path, final: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Seal a bundle being written in ``tmp`` (file hashes, version, manifest) and move it to ``final``."""
    return seal(tmp, final, SEALING, manifest)


def read_manifest(root: Path, verify: bool = True) -> dict[str, Any]:
    """Read ``manifest.json`` and, by default, check every file's sha256 and the version against it."""
    return read_sealed(root, SEALING, verify)


@dataclass
class Bundle:
    """A loaded, verified bundle: manifest, FAISS index and response texts (row i = id i)."""

    root: Path
    manifest: dict[str, Any]
    index: Any  # faiss.Index
    texts: list[str]
    keys: list[str]  # normalised texts, for echo / exclude filtering
    tokens: tuple[np.ndarray, np.ndarray] | None = None  # the reranker's response ids, offsets
    metadata: list[dict[str, Any]] = field(default_factory=list)  # per id; {} where none was given
    knowledge: list[str] = field(default_factory=list)  # the default knowledge sentences
    prior: Prior | None = None
    lexical: LexicalStage | None = None
    withdrawn: frozenset[int] = frozenset()  # ids never answered (:data:`WITHDRAWN`)

    @property
    def version(self) -> str:
        return self.manifest["bundle_version"]

    @property
    def has_cross(self) -> bool:
        return self.manifest["models"].get("cross") is not None

    def model_dir(self, kind: str) -> Path:
        return self.root / kind

    @cached_property
    def rows(self) -> dict[str, int]:
        """Pool text -> id, made on first use and shared by what looks texts up in the pool: the
        reranker's tokenizer (stored ids) and :class:`IndexRetriever` (stored vectors)."""
        return {text: i for i, text in enumerate(self.texts)}

    @cached_property
    def filters(self) -> MetadataIndex:
        """The pool's metadata fields indexed for filters (:mod:`coreply.filters`), made on first use."""
        return MetadataIndex(self.metadata)


def apply_search_params(index, params: str) -> None:
    """``params`` like ``nprobe=16`` (IVF) or ``efSearch=128`` (HNSW), each a number > 0; empty = FAISS
    defaults."""
    if not params:
        return
    import faiss

    for part in params.split(","):
        name, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"--search-params {params!r}: {part!r} is not NAME=VALUE, e.g. efSearch=128")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and number > 0):
            raise ValueError(f"--search-params {params!r}: {name.strip()} needs a number > 0, not {value!r}")
    try:
        faiss.ParameterSpace().set_index_parameters(index, params)
    except RuntimeError as exc:  # FAISS says where, then ":" and what
        detail = str(exc).rsplit(":", 1)[-1].strip()
        raise ValueError(f"--search-params {params!r} do not fit this index: {detail}") from exc


def _check(condition: bool, root: Path, message: str) -> None:
    if not condition:
        raise BundleError(f"{root}: {message}")


def load_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Load and verify a bundle (see the module docstring for what is checked)."""
    import faiss

    root = Path(path)
    manifest = read_manifest(root, verify)
    info = manifest["index"]
    for kind, model in manifest["models"].items():
        if model is None:
            continue
        try:
            meta = read_meta(root / kind, verify=False)  # files already checked against the manifest
        except CheckpointError as exc:
            raise BundleError(str(exc)) from exc
        _check(
            meta["content_hash"] == model["content_hash"],
            root,
            f"{kind}/ model hash {meta['content_hash'][:12]} is not the one the index was built with "
            f"({model['content_hash'][:12]})",
        )
    index = faiss.read_index(str(root / INDEX))
    texts, metadata = read_responses(root / RESPONSES)
    _check(index.d == info["dim"], root, f"index dimension {index.d} != manifest dim {info['dim']}")
    _check(
        index.ntotal == info["count"],
        root,
        f"index holds {index.ntotal} vectors, manifest says {info['count']}",
    )
    _check(
        len(texts) == info["count"],
        root,
        f"{RESPONSES} holds {len(texts)} responses, manifest says {info['count']}",
    )
    apply_search_params(index, info.get("search_params", ""))
    tokens = read_tokens(root, len(texts))
    knowledge = read_knowledge(root)
    prior = None
    if manifest.get("prior"):
        values = np.load(root / PRIOR, allow_pickle=False)
        ok = values.shape == (len(texts),) and values.dtype == np.float32 and bool(np.isfinite(values).all())
        _check(ok, root, f"{PRIOR} must hold one finite float32 per response ({len(texts)})")
        prior = Prior(float(manifest["prior"]["alpha"]), values)
    keys = [normalize(t) for t in texts]
    lexical = read_lexical(root, manifest, len(texts))
    withdrawn = read_withdrawn(root, manifest, len(texts))
    return Bundle(root, manifest, index, texts, keys, tokens, metadata, knowledge, prior, lexical, withdrawn)


def write_lexical(root: Path, bm25: BM25) -> None:
    with open(root / LEXICAL, "w", encoding="utf-8") as fh:
        json.dump(bm25.to_json(), fh, ensure_ascii=False)


def read_lexical(root: Path, manifest: dict[str, Any], count: int) -> LexicalStage | None:
    """The lexical stage ``manifest.lexical`` describes, over the BM25 statistics of ``count`` responses
    in ``lexical.json`` (None for a bundle without one)."""
    entry = manifest.get("lexical")
    if not entry:
        return None
    try:
        bm25 = BM25.from_json(json.loads((root / LEXICAL).read_text(encoding="utf-8")))
    except (OSError, ValueError) as exc:  # a JSONDecodeError too
        raise BundleError(f"{root}: {LEXICAL}: {exc}") from exc
    _check(bm25.docs == count, root, f"{LEXICAL} describes {bm25.docs} responses, the pool holds {count}")
    weight, depth, turns = entry.get("weight"), entry.get("depth"), entry.get("turns")
    ok = isinstance(weight, (int, float)) and 0 <= weight <= 1
    ok = ok and all(isinstance(n, int) and n >= 1 for n in (depth, turns))
    _check(ok, root, "manifest 'lexical' needs a weight in [0, 1] and depth, turns >= 1")
    return LexicalStage(bm25, float(weight), depth, turns)


def write_withdrawn(root: Path, ids: frozenset[int]) -> None:
    with open(root / WITHDRAWN, "w", encoding="utf-8") as fh:
        json.dump({"ids": sorted(ids)}, fh)


def read_withdrawn(root: Path, manifest: dict[str, Any], count: int) -> frozenset[int]:
    """The ids of ``count`` responses that ``manifest.withdrawn`` says are withdrawn (none without it)."""
    entry = manifest.get("withdrawn")
    if not entry:
        return frozenset()
    try:
        data = json.loads((root / WITHDRAWN).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # a JSONDecodeError too
        raise BundleError(f"{root}: {WITHDRAWN}: {exc}") from exc
    ids = data.get("ids") if isinstance(data, dict) else None
    ok = isinstance(ids, list) and all(type(i) is int and 0 <= i < count for i in ids)
    ok = ok and len(set(ids)) == len(ids) == entry.get("count") and len(ids) <= MAX_WITHDRAWN
    need = f"{{'ids': [...]}}: the manifest's count of distinct ids below {count}"
    _check(ok, root, f"{WITHDRAWN} must hold {need}")
    return frozenset(ids)


def write_knowledge(root: Path, sentences: Sequence[str]) -> None:
    with open(root / KNOWLEDGE, "w", encoding="utf-8") as fh:
        json.dump({"sentences": list(sentences)}, fh, ensure_ascii=False, indent=1)


def read_knowledge(root: Path) -> list[str]:
    """The bundle's default knowledge sentences ([] when it has none)."""
    if not (root / KNOWLEDGE).is_file():
        return []
    data = json.loads((root / KNOWLEDGE).read_text(encoding="utf-8"))
    sentences = data.get("sentences") if isinstance(data, dict) else None
    ok = isinstance(sentences, list) and all(isinstance(t, str) and t.strip() for t in sentences)
    _check(ok, root, f"{KNOWLEDGE} must hold {{'sentences': [non-blank strings]}}")
    return sentences  # type: ignore[return-value]


SEARCH_BLOCK = 256
"""Queries an exact torch search scores at once: a [256, N] float32 block (127 MB for the default pool)."""


@dataclass(frozen=True)
class FirstPass:
    """A low-precision copy of the pool that picks an exact search's candidates (:meth:`TorchExactIndex.
    _two_pass`) for blocks of ``min_queries`` to ``max_queries`` queries. ``error``: the most it may get
    wrong a score between a unit query and a pool vector scaled to norm at most 1. Rounding both to the
    dtype (u each, u = 2^-11 for fp16, 2^-8 for bf16), the product's rounding to it (u) and float32
    accumulation (about 2e-5) add up to 3u: fp16's 2^-8 leaves three times that, bf16's 2^-6 a third
    more."""

    dtype: str
    max_queries: int
    error: float
    min_queries: int = 1


FP16_PASS = FirstPass("float16", 4, 2.0**-8)
"""A lone query is bound by memory: fp16 reads half the bytes (docs/performance.md section 16). Up to 4
queries where bf16 is not fast (beyond that fp16's matmul is no faster than float32's), 2 where it is."""

BF16_PASS = FirstPass("bfloat16", SEARCH_BLOCK, 2.0**-6)
"""On a CPU with bf16 dot products (AVX-512 BF16, AMX) a block of queries multiplies about three times
faster in bf16 than in float32 (docs/performance.md section 16)."""

AMX_PASS = replace(BF16_PASS, min_queries=2)
"""On a CPU with AMX tiles, bf16 for blocks of two queries or more: a lone query searches faster in one
float32 pass once the pool is not in cache, as served (docs/performance.md section 27)."""


@dataclass
class _LowCopy:
    """One first pass over an index: the pool over its largest norm in ``first.dtype`` [N, D], and how
    many queries it has served and, of those, how many it could not tell and were searched again."""

    first: FirstPass
    pool: Any
    queries: int = 0
    again: int = 0

    def takes(self, queries: int) -> bool:
        """Whether this pass is for a block of this many queries."""
        return self.first.min_queries <= queries <= self.first.max_queries

    def pays(self) -> bool:
        """Whether to keep using it: past 256 queries, at most one in eight searched again. Pools whose
        scores sit closer than the pass's error (random unit vectors under bf16: 2-3 times slower than
        one float32 pass) stop using it."""
        return self.queries < 256 or 8 * self.again <= self.queries


class TorchExactIndex:
    """Exact inner-product search as one matmul and a top-k on a torch device, over ``vectors`` [N, D]
    (any float dtype; scores come back as float32). Same ``search`` / ``ntotal`` / ``reconstruct_batch``
    contract as a FAISS index (:meth:`of` copies one). On a GPU host it keeps the search off the host CPU;
    on a CPU it gains from batching where FAISS's flat search does not (docs/performance.md section 9:
    one thread, 124,141 x 384, a batch of 64 queries 1.0 ms a query against FAISS's 14), its float32
    matmul goes through numpy's BLAS (:meth:`_scores`), and where it pays the queries are searched in two
    passes, low precision then float32 (:meth:`_two_pass`)."""

    def __init__(self, vectors: Any, passes: Sequence[FirstPass] | None = None) -> None:
        """``passes``: the first passes of :meth:`_two_pass` on a CPU with float32 vectors, each for blocks
        of its ``min_queries`` to ``max_queries``; by default what suits this CPU as served: where it
        has AMX tiles bf16 for blocks of two or more and one float32 pass for a lone query, else fp16
        for a few queries and, where it has bf16 dot products, bf16 for larger blocks; () searches in
        one float32 pass always (``bench/search_kernels.py`` compares them, ``--cold`` as served)."""
        import torch

        from coreply.device import cpu_has_amx, cpu_has_bf16_dot, one_openmp_thread

        self.vectors = vectors  # torch.Tensor [N, D]
        self.ntotal = len(vectors)
        self._helpers = ThreadPoolExecutor(thread_name_prefix="exact-search", initializer=one_openmp_thread)
        self._scale = float(vectors.norm(dim=1).max()) if len(vectors) else 0.0
        cpu_fp32 = vectors.device.type == "cpu" and vectors.dtype == torch.float32
        if passes is None:
            if cpu_has_amx():
                passes = [AMX_PASS]
            elif cpu_has_bf16_dot():
                passes = [replace(FP16_PASS, max_queries=2), BF16_PASS]
            else:
                passes = [FP16_PASS]
        # one _LowCopy per first pass, the one for the smallest blocks first
        self._passes: list[_LowCopy] = []
        if cpu_fp32 and 0 < self._scale < float("inf"):
            unit = vectors / self._scale
            for first in sorted(passes, key=lambda first: first.max_queries):
                self._passes.append(_LowCopy(first, unit.to(getattr(torch, first.dtype))))

    @classmethod
    def of(cls, index: Any, device: str) -> TorchExactIndex:
        """A copy of a FAISS index's vectors on ``device``."""
        import torch

        return cls(torch.from_numpy(index.reconstruct_n(0, index.ntotal)).to(device))

    def reconstruct_batch(self, ids: np.ndarray) -> np.ndarray:
        """[n] ids -> their vectors [n, D] (float32, on the CPU)."""
        import torch

        return self.vectors[torch.as_tensor(ids, device=self.vectors.device)].float().cpu().numpy()

    def search(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """queries [Q, D] (array or tensor) -> (scores [Q, k], ids [Q, k]), best first; k is capped at
        ntotal. Queries go in blocks of :data:`SEARCH_BLOCK`, so thousands keep memory flat."""
        return self._search(queries, min(k, self.ntotal), None)

    def search_within(self, queries: np.ndarray, k: int, allow: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """queries [Q, D] -> each one's best ``k`` among the rows its ``allow`` [Q, N] (bool) sets,
        (scores, ids) [Q, min(k, most rows allowed)], -1 past a query's last allowed row: the passes
        :meth:`search` makes, the rows a query may not answer masked in each, as fast for a narrow filter
        as for a broad one."""
        return self._search(queries, min(k, int(allow.sum(1).max())), allow)

    def _search(self, queries: Any, k: int, allow: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`search`, or with ``allow`` [Q, N] :meth:`search_within`, for a ``k`` already capped."""
        import torch

        if k == 0:  # an empty pool, or a filter that allows nothing
            return np.zeros((len(queries), 0), dtype="float32"), np.zeros((len(queries), 0), dtype="int64")
        scores, ids = [], []
        with torch.inference_mode():
            q = torch.as_tensor(queries).to(self.vectors.device, self.vectors.dtype)
            barred = None if allow is None else torch.from_numpy(~allow).to(self.vectors.device)  # [Q, N]
            for start in range(0, len(q), SEARCH_BLOCK):
                block = q[start : start + SEARCH_BLOCK]  # [B, D]
                mask = None if barred is None else barred[start : start + SEARCH_BLOCK]  # [B, N]
                low = next((c for c in self._passes if c.takes(len(block))), None)
                if low is not None and low.pays() and 2 * k + 64 < self.ntotal:
                    values, indices = self._two_pass(block, k, low, mask)
                else:
                    values, indices = torch.topk(_barring(self._scores(block), mask), k, dim=1)  # [B, k] x2
                if mask is not None:
                    indices = indices.where(values > -math.inf, -1)
                scores.append(values.float().cpu().numpy())
                ids.append(indices.cpu().numpy())
        return np.concatenate(scores), np.concatenate(ids)

    def _two_pass(self, queries: Any, k: int, low: _LowCopy, barred: Any = None) -> tuple[Any, Any]:
        """queries [B, D] -> their exact top k, (scores [B, k], ids [B, k]), in two passes: the 2k + 64
        best by ``low``, the pool in low precision, re-scored in float32. The top k of those is the
        exact one when its last score beats, by more than ``low.first.error``, the best any vector
        outside them can reach, or when they hold every row not ``barred`` [B, N] (bool; -inf scores
        the barred rows in both passes); the queries where neither holds are searched again in one
        float32 pass. Same results as one float32 pass (ties may come in another order, as they may from
        one top-k to the next), a lone query about twice as fast, a block of 64 about three times, on an
        AMD EPYC (docs/performance.md section 16)."""
        import torch

        depth = 2 * k + 64
        norms = queries.norm(dim=1, keepdim=True)  # [B, 1]
        unit = (queries / norms).to(low.pool.dtype)  # [B, D]

        def coarse(rows: slice) -> tuple[Any, Any]:  # a slice's best: ([B, depth], [B, depth] pool ids)
            part = _barring(unit @ low.pool[rows].T, None if barred is None else barred[:, rows])  # [B, n]
            top = torch.topk(part, min(depth, rows.stop - rows.start), dim=1)
            return top.values, top.indices + rows.start

        # On the helper threads, where torch runs on one OpenMP thread (coreply.device.one_openmp_thread):
        # torch's own workers would spin for milliseconds after the matmul, on the cores the next stage
        # needs (the reranker 70 -> 74 ms a request, docs/performance.md section 16).
        parts = [done.result() for done in [self._helpers.submit(coarse, rows) for rows in self._slices()]]
        best = torch.topk(torch.cat([v for v, _ in parts], dim=1), depth, dim=1)  # [B, depth] x2
        chosen = torch.cat([ids for _, ids in parts], dim=1).gather(1, best.indices)  # [B, depth]
        # A vector outside the candidates scores at most (the last candidate's + error), scaled back.
        reach = (best.values[:, -1].float() + low.first.error) * norms[:, 0] * self._scale  # [B]
        pool = self.vectors.numpy()
        values, indices = torch.empty(len(queries), k), torch.empty(len(queries), k, dtype=torch.long)
        outside = best.values.isneginf()  # [B, depth]: barred rows, where fewer rows than depth are not
        for row, query in enumerate(queries.numpy()):
            exact = torch.from_numpy(pool[chosen[row].numpy()] @ query).masked_fill_(outside[row], -math.inf)
            top = torch.topk(exact, k)  # [k] x2
            values[row], indices[row] = top.values, chosen[row, top.indices]
        # [B]: the margin too small (or NaN), unless the candidates hold every row the query may answer
        uncertain = ~((values[:, -1] > reach) | outside[:, -1])
        low.queries, low.again = low.queries + len(queries), low.again + int(uncertain.sum())
        if uncertain.any():  # those queries over the whole pool in float32, together
            again = self._scores(queries[uncertain])  # [U, N]
            again = _barring(again, None if barred is None else barred[uncertain])
            values[uncertain], indices[uncertain] = torch.topk(again, k, dim=1)
        return values, indices

    def _scores(self, queries: Any) -> Any:
        """queries [B, D] -> scores [B, N]. In float32 on a CPU, numpy's BLAS on one thread scores a slice
        of the pool on each of torch's intra-op threads (:func:`coreply.device.set_threads`): on an AMD
        EPYC about twice as fast as the MKL matmul torch calls, and unlike OpenBLAS's own threads these
        sleep when idle instead of spinning on the cores the next stage needs (docs/performance.md
        section 15). A lone query's scores (a matrix-vector product) may differ from the same query's in
        a batch in the last bits, as they did with torch's matmul."""
        import torch

        if self.vectors.device.type != "cpu" or self.vectors.dtype != torch.float32:
            return queries @ self.vectors.T
        q, pool = queries.numpy(), self.vectors.numpy()  # [B, D], [N, D]
        out = np.empty((len(pool), len(q)), dtype="float32")  # [N, B]: pool-major, faster at B 2-16

        def score(rows: slice) -> None:
            np.matmul(pool[rows], q.T, out=out[rows])

        slices = self._slices()
        helpers = [self._helpers.submit(score, rows) for rows in slices[1:]]
        score(slices[0])
        for done in helpers:
            done.result()
        return torch.from_numpy(out).T  # [B, N]

    def _slices(self) -> list[slice]:
        """The pool cut into one slice per torch intra-op thread."""
        import torch

        cuts = np.linspace(0, self.ntotal, max(1, min(torch.get_num_threads(), self.ntotal)) + 1).astype(int)
        return [slice(a, b) for a, b in pairwise(cuts)]


def _barring(scores: Any, barred: Any) -> Any:
    """scores [B, n], -inf written in place where ``barred`` [B, n] (bool) is set (every caller's scores
    are a fresh tensor); unchanged where ``barred`` is None."""
    return scores if barred is None else scores.masked_fill_(barred, -math.inf)


EXACT_WITHIN = 16_384
"""An approximate index searches a query whose filter allows at most this many rows exactly, over their
stored vectors (about half a microsecond a row on a 2-vCPU host: 6 ms for 12,415), and one whose filter
allows more through its own search restricted to those rows, as approximate as its unfiltered search:
for half of the default pool in an ``IVF1024,Flat`` index 1.2 ms instead of 31 (docs/performance.md
section 42)."""


def search_within(
    index: Any, queries: np.ndarray, k: int, allow: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """queries [Q, D] -> each one's best ``k`` among the rows its ``allow`` [Q, N] (bool) sets, (scores,
    ids) [Q, min(k, most rows allowed)], -1 past a query's last allowed row. An exact index masks the
    passes of its search (:meth:`TorchExactIndex.search_within`). An approximate FAISS index (read back
    with :func:`make_readable`) scores a query's allowed rows' stored vectors, exactly, where its filter
    allows at most :data:`EXACT_WITHIN`; where it allows more, an IVF or HNSW index searches as it
    would unfiltered, restricted to them (FAISS's ``IDSelectorBitmap``), and a query that comes back
    short is searched exactly, so no filter leaves an answer short while allowed rows remain."""
    if isinstance(index, TorchExactIndex):
        return index.search_within(queries, k, allow)
    k = min(k, int(allow.sum(1).max()))
    scores = np.full((len(queries), k), -np.inf, dtype="float32")
    ids = np.full((len(queries), k), -1, dtype="int64")
    for i, row in enumerate(allow):
        count = int(row.sum())
        want = min(k, count)
        restricted = _restricted(index, row) if count > EXACT_WITHIN else None
        if restricted is not None:
            got, at = index.search(queries[i : i + 1], want, params=restricted[0])  # [1, want] x2
            if (at >= 0).all():
                scores[i, :want], ids[i, :want] = got[0], at[0]
                continue
        rows = np.flatnonzero(row)  # [count]
        got = index.reconstruct_batch(rows) @ queries[i]  # [count]
        best = np.argsort(-got, kind="stable")[:k]  # [want]
        scores[i, :want], ids[i, :want] = got[best], rows[best]
    return scores, ids


def _restricted(index: Any, allowed: np.ndarray) -> tuple[Any, ...] | None:
    """(FAISS search parameters that restrict ``index``'s own search to the rows ``allowed`` [N] (bool)
    sets, with the settings it searches with, then what they point to, to be kept alive while they are
    used), or None for an index other than IVF or HNSW."""
    import faiss

    if not isinstance(index, (faiss.IndexIVF, faiss.IndexHNSW)):
        return None
    bits = np.packbits(allowed, bitorder="little")  # [ceil(N / 8)]: row i is bit i % 8 of byte i // 8
    selector = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))  # its size in bytes
    if isinstance(index, faiss.IndexIVF):
        params = faiss.SearchParametersIVF(sel=selector, nprobe=index.nprobe, max_codes=index.max_codes)
    else:
        params = faiss.SearchParametersHNSW(sel=selector, efSearch=index.hnsw.efSearch)
    return params, selector, bits


def searcher(index: Any, factory: str, device: str) -> Any:
    """What searches ``index`` (built by the FAISS ``factory``): an exact one as a :class:`TorchExactIndex`
    on ``device`` (the CPU included), an approximate one (IVF, HNSW, ...) itself, in FAISS on the CPU."""
    return TorchExactIndex.of(index, device) if factory == "Flat" else index


def search_on(bundle: Bundle, device: str) -> Bundle:
    """The bundle with its index searched as :func:`searcher` says."""
    return replace(bundle, index=searcher(bundle.index, bundle.manifest["index"]["factory"], device))


def make_backend(
    bundle: Bundle, backend: str = "auto", threads: int = 1, device: str = "cpu", packed: bool = True
):
    """The bundle's models behind :class:`coreply.inference.Backend`: ``onnx`` (needs ``onnx/`` in the
    bundle), ``torch``, ``torch-bf16`` (on a CPU the weights cast to bf16), or ``auto`` (ONNX when
    exported, else PyTorch). ``packed``: let PyTorch run batches without padding where it pays (CUDA)."""
    from coreply.checkpoint import load_checkpoint, load_dialogue_tokenizer
    from coreply.device import set_threads
    from coreply.inference import OnnxBackend, TorchBackend

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    has_onnx = bundle.manifest.get("onnx") is not None
    if backend == "onnx" and not has_onnx:
        raise BundleError(f"{bundle.root}: has no ONNX export (built with --onnx none); use --backend torch")
    set_threads(threads)
    if backend.startswith("torch") or not has_onnx:
        bi = load_checkpoint(bundle.model_dir("bi"), device, expect="bi")
        cross = (
            load_checkpoint(bundle.model_dir("cross"), device, expect="cross") if bundle.has_cross else None
        )
        chosen = TorchBackend(  # type: ignore[arg-type]
            bi, cross, bf16=backend == "torch-bf16", packed=None if packed else False
        )
    else:
        chosen = OnnxBackend(
            bundle.root / "onnx",
            load_dialogue_tokenizer(bundle.model_dir("bi")),
            load_dialogue_tokenizer(bundle.model_dir("cross")) if bundle.has_cross else None,
            bundle.manifest["index"]["dim"],
            threads=threads,
            cuda=device.startswith("cuda"),
        )
    if bundle.tokens is not None and chosen.cross_tokenizer is not None:
        chosen.cross_tokenizer.attach(bundle.rows, *bundle.tokens)
    if chosen.reads_knowledge and bundle.manifest["models"].get("knowledge"):
        from coreply.knowledge import KnowledgeSelector

        retriever = load_checkpoint(bundle.model_dir("knowledge"), device, expect="bi")
        chosen.select_knowledge = KnowledgeSelector(retriever, int(bundle.manifest["knowledge"]["top_m"]))
        chosen.select_knowledge.vectors.warm(bundle.knowledge)
    return chosen


class IndexRetriever:
    """:class:`coreply.ranking.Retriever` over a bundle: encode the contexts with a backend, search the
    index (with a ``prior``: at least :data:`~coreply.prior.DEPTH` hits, rescored). ``timings`` holds the
    last call's seconds per stage (the service reports them). With a Poly-encoder backend the hits carry
    its context codes. :meth:`vectors` reads candidates' response vectors back from the index (the poly
    stage's cache; the restatement guard compares them with :meth:`encode_responses` of the context
    turns). ``rows``: pool text -> id (:attr:`Bundle.rows`), given where the index stores its vectors
    whole, so that :meth:`encode_responses` reads a pool text's vector back instead of encoding it again."""

    def __init__(
        self, backend: Any, index: Any, prior: Prior | None = None, rows: Mapping[str, int] | None = None
    ) -> None:
        self.backend, self.index = backend, index
        self.prior = prior if prior is not None and prior.alpha else None
        self.timings: dict[str, float] = {}
        self.rows = rows or {}

    def __call__(self, contexts: Sequence[Sequence[str]], k: int, allow: Allow = None) -> Hits:
        """The best ``k`` hits of each context, within its ``allow`` rows where it has them (see
        :func:`search_within`; -1 pads a row that has fewer)."""
        start = time.perf_counter()
        codes = None
        if self.backend.poly_codes:
            both = self.backend.encode_context_codes(contexts)  # [B, 1 + m, D]
            queries, codes = both[:, 0], both[:, 1:]
        else:
            queries = self.backend.encode_contexts(contexts)  # [B, D]
        encoded = time.perf_counter()
        queries = np.ascontiguousarray(queries, dtype="float32")
        if allow is None:
            scores, ids = self._search(self.index.search, queries, k, self.index.ntotal)  # [B, k] x2
        else:
            scores, ids = self._within(queries, k, allow)  # [B, k] x2
        self.timings = {"encode": encoded - start, "search": time.perf_counter() - encoded}
        from coreply.ranking import Hits

        return Hits(ids, scores, codes)

    def _search(self, search: Any, queries: np.ndarray, k: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The best ``k`` of a pool of ``size`` by ``search``, rescored by the prior if there is one."""
        if self.prior is None:
            return search(queries, min(k, size))
        return self.prior.search(search, queries, k, size)

    def _within(self, queries: np.ndarray, k: int, allow: Sequence[np.ndarray | None]) -> tuple[Any, Any]:
        """queries [B, D] -> (scores, ids) [B, k], -1 padding: those with no ``allow`` searched together
        over the pool, the others together, each within its own rows."""
        scores = np.full((len(queries), k), -np.inf, dtype="float32")
        ids = np.full((len(queries), k), -1, dtype="int64")
        whole = [i for i, rows in enumerate(allow) if rows is None]
        some = [i for i, rows in enumerate(allow) if rows is not None]
        searches = [(whole, self.index.search, self.index.ntotal)] if whole else []
        if some:
            masks = np.stack([allow[i] for i in some])  # [F, N]
            searches.append((some, partial(search_within, self.index, allow=masks), int(masks.sum(1).max())))
        for rows, search, size in searches:
            got, at = self._search(search, queries[rows], k, size)  # [len(rows), <= k] x2
            scores[rows, : at.shape[1]], ids[rows, : at.shape[1]] = got, at
        return scores, ids

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """[n] pool ids -> [n, D], as stored in the index."""
        return self.index.reconstruct_batch(np.asarray(ids, dtype="int64"))

    def encode_responses(self, texts: Sequence[str]) -> np.ndarray:
        """[n] texts -> [n, D] by the retriever's response tower. A text the pool holds verbatim (most
        context turns: a conversation's earlier replies are pool responses) comes back as the vector the
        index stores for it, which the same graph wrote from the same text at build time: the same floats
        without running the encoder (docs/performance.md §23)."""
        at = np.array([self.rows.get(text, -1) for text in texts], dtype="int64")  # [n], -1: not held
        known = at >= 0
        if not known.any():
            return self.backend.encode_responses(texts)
        stored = self.vectors(at[known])  # [k, D]
        out = np.empty((len(texts), stored.shape[1]), dtype="float32")  # [n, D]
        out[known] = stored
        if not known.all():
            new = [text for text, held in zip(texts, known, strict=True) if not held]
            out[~known] = self.backend.encode_responses(new)
        return out


def make_readable(index: Any, root: Path) -> None:
    """Make sure response vectors can be read back from ``index`` (an IVF index needs its direct map; a
    product-quantised one hands back its approximations, as its search uses them)."""
    if isinstance(index, TorchExactIndex):
        return
    import faiss

    with contextlib.suppress(RuntimeError):  # raised for an index that is not IVF
        faiss.extract_index_ivf(index).make_direct_map()
    try:
        index.reconstruct(0)
    except RuntimeError as exc:
        raise BundleError(
            f"{root}: cannot read response vectors back from this index ({exc}); the poly stage and the "
            "restatement guard need them"
        ) from exc


def rerank_stage(manifest: dict[str, Any]) -> str | None:
    """The rerank stage a bundle's :func:`pipeline` gets: ``cross`` when it has a cross-encoder, else
    ``poly`` when its retriever is a Poly-encoder, else None (retrieval only)."""
    if manifest["models"].get("cross"):
        return "cross"
    return "poly" if manifest["models"]["bi"]["model_config"].get("poly_codes") else None


def default_fusion(manifest: dict[str, Any]) -> str:
    """The fusion a request gets unless it names one: with a rerank stage the one the bundle was
    calibrated with (a residual reranker's sum), else z-score; without, retrieval."""
    return manifest.get("fusion", {}).get("default", "zscore") if rerank_stage(manifest) else "retrieval"


def pipeline(bundle: Bundle, backend: Any, index: Any = None) -> Pipeline:
    """The bundle's ranking pipeline on ``backend`` (over ``index``, default the bundle's own), with the
    z-score weight, rerank gate and reach and restatement guard it was calibrated with, and the rerank
    stage of :func:`rerank_stage`. Bundles built before the gate have none (every default request
    reranks), and before the reach none (a default request that reranks reads every candidate). A reply
    that says nothing (:func:`~coreply.text.says_nothing`: "...", "?") is never answered."""
    from coreply.ranking import ZSCORE_WEIGHT, Pipeline

    fusion = bundle.manifest.get("fusion", {})
    weight = float(fusion.get("zscore_weight", ZSCORE_WEIGHT))
    gate = fusion.get("gate", {}).get("margin")
    reach = fusion.get("reach", {}).get("margin")
    guard = bundle.manifest.get("restatement")
    index = bundle.index if index is None else index
    if guard or (backend.poly_codes and not backend.has_cross) or bundle.filters.fields:
        make_readable(index, bundle.root)  # and the filters' index, made here: before the first request
    # an exact index (:func:`searcher`'s test) holds the vectors as encoded, an approximate one may not;
    # a bundle still being built has no index entry yet
    exact = bundle.manifest.get("index", {}).get("factory") == "Flat"
    retrieve = IndexRetriever(backend, index, bundle.prior, bundle.rows if exact else None)
    score = backend.score_pairs if backend.has_cross else None
    return Pipeline(
        retrieve,
        bundle.texts,
        bundle.keys,
        score,
        weight,
        poly=bool(backend.poly_codes),
        select_knowledge=backend.select_knowledge,
        reads_knowledge=backend.reads_knowledge,
        guard=Guard.of(guard) if guard else None,
        lexical=bundle.lexical,
        gate=None if gate is None else float(gate),
        withdrawn=bundle.withdrawn,
        reach=None if reach is None else float(reach),
        passed_over=frozenset(i for i, text in enumerate(bundle.texts) if says_nothing(text)),
    )
