"""Build a serving bundle (see :mod:`coreply.bundle`) and add responses to one.

Encoding uses the backend the service will use (ONNX when exported, on CPU), so query and pool
embeddings come from the same graph; on CUDA it runs the PyTorch models under bf16 autocast."""

from __future__ import annotations

import datetime as dt
import logging
import platform
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from coreply import lexical, prior, restatement
from coreply.artifacts import changes, link_or_copy, staging
from coreply.bundle import (
    CALIBRATED,
    INDEX,
    LEXICAL,
    MANIFEST,
    PRIOR,
    RESPONSES,
    TOKENS,
    Bundle,
    apply_search_params,
    finish,
    load_bundle,
    make_backend,
    pipeline,
    searcher,
    write_knowledge,
    write_lexical,
    write_responses,
    write_tokens,
)
from coreply.checkpoint import load_bi, load_checkpoint, load_dialogue_tokenizer, read_meta, save_checkpoint
from coreply.config import ZERO_SHOT
from coreply.corpus import Pair, distinct
from coreply.device import resolve_device
from coreply.gate import GATE_FIDELITY, REACH_FIDELITY, confident
from coreply.inference import INT8, Backend, export_onnx
from coreply.knowledge import trained_top_m
from coreply.ranking import Pipeline
from coreply.text import normalize
from coreply.tokenization import flat_pieces
from evaluation.metrics import paired_bootstrap, summarize
from evaluation.protocols import (
    choose_gate,
    choose_reach,
    choose_zscore_weight,
    ranks_for,
    reranked_per_context,
    retrieve_and_rerank,
)
from index_builder.faiss_index import EXACT, check_index_spec, make_index, recall_vs_exact
from index_builder.withdraw import carry_over

ONNX_CHOICES = ("int8", "fp32", "none")
SIGNIFICANT = 0.05
"""The p below which calibration serves the z-score fusion instead of the sum."""
"""The fusions a bundle's default is chosen from, preferred in this order on a tie (the reranker alone
is the z-score at weight 0)."""


LOG = logging.getLogger(__name__)


def encode_pool(
    backend: Backend, texts: Sequence[str], chunk: int = 1024, progress: bool = True, contexts: bool = False
) -> np.ndarray:
    """texts (or, with ``contexts``, contexts as turn lists) -> [N, D] float32, in chunks of similar
    length (padding is most of the cost on short texts), with a progress bar showing rate and ETA."""
    size = (lambda i: sum(map(len, texts[i]))) if contexts else (lambda i: len(texts[i]))
    encode = backend.encode_contexts if contexts else backend.encode_responses
    order = sorted(range(len(texts)), key=size)
    out = np.empty((len(texts), backend.dim), dtype="float32")
    desc = "encoding contexts" if contexts else "encoding pool"
    with tqdm(total=len(texts), unit="text", desc=desc, disable=not progress, smoothing=0.1) as bar:
        for start in range(0, len(order), chunk):
            rows = order[start : start + chunk]
            out[rows] = encode([texts[i] for i in rows])
            bar.update(len(rows))
    return out


def _place_model(spec: str, kind: str, dest: Path, device: str):
    """Put the model named by ``spec`` into ``dest`` and return it loaded. Files are copied, never
    hard-linked: the source is a training directory its owner may overwrite in place."""
    if kind == "bi" and spec == ZERO_SHOT:
        model = load_bi(ZERO_SHOT, device)
        save_checkpoint(model, dest, extra={"source": "all-MiniLM-L6-v2 as published (zero-shot, untrained)"})
        return model
    src = Path(spec)
    read_meta(src)  # verified before copying
    for path in sorted(src.rglob("*")):
        if path.is_file():
            target = dest / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    return load_checkpoint(dest, device, expect=kind)


def pins_of(manifest: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A built bundle's calibrated choices as :func:`build_bundle`'s ``pinned``: what a recipe keeps so
    that it builds the same bundle on any host without calibrating again. ``source`` says which build
    they come from (host, date)."""
    chosen = {name: dict(manifest[name]) for name in CALIBRATED if manifest.get(name)}
    for entry in chosen.values():  # a pinned build's choices are its source's, and so are the marks
        entry.pop("pinned", None)
        entry.pop("rho", None)
    return {"source": source, **chosen}


def pinned_entries(pinned: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """``pinned``'s entries, each marked ``"pinned": source``; a name that is not in :data:`CALIBRATED`,
    or no ``source``, is refused."""
    if not pinned:
        return {}
    unknown = set(pinned) - {*CALIBRATED, "source"}
    if unknown or not pinned.get("source"):
        raise ValueError(
            f"pinned choices need a 'source' and entries among {CALIBRATED}, got {sorted(pinned)}"
        )
    return {name: {**entry, "pinned": pinned["source"]} for name, entry in pinned.items() if name != "source"}


def calibrate_fusion(
    ranking: Pipeline,
    pairs: Sequence[Pair],
    n_r: int = 10,
    default: str | None = None,
    fidelity: float | None = GATE_FIDELITY,
    reach_fidelity: float | None = REACH_FIDELITY,
) -> dict[str, Any]:
    """Choose the fusion a request gets by default on held-out pairs whose gold responses are in the pool,
    through the serving pipeline at ``n_r`` candidates: the z-score weight with the best hits@1 (the
    evaluation's own grid search), then the sum of the two stages' scores (the precursor paper's Eq. 10)
    unless that z-score fusion puts the gold first significantly more often (one-sided paired bootstrap,
    p < :data:`SIGNIFICANT`): on the few thousand pairs a recipe can spare, a best-of-two by hits@1
    picks noise (docs/results.md §40.4). ``default`` fixes the fusion (a residual reranker is served as
    a sum) and only the weight is chosen. Then the rerank gate under that fusion
    (:func:`~evaluation.protocols.choose_gate`): where the first stage leads by more, a default request
    is answered without the reranker, which changes at most ``fidelity`` of these pairs' answers (None:
    no gate); then the rerank reach (:func:`~evaluation.protocols.choose_reach`): where the reranker
    runs, it reads only the candidates within it of the first stage's best, which changes at most
    ``reach_fidelity`` more of them (None: it reads all)."""
    got = retrieve_and_rerank(pairs, ranking, n_r, n_r)
    weight, ranks = choose_zscore_weight(pairs, ranking.keys, got, n_r)
    ranks = {"zscore": ranks[weight], "sum": ranks_for(pairs, ranking.keys, got, "sum", n_r)}
    first = {f: (np.array(r) == 1).astype(float) for f, r in ranks.items()}  # [N] each
    p = paired_bootstrap(first["zscore"], first["sum"])
    fusion = default or ("zscore" if p < SIGNIFICANT else "sum")
    gate = None if fidelity is None else choose_gate(got, fusion, n_r, weight, fidelity)
    skipped = np.mean([confident(c, gate) for c in got.candidates]) if got.candidates else 0.0
    gated_ranks = ranks_for(pairs, ranking.keys, got, fusion, n_r, weight, gate)
    reach = None if reach_fidelity is None else choose_reach(got, fusion, n_r, weight, gate, reach_fidelity)
    reached_ranks = ranks_for(pairs, ranking.keys, got, fusion, n_r, weight, gate, reach)
    return {
        "default": fusion,
        "zscore_weight": weight,
        "hits@1": {f: round(summarize(r)["hits@1"], 2) for f, r in ranks.items()},
        "p_zscore_better": round(p, 4),
        "gate": {
            "margin": gate,
            "fidelity": fidelity,
            "skipped_%": round(100 * float(skipped), 2),
            "hits@1": round(summarize(gated_ranks)["hits@1"], 2),
        },
        "reach": {
            "margin": reach,
            "fidelity": reach_fidelity,
            "reranked_per_context": round(reranked_per_context(got, fusion, n_r, gate, reach), 2),
            "hits@1": round(summarize(reached_ranks)["hits@1"], 2),
        },
        "calibrated_on": f"{len(pairs)} held-out pairs, hits@1 at n_r={n_r}",
    }


def calibrate_lexical(
    ranking: Pipeline, bm25: lexical.BM25, pairs: Sequence[Pair], depth: int, weight: float | None
) -> tuple[lexical.Stage, dict[str, Any]]:
    """The lexical stage over ``ranking``'s first ``depth`` candidates and its manifest entry: at
    ``weight``, or (None) the z-score weight with the best hits@1 on held-out ``pairs`` whose gold
    responses are in the pool (1.0: dense alone; the evaluation's own grid search)."""
    stage = lexical.Stage(bm25, 1.0 if weight is None else weight, depth)
    entry: dict[str, Any] = {"depth": depth, "turns": stage.turns, "stopwords": "english (NLTK's, as bm25s)"}
    if weight is not None:
        return stage, entry | {"weight": weight, "calibrated_on": "given (--lexical)"}
    got = retrieve_and_rerank(pairs, ranking, depth, 0)
    for pair, c in zip(pairs, got.candidates, strict=True):
        c.rerank = stage.scores(pair.context, [ranking.texts[i] for i in c.ids])
    chosen, ranks = choose_zscore_weight(pairs, ranking.keys, got, depth)
    hits = {
        name: round(summarize(ranks[w])["hits@1"], 2)
        for name, w in (("dense", 1.0), ("with lexical", chosen))
    }
    calibrated = f"{len(pairs)} held-out pairs, hits@1 of the first answer"
    entry |= {"weight": chosen, "calibrated_on": calibrated, "hits@1": hits}
    return replace(stage, weight=chosen), entry


def _model_entry(path: Path, spec: str) -> dict[str, Any]:
    meta = read_meta(path, verify=False)
    return {
        "source": spec,
        "content_hash": meta["content_hash"],
        "model_config": meta["model_config"],
        "training": meta.get("extra", {}),
    }


@changes("coreply index build", MANIFEST)
def build_bundle(
    out: str | Path,
    texts: Sequence[str],
    bi: str = ZERO_SHOT,
    cross: str | None = None,
    factory: str = EXACT,
    search_params: str = "",
    onnx: str = "int8",
    queries: Sequence[Sequence[str]] = (),
    device: str = "auto",
    pool_source: str = "",
    calibration: Sequence[Pair] = (),
    progress: bool = True,
    metadata: Sequence[dict[str, Any]] = (),
    command: str = "",
    knowledge_retriever: str | None = None,
    knowledge: Sequence[str] = (),
    top_m: int | None = None,
    guard_pairs: Sequence[Pair] = (),
    guard_quantile: float | None = restatement.DEFAULT_QUANTILE,
    prior_pairs: Sequence[Pair] = (),
    lexical_pairs: Sequence[Pair] = (),
    lexical_weight: float | None = None,
    lexical_depth: int = lexical.DEPTH,
    gate_fidelity: float | None = GATE_FIDELITY,
    reach_fidelity: float | None = REACH_FIDELITY,
    pinned: Mapping[str, Any] | None = None,
    rho: np.ndarray | None = None,
    rho_source: str = "",
) -> dict[str, Any]:
    """Encode ``texts`` (normalised duplicates dropped, first spelling kept, ids in order) and write a
    bundle to ``out`` atomically. ``queries`` (contexts) measure the index's recall against exact search;
    ``calibration`` pairs (with a reranker) choose the z-score fusion weight; ``metadata`` (one dict per
    text, if given) is stored with each response and returned by the service; ``command`` is recorded as
    what built the bundle. A reranker that reads knowledge may come with ``knowledge_retriever`` (picks
    the ``top_m`` sentences it reads, default: as many as it was trained with; without one it reads them as
    given) and a default ``knowledge`` set for requests that bring none. ``guard_pairs`` (held-out
    pairs) calibrate the restatement guard at ``guard_quantile`` (None, or no pairs: no guard).
    ``prior_pairs`` (e.g. the training split) give the response prior its reference contexts, and
    ``guard_pairs`` choose its weight (none of either: no prior). A lexical stage (BM25 reordering the
    first ``lexical_depth`` candidates, :mod:`coreply.lexical`) is served at ``lexical_weight``, or with
    ``lexical_pairs`` at the weight they choose (neither, or a chosen weight of 1: no lexical stage).
    ``calibration`` pairs also choose a cross-encoder's rerank gate at ``gate_fidelity`` and its rerank
    reach at ``reach_fidelity`` (None: no gate, no reach; the poly stage, which costs well under a
    millisecond, is never gated). ``pinned`` holds what a reference build of the same recipe and weights
    chose (:data:`CALIBRATED` manifest entries, and ``source``: which build): a stage with an entry there
    takes it instead of calibrating, and needs no held-out pairs (the prior still measures rho, at the
    pinned weight, unless ``rho`` [len(pool)] gives the values a build of the same retriever measured on
    this very pool, ``rho_source``: then no reference contexts are encoded either, and the entry also says
    ``"rho": rho_source``); each such entry says ``"pinned": source`` in the manifest."""
    if onnx not in ONNX_CHOICES:
        raise ValueError(f"--onnx must be one of {ONNX_CHOICES}, got {onnx!r}")
    if top_m is not None and top_m < 1:
        raise ValueError(f"--top-m must be >= 1, got {top_m}")
    if guard_quantile is not None:
        restatement.check_quantile(guard_quantile)  # before minutes of encoding, not after
    if lexical_weight is not None and not 0 <= lexical_weight <= 1:
        raise ValueError(f"--lexical: give a weight in [0, 1], 'auto' or 'off', got {lexical_weight}")
    if lexical_depth < 2:
        raise ValueError(f"--lexical-depth: give at least 2 candidates to reorder, got {lexical_depth}")
    if gate_fidelity is not None and not 0 <= gate_fidelity < 1:
        raise ValueError(f"--rerank-gate: give a share in [0, 1) or 'off', got {gate_fidelity}")
    if reach_fidelity is not None and not 0 <= reach_fidelity < 1:
        raise ValueError(f"--rerank-reach: give a share in [0, 1) or 'off', got {reach_fidelity}")
    knowledge = [k for k in (t.strip() for t in knowledge) if k]
    started = time.perf_counter()
    torch_device = resolve_device(device)
    keep = distinct(texts)
    pool = [texts[i] for i in keep]
    extra = [metadata[i] for i in keep] if any(metadata) else []
    if not pool:
        raise ValueError("the response pool is empty")
    pins = pinned_entries(pinned)
    if rho is not None:
        rho = np.asarray(rho, dtype=np.float32)
        if "prior" not in pins or not rho_source:
            raise ValueError("pinned rho needs the prior's pinned entry (its weight) and a rho_source")
        if rho.shape != (len(pool),) or not np.isfinite(rho).all():
            raise ValueError(f"pinned rho: {rho.shape} values (finite?) for a pool of {len(pool)} responses")
        pins["prior"]["rho"] = rho_source
    final = Path(out)
    with staging(final, MANIFEST) as tmp:
        bi_model = _place_model(bi, "bi", tmp / "bi", str(torch_device))
        check_index_spec(bi_model.dim, len(pool), factory, search_params)
        cross_model = _place_model(cross, "cross", tmp / "cross", str(torch_device)) if cross else None
        grounded = cross_model is not None and cross_model.reads_knowledge
        if (knowledge_retriever or knowledge) and not grounded:
            raise ValueError(
                "--knowledge-retriever / --knowledge need a reranker that reads knowledge (--cross from "
                "`coreply ground train`)"
            )
        if knowledge_retriever:
            _place_model(knowledge_retriever, "bi", tmp / "knowledge", str(torch_device))
        if grounded:
            write_knowledge(tmp, knowledge)
        smoothing = export_onnx(bi_model, cross_model, tmp / "onnx", onnx, pool) if onnx != "none" else None
        manifest: dict[str, Any] = {
            "models": {
                "bi": _model_entry(tmp / "bi", bi),
                "cross": _model_entry(tmp / "cross", cross) if cross else None,
            },
            "onnx": None if onnx == "none" else onnx,
            "onnx_int8": INT8 if onnx == "int8" else None,
            "onnx_smoothing": smoothing,  # the reranker's int8 graph: coreply.smoothing
        }
        residual_to = manifest["models"]["cross"]["training"].get("residual_to") if cross else None
        if residual_to:  # a correction to one retriever's scores (--cross-residual): served as their sum
            if residual_to != getattr(bi_model, "content_hash", None):
                raise ValueError(
                    f"--cross {cross} was trained as a correction to retriever {residual_to[:12]}, not to "
                    f"--bi {bi}: build the bundle with that retriever"
                )
            manifest["fusion"] = {"default": "sum"}
            if lexical_weight is not None or lexical_pairs:
                raise ValueError("--lexical: a residual reranker corrects dense scores; give --lexical off")
        if knowledge_retriever:
            manifest["models"]["knowledge"] = _model_entry(tmp / "knowledge", knowledge_retriever)
        if grounded:
            manifest["knowledge"] = {
                "top_m": (top_m or trained_top_m(tmp / "cross")) if knowledge_retriever else None,
                "default_sentences": len(knowledge),
                "max_knowledge_tokens": cross_model.config.max_knowledge_tokens,
            }
        manifest["index"] = {"dim": bi_model.dim}
        use_onnx = onnx != "none" and torch_device.type == "cpu"
        bundle = Bundle(tmp, manifest, None, list(pool), [normalize(t) for t in pool])
        backend = make_backend(bundle, "onnx" if use_onnx else "torch", _threads(), str(torch_device))
        encode_start = time.perf_counter()
        vectors = encode_pool(backend, pool, progress=progress)
        query_vectors = backend.encode_contexts(list(queries)) if queries else None
        encode_s = time.perf_counter() - encode_start
        index = make_index(vectors, factory)
        apply_search_params(index, search_params)
        recall = recall_vs_exact(index, vectors, query_vectors) if query_vectors is not None else {}
        if guard_quantile is not None and (guard_pairs or "restatement" in pins):
            manifest["restatement"] = pins.get("restatement") or restatement.calibrate(
                backend.encode_responses, guard_pairs, guard_quantile
            )
        search = searcher(index, factory, str(torch_device))  # as the service will search it
        if rho is not None:
            bundle.prior, manifest["prior"] = prior.Prior(pins["prior"]["alpha"], rho), pins["prior"]
        elif prior_pairs and (guard_pairs or "prior" in pins):
            bundle.prior, entry = prior.fit(
                lambda contexts: encode_pool(backend, contexts, progress=progress, contexts=True),
                search.search,
                vectors,
                bundle.keys,
                prior_pairs,
                guard_pairs,
                alpha=pins["prior"]["alpha"] if "prior" in pins else None,
            )
            if "prior" in pins:  # its weight pinned, its neighbourhood as this build measured it
                pins["prior"].update(k=entry["k"], reference_contexts=entry["reference_contexts"])
            manifest["prior"] = pins.get("prior", entry)
        if bundle.prior is not None:
            np.save(tmp / PRIOR, bundle.prior.values)
        ranking = pipeline(bundle, backend, search)
        if lexical_weight is not None or lexical_pairs or "lexical" in pins:
            from bm25s.stopwords import STOPWORDS_EN

            bm25 = lexical.BM25.fit(pool, STOPWORDS_EN)
            weight = pins["lexical"]["weight"] if "lexical" in pins else lexical_weight
            stage, entry = calibrate_lexical(ranking, bm25, lexical_pairs, lexical_depth, weight)
            if stage.weight < 1:
                write_lexical(tmp, bm25)
                bundle.lexical = ranking.lexical = stage
                manifest["lexical"] = pins.get("lexical", entry)
        if ranking.reranker is not None and "fusion" in pins:
            manifest["fusion"] = pins["fusion"]
        elif ranking.reranker is not None and calibration:
            fixed = manifest.get("fusion", {}).get("default")  # a residual's sum
            cross = ranking.reranker == "cross"  # the poly stage costs 0.4 ms: never gated
            manifest["fusion"] = calibrate_fusion(
                ranking,
                calibration,
                default=fixed,
                fidelity=gate_fidelity if cross else None,
                reach_fidelity=reach_fidelity if cross else None,
            )
        if unused := [name for name in pins if manifest.get(name) is not pins[name]]:
            raise ValueError(f"pinned choices for stages this build does not have: {unused}")
        import faiss

        faiss.write_index(index, str(tmp / INDEX))
        write_responses(tmp / RESPONSES, pool, extra)
        if cross_model is not None:  # requests then assemble rerank inputs from ids
            write_tokens(tmp, *flat_pieces(cross_model.tokenizer.pieces(pool)))
        manifest["encoder"] = f"onnx-{onnx}" if use_onnx else f"torch-{torch_device.type}"
        manifest["index"] = {
            "factory": factory,
            "metric": "inner_product",
            "dim": int(index.d),
            "count": int(index.ntotal),
            "search_params": search_params,
            "recall_vs_exact": recall,
            "recall_queries": len(queries),
        }
        manifest["build"] = {
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "pool_source": pool_source,
            "command": command,
            "input_texts": len(texts),
            "dropped_duplicates_or_blank": len(texts) - len(pool),
            "encode_seconds": round(encode_s, 1),
            "responses_per_second": round(len(pool) / max(encode_s, 1e-9), 1),
            "total_seconds": round(time.perf_counter() - started, 1),
            "host": f"{platform.machine()} {platform.system()}, {torch_device}",
        }
        manifest["additions"] = []
        withdrawn = carry_over(final, bundle.keys, tmp)
        if withdrawn:
            manifest["withdrawn"] = withdrawn
        return finish(tmp, final, manifest)


@changes("coreply index add", MANIFEST)
def add_responses(
    path: str | Path, texts: Sequence[str], progress: bool = True, metadata: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """Append new responses (and their ``metadata``, if given) to a bundle without re-encoding the others.
    Texts already in the pool (by normalised form) are skipped; new ids continue after the last one; with
    a response prior, new responses get its median (its reference contexts are not kept). The bundle is
    rewritten atomically."""
    root = Path(path)
    bundle = load_bundle(root)
    known, keys = set(bundle.keys), [normalize(t) for t in texts]
    keep = [i for i in distinct(texts) if keys[i] not in known]
    new = [texts[i] for i in keep]
    withdrawn = {bundle.keys[i] for i in bundle.withdrawn} & set(keys)
    if withdrawn:
        LOG.warning(
            "note: %d of these texts are withdrawn from the bundle and stay so; "
            "`coreply index withdraw --restore` serves them again",
            len(withdrawn),
        )
    if not new:
        return bundle.manifest
    encoder = bundle.manifest["encoder"]
    kind = "onnx" if encoder.startswith("onnx") else "torch"
    device = "cuda" if encoder == "torch-cuda" else "cpu"
    backend = make_backend(bundle, kind, _threads(), str(resolve_device(device)))
    vectors = encode_pool(backend, new, progress=progress)
    bundle.index.add(vectors)
    manifest = {k: v for k, v in bundle.manifest.items() if k not in ("files", "bundle_version")}
    manifest["index"] = {**manifest["index"], "count": int(bundle.index.ntotal)}
    manifest["additions"] = [
        *manifest.get("additions", []),
        {"added": len(new), "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")},
    ]
    import faiss

    with staging(root, MANIFEST) as tmp:
        for name in bundle.manifest["files"]:
            if name not in (INDEX, RESPONSES, MANIFEST, PRIOR, LEXICAL) and not name.startswith(f"{TOKENS}/"):
                link_or_copy(root / name, tmp / name)
        faiss.write_index(bundle.index, str(tmp / INDEX))
        if bundle.lexical is not None:  # the pool's statistics, the new responses counted
            write_lexical(tmp, bundle.lexical.bm25.add(new))
        if bundle.prior is not None:  # the reference contexts are not kept: new responses get the median
            fill = np.full(len(new), np.median(bundle.prior.values), dtype=np.float32)
            np.save(tmp / PRIOR, np.concatenate([bundle.prior.values, fill]))
            manifest["prior"] = {
                **manifest["prior"],
                "added_at_median": manifest["prior"].get("added_at_median", 0) + len(new),
            }
        extra = [*bundle.metadata, *([metadata[i] for i in keep] if metadata else [{}] * len(new))]
        write_responses(tmp / RESPONSES, [*bundle.texts, *new], extra if any(extra) else [])
        if bundle.tokens is not None:  # the stored ids, then the new responses'
            ids, offsets = bundle.tokens
            new_ids, new_offsets = flat_pieces(load_dialogue_tokenizer(root / "cross").pieces(new))
            write_tokens(
                tmp, np.concatenate([ids, new_ids]), np.concatenate([offsets, offsets[-1] + new_offsets[1:]])
            )
        return finish(tmp, root, manifest)


def _threads() -> int:
    import os

    return max(1, min(2, os.cpu_count() or 1))
