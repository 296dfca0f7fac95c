"""FAISS index construction for the response pool: exact inner product by default, any factory string
(IVF, HNSW, PQ, SQ8, ...) by flag; trained on a seeded sample, built on GPU when FAISS sees one and kept
in CPU form for saving."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coreply.bundle import apply_search_params

EXACT = "Flat"


def empty_index(dim: int, factory: str):
    """An untrained, empty CPU index for ``factory``; a ValueError names a string FAISS cannot build."""
    import faiss

    try:
        return faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ValueError(f"--factory {factory!r}: FAISS cannot build it: {first_line(exc)}") from exc


def check_index_spec(dim: int, count: int, factory: str, search_params: str) -> None:
    """Refuse, before a pool is encoded, what would only fail after it: a factory string FAISS cannot
    build, search parameters that do not fit it, or more inverted lists than there are responses."""
    import faiss

    index = empty_index(dim, factory)
    apply_search_params(index, search_params)
    try:
        lists = faiss.extract_index_ivf(index).nlist
    except RuntimeError:  # not an IVF index
        return
    if lists > count:
        raise ValueError(f"--factory {factory!r}: {lists} inverted lists for {count} responses; use fewer")


def make_index(
    vectors: np.ndarray, factory: str = EXACT, train_size: int = 100_000, seed: int = 0, gpu: bool = True
):
    """vectors [N, D] float32 -> a CPU ``faiss.Index`` (inner-product metric) holding them as ids 0..N-1."""
    import faiss

    n, dim = vectors.shape
    index = empty_index(dim, factory)
    on_gpu = False
    if gpu and faiss.get_num_gpus() > 0:
        try:
            index = faiss.index_cpu_to_all_gpus(index)
            on_gpu = True
        except (RuntimeError, AttributeError):  # e.g. HNSW has no GPU version: build on CPU
            pass
    if not index.is_trained:
        rng = np.random.default_rng(seed)
        sample = vectors[np.sort(rng.choice(n, size=min(n, train_size), replace=False))]
        try:
            index.train(sample)
        except RuntimeError as exc:
            raise ValueError(
                f"FAISS could not train {factory!r} on {len(sample)} vectors (too few for its lists or "
                f"codebooks?): {first_line(exc)}"
            ) from exc
    index.add(np.ascontiguousarray(vectors, dtype="float32"))
    return faiss.index_gpu_to_cpu(index) if on_gpu else index


def recall_vs_exact(
    index, vectors: np.ndarray, queries: np.ndarray, ks: Sequence[int] = (1, 10, 100)
) -> dict[str, float]:
    """Mean overlap of the index's top k with exact inner-product search's top k, for each k."""
    import faiss

    exact = faiss.IndexFlatIP(vectors.shape[1])
    exact.add(vectors)
    top = min(max(ks), index.ntotal)
    _, approx_ids = index.search(queries, top)  # [Q, top]
    _, exact_ids = exact.search(queries, top)
    out = {}
    for k in ks:
        k = min(k, top)
        overlap = [len(set(a[:k]) & set(e[:k])) / k for a, e in zip(approx_ids, exact_ids, strict=True)]
        out[f"recall@{k}"] = round(float(np.mean(overlap)), 4)
    return out


def first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
