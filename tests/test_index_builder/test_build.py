"""Bundle format, index builder and ONNX parity."""

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import best_within, reseal, toy_pool
from tiny import WORDS

from coreply.artifacts import Busy, Sealing, content_hash, exclusive, hash_tree, write_json_atomic
from coreply.bundle import (
    BF16_PASS,
    FP16_PASS,
    MANIFEST,
    SEALING,
    BundleError,
    TorchExactIndex,
    finish,
    load_bundle,
    make_backend,
    pipeline,
    search_on,
)
from coreply.checkpoint_meta import SEALING as CHECKPOINT
from coreply.checkpoint_meta import read_meta
from coreply.inference import ONNX_FILES, _session
from coreply.text import normalize
from index_builder.build import add_responses, build_bundle
from index_builder.withdraw import withdraw


def test_bundle_round_trip(tiny_bundle):
    bundle = load_bundle(tiny_bundle)
    manifest = bundle.manifest
    assert bundle.texts == toy_pool()  # ids are positions in first-seen order
    assert manifest["index"]["count"] == len(toy_pool()) == bundle.index.ntotal
    assert manifest["index"]["dim"] == bundle.index.d == 32
    assert manifest["index"]["recall_vs_exact"]["recall@1"] == 1.0  # exact search against itself
    assert manifest["models"]["bi"]["training"]["train_config"]["mode"] == "core"
    assert manifest["encoder"] == "onnx-int8"
    assert set(manifest["files"]) == set(hash_tree(tiny_bundle, MANIFEST))
    weight = manifest["fusion"]["zscore_weight"]  # chosen on held-out pairs from the 0.0..1.0 grid
    assert 0.0 <= weight <= 1.0 and round(weight * 10) == weight * 10
    fusion = manifest["fusion"]  # the sum unless the z-score is significantly better on those pairs
    assert fusion["default"] == ("zscore" if fusion["p_zscore_better"] < 0.05 else "sum")


def _scripted_pipeline(texts, recalled, rerank):
    """A pipeline whose first stage recalls ``recalled[last turn]`` (ids, scores) and whose reranker
    scores a text as ``rerank[text]``."""
    from coreply.ranking import Hits, Pipeline

    def retrieve(contexts, k):
        rows = [recalled[c[-1]] for c in contexts]
        return Hits(np.array([ids for ids, _ in rows]), np.array([scores for _, scores in rows]))

    def score_pairs(contexts, responses, knowledge=None):
        return np.array([rerank[r] for r in responses])

    return Pipeline(retrieve, texts, [normalize(t) for t in texts], score_pairs)


def test_calibration_serves_the_sum_unless_a_z_score_weight_ranks_significantly_better():
    """Three candidates each: the sum of the two models' scores puts the gold first in lists a and b,
    while every z-score weight of the 0.0..1.0 grid misses one of them; in list c the first stage's
    scores are so wide that the sum keeps its (wrong) order and only a z-score reorders it."""
    from coreply.corpus import Pair
    from index_builder.build import calibrate_fusion

    texts = ["gold a", "a1", "a2", "b0", "b1", "gold b", "c0", "c1", "gold c"]
    recalled = {"a": ([0, 1, 2], [9.0, 5.0, 2.0]), "b": ([3, 4, 5], [4.0, 2.0, 0.0])}  # ids, scores
    recalled["c"] = ([6, 7, 8], [100.0, 50.0, 0.0])
    rerank = dict(
        zip(texts, [2.0, 0.0, 7.0, 4.0, 1.0, 9.0, 0.0, 1.0, 5.0], strict=True)
    )  # sums 11 5 9 | 8 3 9
    ranking = _scripted_pipeline(texts, recalled, rerank)
    pairs = [Pair(("a",), "gold a"), Pair(("b",), "gold b")]
    fusion = calibrate_fusion(ranking, pairs, n_r=3)
    assert fusion["default"] == "sum" and fusion["hits@1"] == {"zscore": 50.0, "sum": 100.0}
    assert fusion["gate"]["margin"] == 4.0  # a's answer is the first stage's: a is skipped, b reranked
    assert calibrate_fusion(ranking, pairs, n_r=3, default="zscore")["default"] == "zscore"  # fixed
    level = calibrate_fusion(ranking, [*pairs, Pair(("c",), "gold c")] * 2, n_r=3)
    assert level["hits@1"]["zscore"] == level["hits@1"]["sum"] and level["default"] == "sum"  # a tie: the sum
    many_c = calibrate_fusion(ranking, pairs + [Pair(("c",), "gold c")] * 20, n_r=3)
    assert many_c["default"] == "zscore" and many_c["p_zscore_better"] < 0.05


def test_the_rerank_gate_skips_the_reranker_only_where_it_would_not_change_the_answer():
    """List a: the first stage leads by 4 and the fused answer is its own; list b: it leads by 2 and
    the sum reorders it. The gate skips the reranker on a and reranks b, so no answer changes; allowed
    to change one of the two, it skips both. The gate reads no labels: b's gold is not first either way."""
    from coreply.corpus import Pair
    from coreply.gate import confident
    from evaluation.protocols import choose_gate, ranks_for, retrieve_and_rerank
    from index_builder.build import calibrate_fusion

    texts = ["gold a", "a1", "a2", "b0", "gold b", "b2"]
    recalled = {"a": ([0, 1, 2], [9.0, 5.0, 2.0]), "b": ([3, 4, 5], [4.0, 2.0, 0.0])}  # leads 4 and 2
    rerank = dict(zip(texts, [0.0, 3.0, 0.0, 0.0, 0.0, 9.0], strict=True))  # sums 9 8 2 | 4 2 9
    ranking = _scripted_pipeline(texts, recalled, rerank)
    pairs = [Pair(("a",), "gold a"), Pair(("b",), "gold b")]
    fusion = calibrate_fusion(ranking, pairs, n_r=3)
    assert fusion["default"] == "sum"
    gate = fusion["gate"]
    assert gate == {"margin": 4.0, "fidelity": 0.05, "skipped_%": 50.0, "hits@1": 50.0}
    got = retrieve_and_rerank(pairs, ranking, 3, 3)
    assert [confident(c, gate["margin"]) for c in got.candidates] == [True, False]
    assert ranks_for(pairs, ranking.keys, got, "sum", 3, gate=4.0) == [1.0, 3.0]  # as always reranking
    assert choose_gate(got, "sum", 3, 0.0, fidelity=0.5) == 2.0  # one answer may change: both skipped
    assert (
        calibrate_fusion(ranking, pairs, n_r=3, fidelity=None)["gate"]["margin"] is None
    )  # --rerank-gate off
    assert ranks_for(pairs, ranking.keys, got, "sum", 3, gate=2.0) == [1.0, 2.0]
    with pytest.raises(ValueError, match="fidelity"):
        choose_gate(got, "sum", 3, 0.0, fidelity=1.0)


def test_the_rerank_reach_leaves_out_only_candidates_that_would_not_change_the_answer():
    """List a: the sum's winner is third and trails the first stage's best by 7; list b: it is second
    and trails by 1. A reach that may change no answer reads all three of a; one that may change one of
    the two leaves a's third out (a's answer changes) and still reads b's winner. Behind a gate that
    skips both lists there is nothing left to change. No labels are read: a's gold is last either way."""
    from coreply.corpus import Pair
    from evaluation.protocols import choose_reach, ranks_for, retrieve_and_rerank
    from index_builder.build import calibrate_fusion

    texts = ["a0", "a1", "gold a", "b0", "gold b", "b2"]
    recalled = {"a": ([0, 1, 2], [9.0, 8.0, 2.0]), "b": ([3, 4, 5], [4.0, 3.0, 0.0])}
    rerank = dict(zip(texts, [0.0, 0.0, 9.0, 0.0, 3.0, 0.0], strict=True))  # sums 9 8 11 | 4 6 0
    ranking = _scripted_pipeline(texts, recalled, rerank)
    pairs = [Pair(("a",), "gold a"), Pair(("b",), "gold b")]
    got = retrieve_and_rerank(pairs, ranking, 3, 3)
    assert choose_reach(got, "sum", 3, 0.0, None, fidelity=0.0) == np.nextafter(7.0, np.inf)
    one = choose_reach(got, "sum", 3, 0.0, None, fidelity=0.5)
    assert one == np.nextafter(1.0, np.inf)
    assert ranks_for(pairs, ranking.keys, got, "sum", 3) == [1.0, 1.0]
    assert ranks_for(pairs, ranking.keys, got, "sum", 3, reach=one) == [3.0, 1.0]  # a's gold not read
    assert choose_reach(got, "sum", 3, 0.0, gate=1.0, fidelity=0.0) == np.nextafter(0.0, 1.0)
    reach = calibrate_fusion(ranking, pairs, n_r=3, fidelity=None, reach_fidelity=0.5)["reach"]
    assert reach == {"margin": one, "fidelity": 0.5, "reranked_per_context": 2.0, "hits@1": 50.0}
    off = calibrate_fusion(ranking, pairs, n_r=3, reach_fidelity=None)["reach"]  # --rerank-reach off
    assert off["margin"] is None and off["reranked_per_context"] == 3.0
    with pytest.raises(ValueError, match="fidelity"):
        choose_reach(got, "sum", 3, 0.0, None, fidelity=1.0)


def test_duplicates_are_dropped_and_ids_stay_in_order(tmp_path, tiny_core):
    texts = ["Hello there", "hello   THERE", "second", "", "third"]
    build_bundle(tmp_path / "b", texts, bi=str(tiny_core / "bi"), onnx="none", progress=False)
    bundle = load_bundle(tmp_path / "b")
    assert bundle.texts == ["Hello there", "second", "third"]
    assert bundle.manifest["build"]["dropped_duplicates_or_blank"] == 2
    assert not bundle.has_cross and bundle.manifest["models"]["cross"] is None


def resealed(bundle: Path, tmp_path: Path, manifest: dict, tamper) -> Path:
    """A copy of ``bundle`` changed by ``tamper(copy)`` and sealed again with ``manifest``: every hash
    fits, so only the checks of its contents can refuse it."""
    work = tmp_path / "work"
    shutil.copytree(bundle, work)
    tamper(work)
    (work / MANIFEST).unlink()
    finish(
        work,
        tmp_path / "resealed",
        {k: v for k, v in manifest.items() if k not in ("files", "bundle_version")},
    )
    return tmp_path / "resealed"


@pytest.fixture
def copy(tmp_path, tiny_bundle):
    dest = tmp_path / "copy"
    shutil.copytree(tiny_bundle, dest)
    return dest


def test_corrupted_file_is_refused(copy):
    data = bytearray((copy / "index.faiss").read_bytes())
    data[-1] ^= 0xFF
    (copy / "index.faiss").write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"index\.faiss: corrupted"):
        load_bundle(copy)


def test_missing_and_unexpected_files_are_refused(copy):
    (copy / "stray.txt").write_text("x")
    with pytest.raises(BundleError, match=r"stray\.txt: unexpected"):
        load_bundle(copy)
    (copy / "stray.txt").unlink()
    (copy / "onnx" / "cross.onnx").unlink()
    with pytest.raises(BundleError, match=r"cross\.onnx: missing"):
        load_bundle(copy)


def test_manifest_disagreeing_with_contents_is_refused(copy):
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["index"]["count"] += 1
    write_json_atomic(copy / MANIFEST, manifest)
    with pytest.raises(BundleError, match="bundle_version does not match the files and fields"):
        load_bundle(copy)  # a hand edit
    reseal(copy, SEALING)  # by a tool that seals what it writes
    with pytest.raises(BundleError, match="index holds 13 vectors, manifest says 14"):
        load_bundle(copy)
    (copy / MANIFEST).write_text("{not json")
    with pytest.raises(BundleError, match=r"manifest\.json: not valid UTF-8 JSON"):
        load_bundle(copy)
    (copy / MANIFEST).unlink()
    with pytest.raises(BundleError, match="not a coreply bundle"):
        load_bundle(copy)


def test_the_version_covers_the_choices_and_not_where_or_when_it_was_built(tmp_path, tiny_core):
    """Two bundles whose files are the same but whose choices differ answer differently: their versions
    differ, and a choice edited by hand is refused. The same build made elsewhere and later, from a copy
    of the weights, is the same version."""
    shutil.copytree(tiny_core / "bi", tmp_path / "elsewhere")
    sources = {"a": (tiny_core / "bi", 0.5), "b": (tmp_path / "elsewhere", 0.5), "c": (tiny_core / "bi", 0.7)}
    a, b, c = (
        build_bundle(
            tmp_path / name,
            toy_pool(),
            bi=str(bi),
            onnx="none",
            lexical_weight=w,
            command=name,
            progress=False,
        )
        for name, (bi, w) in sources.items()
    )
    assert a["files"] == b["files"] == c["files"] and a["build"] != b["build"]
    assert a["bundle_version"] == b["bundle_version"] != c["bundle_version"]
    manifest = json.loads((tmp_path / "c" / MANIFEST).read_text())
    manifest["lexical"]["weight"] = 0.5
    write_json_atomic(tmp_path / "c" / MANIFEST, manifest)
    with pytest.raises(BundleError, match="bundle_version does not match"):
        load_bundle(tmp_path / "c")


def first_format(sealing: Sealing):
    """An edit for :func:`reseal` that seals as the format's first version did (the files alone)."""
    return lambda meta: meta.update(format=sealing.legacy)


def test_a_bundle_of_the_first_format_is_read_with_its_files_alone_hashed(copy):
    """A bundle and checkpoints sealed before the version covered the fields still load, their files
    still checked; the first write to the bundle (here a withdrawal) seals it in the current format."""
    hashes = {kind: reseal(copy / kind, CHECKPOINT, first_format(CHECKPOINT)) for kind in ("bi", "cross")}

    def tie_models(manifest: dict) -> None:
        first_format(SEALING)(manifest)
        for kind, digest in hashes.items():
            manifest["models"][kind]["content_hash"] = digest

    reseal(copy, SEALING, tie_models)
    old = load_bundle(copy)
    assert old.manifest["format"] == "coreply-bundle/1" and old.has_cross
    assert old.version == content_hash(old.manifest["files"])[:16]  # as format 1's writer hashed it
    assert hashes["bi"] == content_hash(read_meta(copy / "bi")["files"])
    assert withdraw(copy, [0])[0]["format"] == "coreply-bundle/2"
    assert load_bundle(copy).withdrawn == {0}
    (copy / "bi" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(BundleError, match=r"model\.safetensors: corrupted"):
        load_bundle(copy)


def test_swapped_model_is_refused(copy, tiny_core):
    """A bi-encoder other than the one that encoded the index, even with consistent file hashes."""
    shutil.rmtree(copy / "bi")
    shutil.copytree(tiny_core / "cross", copy / "bi")  # a valid checkpoint, but not the indexing model
    reseal(copy, SEALING)
    with pytest.raises(BundleError, match="not the one the index was built with"):
        load_bundle(copy)


def test_failed_build_leaves_nothing_behind(tmp_path, tiny_core):
    with pytest.raises(ValueError, match="--factory 'NoSuch99': FAISS cannot build it"):
        build_bundle(tmp_path / "b", toy_pool(), bi=str(tiny_core / "bi"), factory="NoSuch99", progress=False)
    assert list(tmp_path.iterdir()) == []


def _synthetic_pool(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=6)) for _ in range(n)]


@pytest.mark.parametrize(
    ("factory", "params", "least"),
    [
        ("IVF8,Flat", "nprobe=8", 0.95),  # nprobe = nlist: exhaustive
        ("HNSW16", "efSearch=64", 0.0),  # inner product on unnormalised vectors: recall is what it is
    ],
)
def test_ann_index_reports_recall_and_serves(tmp_path, tiny_core, toy_pairs, factory, params, least):
    pool = _synthetic_pool(600)
    manifest = build_bundle(
        tmp_path / "b",
        pool,
        bi=str(tiny_core / "bi"),
        factory=factory,
        search_params=params,
        onnx="none",
        queries=[p.context for p in toy_pairs[:20]],
        progress=False,
        guard_pairs=toy_pairs,
    )
    recall = manifest["index"]["recall_vs_exact"]
    assert set(recall) == {"recall@1", "recall@10", "recall@100"}
    assert least <= recall["recall@10"] <= 1.0
    bundle = load_bundle(tmp_path / "b")
    backend = make_backend(bundle)
    _, ids = bundle.index.search(backend.encode_contexts([toy_pairs[0].context]), 5)
    assert len(set(ids[0])) == 5 and ids[0].min() >= 0
    # the restatement guard reads response vectors back from an approximate index too
    from coreply.responder import Responder

    assert len(Responder.load(tmp_path / "b").respond(toy_pairs[0].context, 5, 5)) == 5


def test_index_specs_that_cannot_work_are_refused_before_the_pool_is_encoded(
    tmp_path, tiny_core, monkeypatch
):
    def never(*args, **kwargs):
        raise AssertionError("the pool was encoded before the index spec was checked")

    monkeypatch.setattr("index_builder.build.encode_pool", never)
    for factory, params, says in (
        ("IVF256,Flat", "", "256 inverted lists for 13 responses; use fewer"),
        ("HNSW8", "nprobe=4", "--search-params 'nprobe=4' do not fit this index"),
        ("Bogus", "", "--factory 'Bogus': FAISS cannot build it"),
    ):
        with pytest.raises(ValueError, match=says):
            build_bundle(
                tmp_path / "b", toy_pool(), bi=str(tiny_core / "bi"), factory=factory, search_params=params,
                progress=False,
            )  # fmt: skip


def test_add_appends_without_re_encoding(tmp_path, tiny_bundle, toy_pairs):
    path = tmp_path / "b"
    shutil.copytree(tiny_bundle, path)
    before = load_bundle(path)
    old_vectors = before.index.reconstruct_n(0, before.index.ntotal)
    manifest = add_responses(
        path, ["a brand new reply", "HELLO", "another new one", "a brand new  reply"], False
    )
    after = load_bundle(path)
    assert after.texts == [*before.texts, "a brand new reply", "another new one"]  # HELLO already there
    assert manifest["index"]["count"] == len(before.texts) + 2
    np.testing.assert_array_equal(after.index.reconstruct_n(0, before.index.ntotal), old_vectors)
    assert after.version != before.version and len(manifest["additions"]) == 1
    # the new rows are what the bundle's encoder gives for those texts (int8 ONNX quantises activations
    # per batch, so batch-mates move the values a little)
    fresh = make_backend(after).encode_responses(["another new one"])
    row = after.index.reconstruct(after.texts.index("another new one"))
    np.testing.assert_allclose(row, fresh[0], atol=5e-3)


@pytest.mark.parametrize("name", ["tiny_bundle", "guarded_bundle", "lexical_bundle"])
def test_withdrawn_responses_are_never_answered_keep_every_id_and_come_back(
    tmp_path, name, request, toy_pairs, caplog
):
    """Exact search alone, behind the restatement guard, and with a lexical stage."""
    from coreply.responder import Responder

    path = tmp_path / "b"
    shutil.copytree(request.getfixturevalue(name), path)
    context, size = list(toy_pairs[0].context), len(load_bundle(path).texts)

    def ranked() -> list[int]:  # every response the bundle would answer, best first, by its first stage
        bot = Responder.load(path, backend="torch")
        return [r.id for r in bot.respond(context, top_k=size, n_candidates=size, fusion="retrieval")]

    before, texts = ranked(), load_bundle(path).texts
    first, second = before[0], before[1]
    manifest, changed, unknown = withdraw(path, [first], [texts[second].upper(), "not in the pool"])
    assert (changed, unknown, manifest["withdrawn"]["count"]) == (2, ["not in the pool"], 2)
    assert load_bundle(path).texts == texts and load_bundle(path).withdrawn == {first, second}
    assert ranked() == [i for i in before if i not in (first, second)]  # the rest, in the same order
    again = withdraw(path, [first])  # already withdrawn: nothing is rewritten
    assert again[1] == 0 and again[0]["bundle_version"] == manifest["bundle_version"]
    restored, changed, _ = withdraw(path, [first], restore=True)
    assert changed == 1 and restored["bundle_version"] != manifest["bundle_version"]
    assert ranked() == [i for i in before if i != second]
    assert [h.get("withdrawn", -h.get("restored", 0)) for h in restored["withdrawn"]["history"]] == [2, -1]
    with caplog.at_level(logging.WARNING):
        add_responses(path, [texts[second]], False)  # still withdrawn, and the log says how to restore it
    assert "1 of these texts are withdrawn" in caplog.text and ranked() == [i for i in before if i != second]
    with pytest.raises(ValueError, match=f"--ids: {size} is not a response of this bundle"):
        withdraw(path, [size])


def test_a_bundle_built_again_over_one_keeps_its_withdrawals_by_text(tmp_path, tiny_core, caplog):
    """A new model or recipe rebuilds a bundle in place (the default bundle after an upgrade): what was
    withdrawn must not come back, though the ids move."""
    path, bi = tmp_path / "b", str(tiny_core / "bi")
    pool = ["one reply", "two replies", "three replies", "four replies"]
    build_bundle(path, pool, bi=bi, onnx="none", progress=False)
    assert "withdrawn" not in load_bundle(path).manifest  # a first build has nothing to carry
    old = withdraw(path, [1, 3])[0]["bundle_version"]
    with caplog.at_level(logging.WARNING):
        build_bundle(
            path, ["FOUR replies", "three replies", "new", "Two replies"], bi=bi, onnx="none", progress=False
        )
    bundle = load_bundle(path)
    assert sorted(bundle.texts[i] for i in bundle.withdrawn) == ["FOUR replies", "Two replies"]
    assert bundle.manifest["withdrawn"]["history"][0]["from"] == old
    assert (
        "2 responses withdrawn from the bundle this build replaces stay withdrawn (0 of its 2" in caplog.text
    )
    build_bundle(path, ["FOUR replies", "new"], bi=bi, onnx="none", progress=False)
    assert load_bundle(path).withdrawn == {0}  # "Two replies" left the pool, and with it its withdrawal


def test_withdrawals_past_the_cap_or_out_of_range_are_refused(tmp_path, tiny_bundle, monkeypatch):
    import index_builder.withdraw

    path = tmp_path / "b"
    shutil.copytree(tiny_bundle, path)
    monkeypatch.setattr(index_builder.withdraw, "MAX_WITHDRAWN", 2)
    with pytest.raises(ValueError, match=r"more than 2 .* build the bundle again"):
        withdraw(path, [0, 1, 2])
    withdraw(path, [0, 1])
    # a list the manifest's hashes agree with but that names a row the pool does not hold
    (path / "withdrawn.json").write_text(json.dumps({"ids": [0, 99]}))
    reseal(path, SEALING)
    with pytest.raises(BundleError, match=r"withdrawn\.json must hold .* distinct ids below 13"):
        load_bundle(path)


def test_two_writers_never_change_a_bundle_at_once(copy):
    """A second read-and-rewrite while one runs would write over its change: it is refused, naming the
    first, and goes through once the first is done. A path with no bundle gets no lock file."""
    busy = r"copy: coreply index add \(pid \d+\) is changing it; try again"
    with exclusive(copy, "coreply index add", "manifest.json"), pytest.raises(Busy, match=busy):
        withdraw(copy, [0])
    assert withdraw(copy, [0])[1] == 1
    with pytest.raises(BundleError, match="not a coreply bundle"):
        withdraw(copy.parent / "missing", [0])
    assert not (copy.parent / ".missing.lock").exists()


def test_responses_are_tokenised_once_at_build_and_assembled_like_the_tokenizer(tmp_path, tiny_bundle):
    """The bundle stores the reranker's word pieces of every response; rerank inputs assembled from them
    are exactly what tokenising the same pairs gives, and `add` stores the new responses' pieces."""
    from coreply.checkpoint import load_dialogue_tokenizer

    bundle = load_bundle(tiny_bundle)
    assert bundle.tokens is not None
    fresh = load_dialogue_tokenizer(tiny_bundle / "cross")  # tokenises everything itself
    stored = make_backend(bundle).cross_tokenizer
    calls = []
    stored._tokenize = lambda texts: calls.append(list(texts)) or fresh._tokenize(texts)
    contexts = ([["hello", "what is your favorite food ?"], [bundle.texts[3]]] * len(bundle.texts))[
        : len(bundle.texts)
    ]
    want, got = fresh.pairs(contexts, bundle.texts), stored.pairs(contexts, bundle.texts)
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert all(t not in bundle.texts for batch in calls for t in batch)  # only the new context turns
    path = tmp_path / "b"
    shutil.copytree(tiny_bundle, path)
    add_responses(path, ["a reply nobody tokenised yet"], False)
    after = load_bundle(path)
    ids, offsets = after.tokens
    assert len(offsets) == len(after.texts) + 1
    assert ids[offsets[-2] : offsets[-1]].tolist() == fresh.pieces(["a reply nobody tokenised yet"])[0]


def test_token_budget_scoring_gives_the_scores_of_one_padded_batch(tiny_bundle, toy_pairs):
    """Rerank scores from id-assembled, token-budget chunks equal one padded batch of the same pairs."""
    from coreply.checkpoint import load_checkpoint

    backend = make_backend(load_bundle(tiny_bundle), "torch")
    backend.max_batch_tokens = 64  # several small chunks
    cross = load_checkpoint(tiny_bundle / "cross")
    contexts, responses = [p.context for p in toy_pairs[:12]], [p.response for p in toy_pairs[5:17]]
    with torch.inference_mode():
        whole = cross(cross.tokenizer.pairs(contexts, responses)).numpy()
    np.testing.assert_allclose(backend.score_pairs(contexts, responses), whole, atol=1e-5)


def test_onnx_matches_torch(tmp_path, tiny_core, toy_pairs):
    """fp32 ONNX reproduces PyTorch closely; int8 stays within a tolerance and keeps the top-1, on CPUs
    with VNNI or without (the tiny model's weights saturate 8-bit products there)."""
    contexts = [p.context for p in toy_pairs[:8]]
    pool = toy_pool()
    results = {}
    for precision in ("fp32", "int8"):
        out = tmp_path / precision
        build_bundle(
            out,
            pool,
            bi=str(tiny_core / "bi"),
            cross=str(tiny_core / "cross"),
            onnx=precision,
            progress=False,
        )
        bundle = load_bundle(out)
        assert bundle.manifest["onnx_int8"] == ("int8-per-channel-7bit" if precision == "int8" else None)
        smoothing = {"alpha": 0.75, "pairs": len(pool) - 2}  # every start of the toy pool
        assert bundle.manifest["onnx_smoothing"] == (smoothing if precision == "int8" else None)
        results[precision] = make_backend(bundle, "onnx")
    reference = make_backend(load_bundle(tmp_path / "fp32"), "torch")
    flat_c = [c for c in contexts for _ in pool]
    flat_r = pool * len(contexts)
    want_q = reference.encode_contexts(contexts)
    want_s = reference.score_pairs(flat_c, flat_r).reshape(len(contexts), -1)
    want_top = (want_q @ reference.encode_responses(pool).T).argmax(1)
    for precision, tol in (("fp32", 1e-4), ("int8", 0.1)):
        backend = results[precision]
        got_q = backend.encode_contexts(contexts)
        got_s = backend.score_pairs(flat_c, flat_r).reshape(len(contexts), -1)
        spread = want_s.max() - want_s.min()
        assert np.abs(got_q - want_q).max() <= tol * np.abs(want_q).max(), precision
        assert np.abs(got_s - want_s).max() <= tol * spread, precision
        assert (got_s.argmax(1) == want_s.argmax(1)).all(), precision
        assert ((got_q @ backend.encode_responses(pool).T).argmax(1) == want_top).all(), precision


@pytest.mark.parametrize("threads", [1, 2])
def test_an_int8_row_comes_out_alike_alone_and_in_any_batch(tiny_bundle, toy_pairs, threads):
    """int8 graphs quantise their activations with one scale per call; on the CPU every row runs alone,
    so a context's vector, a response's and a pair's score do not depend on what else shares the call
    (another request in the same micro-batch)."""
    backend = make_backend(load_bundle(tiny_bundle), "onnx", threads=threads)
    contexts, pool = [p.context for p in toy_pairs[:6]], toy_pool()
    alone = np.concatenate([backend.encode_contexts([c]) for c in contexts])
    np.testing.assert_array_equal(backend.encode_contexts(contexts), alone)
    alone = np.concatenate([backend.encode_responses([r]) for r in pool])
    np.testing.assert_array_equal(backend.encode_responses(pool), alone)
    requests = [([c] * len(pool), pool) for c in contexts[:3]]
    alone = np.concatenate([backend.score_pairs(c, r) for c, r in requests])
    together = backend.score_pairs([c for cs, _ in requests for c in cs], pool * len(requests))
    np.testing.assert_array_equal(together, alone)


def test_rows_run_one_thread_each_and_the_threads_change_no_float(tiny_bundle, toy_pairs):
    """On the CPU every row (a context, a response, a pair) runs on one intra-op thread, the rows spread
    over the backend's threads; how many threads ran a row changes none of its floats."""
    bundle = load_bundle(tiny_bundle)
    one, two = (make_backend(bundle, "onnx", threads=n) for n in (1, 2))
    intra = lambda session: session.get_session_options().intra_op_num_threads  # noqa: E731
    assert (intra(two.context), intra(two.response), intra(two.cross)) == (1, 1, 1)
    contexts, pool = [p.context for p in toy_pairs[:6]], toy_pool()
    np.testing.assert_array_equal(one.encode_contexts(contexts), two.encode_contexts(contexts))
    np.testing.assert_array_equal(one.encode_responses(pool), two.encode_responses(pool))
    flat_c = [c for c in contexts[:3] for _ in pool]
    np.testing.assert_array_equal(one.score_pairs(flat_c, pool * 3), two.score_pairs(flat_c, pool * 3))


@pytest.mark.parametrize("served", [False, True], ids=["faiss-flat", "torch-exact"])
def test_the_guard_reads_pool_turns_back_from_an_exact_index_with_the_floats_the_encoder_gives(
    tiny_bundle, monkeypatch, served
):
    """Context turns the pool holds verbatim come back as the vectors the index stores, which the same
    graph wrote at build time: what encoding them now gives, bit for bit; only the other turns run the
    response graph. The retriever and the reranker's tokenizer look texts up in one map of the pool."""
    bundle = search_on(load_bundle(tiny_bundle), "cpu") if served else load_bundle(tiny_bundle)
    backend = make_backend(bundle, "onnx", threads=2)
    retrieve = pipeline(bundle, backend).retrieve
    turns = [bundle.texts[3], "a turn the pool does not hold", bundle.texts[0], bundle.texts[3]]
    want = backend.encode_responses(turns)
    encode, asked = backend.encode_responses, []
    monkeypatch.setattr(backend, "encode_responses", lambda texts: asked.append(texts) or encode(texts))
    np.testing.assert_array_equal(retrieve.encode_responses(turns), want)
    assert asked == [["a turn the pool does not hold"]]
    np.testing.assert_array_equal(retrieve.encode_responses(turns[:1]), want[:1])
    assert len(asked) == 1
    assert retrieve.rows is bundle.rows is backend.cross_tokenizer._stored  # one map of the pool's texts


def test_the_cpu_reranker_runs_without_the_slow_fused_layer_norm(tiny_bundle, toy_pairs, tmp_path):
    """ONNX Runtime fuses each residual Add and LayerNormalization into a SkipLayerNormalization that is
    slower on the CPU than the two: the reranker's session leaves that fusion out (its operators, from
    ONNX Runtime's own profile), and it still ranks as PyTorch does (``test_onnx_matches_torch``)."""
    bundle = load_bundle(tiny_bundle)
    backend = make_backend(bundle, "onnx", threads=1)
    path = bundle.root / "onnx" / ONNX_FILES["cross"]

    def operators(session, feeds) -> set[str]:
        session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
        return {e["args"]["op_name"] for e in events if e.get("cat") == "Node" and "op_name" in e["args"]}

    batch = backend.cross_tokenizer.pairs([toy_pairs[0].context], [toy_pairs[0].response])
    feeds = {i.name: getattr(batch, i.name).numpy() for i in backend.cross.get_inputs()}
    fused = _session(path, 1, cuda=False, profile=tmp_path / "fused")
    assert "SkipLayerNormalization" in operators(fused, feeds)
    served = operators(backend.cross_session(path, profile=tmp_path / "served"), feeds)
    assert "SkipLayerNormalization" not in served and "LayerNormalization" in served


def test_torch_bf16_casts_the_models_and_keeps_the_fp32_ranking(tiny_bundle, toy_pairs):
    """``torch-bf16`` runs bf16 weights on the CPU and returns float32 close to fp32's: the same top-1
    wherever fp32's own margin is wider than the rounding; an unknown backend is refused by name."""
    bundle = load_bundle(tiny_bundle)
    fp32, bf16 = make_backend(bundle, "torch"), make_backend(bundle, "torch-bf16")
    assert bf16.name == "torch-bf16" and next(bf16.cross.parameters()).dtype == torch.bfloat16
    assert next(fp32.cross.parameters()).dtype == torch.float32  # each backend loads its own copy
    contexts, pool = [p.context for p in toy_pairs[:8]], toy_pool()
    flat_c, flat_r = [c for c in contexts for _ in pool], pool * len(contexts)
    want_q, got_q = fp32.encode_contexts(contexts), bf16.encode_contexts(contexts)
    assert got_q.dtype == np.float32
    cosine = (want_q * got_q).sum(1) / np.linalg.norm(want_q, axis=1) / np.linalg.norm(got_q, axis=1)
    assert cosine.min() > 0.999
    want_s = fp32.score_pairs(flat_c, flat_r).reshape(len(contexts), -1)
    got_s = bf16.score_pairs(flat_c, flat_r).reshape(len(contexts), -1)
    error = np.abs(got_s - want_s).max()
    assert error <= 0.02 * (want_s.max() - want_s.min())
    top2 = np.sort(want_s, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * error
    assert clear.any() and (got_s.argmax(1) == want_s.argmax(1))[clear].all()
    with pytest.raises(ValueError, match="auto, onnx, torch, torch-bf16"):
        make_backend(bundle, "tensorrt")


def test_a_match_head_reranker_serves_the_same_scores_from_onnx(
    tmp_path, tiny_core, tiny_model_dir, toy_pairs
):
    """The match head (cosine of segment means) traces into the cross graph: fp32 ONNX = PyTorch."""
    from coreply.checkpoint import save_checkpoint
    from coreply.config import ModelConfig
    from coreply.models import CrossEncoder

    cross = CrossEncoder.from_pretrained(ModelConfig(base_model=str(tiny_model_dir), cross_head="match"))
    save_checkpoint(cross.eval(), tmp_path / "cross")
    out = tmp_path / "bundle"
    build_bundle(
        out, toy_pool(), bi=str(tiny_core / "bi"), cross=str(tmp_path / "cross"), onnx="fp32", progress=False
    )
    contexts = [p.context for p in toy_pairs[:4] for _ in range(3)]
    responses = toy_pool()[:3] * 4
    onnx, reference = (make_backend(load_bundle(out), kind) for kind in ("onnx", "torch"))
    np.testing.assert_allclose(
        onnx.score_pairs(contexts, responses), reference.score_pairs(contexts, responses), atol=1e-4
    )


def test_int8_keeps_the_small_output_channels_of_a_weight(tmp_path):
    """The shipped int8 scales each output channel: a channel with 1/1000 of the others' weights keeps
    its values, where one scale for the whole tensor rounds it to nothing. Its 7-bit weights keep every
    channel within 5 % on any x86 CPU, VNNI or not (full 8-bit ones were 27-39 % off on an AVX2 host)."""
    import onnxruntime as ort

    from coreply.inference import INT8, quantize_graph

    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 4, bias=False)
    with torch.no_grad():
        layer.weight[3] *= 1e-3
    fp32 = tmp_path / "linear.onnx"
    torch.onnx.export(
        layer, (torch.randn(2, 32),), str(fp32), input_names=["x"], dynamic_axes={"x": {0: "n"}}, dynamo=False
    )
    x = np.random.default_rng(0).normal(size=(64, 32)).astype("float32")
    want = layer(torch.from_numpy(x)).detach().numpy()  # [64, 4]
    error = {}
    level = logging.getLogger().level
    for variant in (INT8, "int8-per-tensor"):
        quantize_graph(fp32, tmp_path / f"{variant}.onnx", variant)
        assert logging.getLogger().level == level and not logging.getLogger().filters  # as it was
        session = ort.InferenceSession(str(tmp_path / f"{variant}.onnx"), providers=["CPUExecutionProvider"])
        got = session.run(None, {"x": x})[0]
        error[variant] = np.abs(got - want).max(0) / np.abs(want).max(0)  # [4]: per output channel
    assert error[INT8].max() < 0.05
    assert error["int8-per-tensor"][3] > 0.5


def test_export_traces_eager_attention_and_restores_the_models(tmp_path, tiny_core):
    """The graphs carry plain attention (no SDPA NaN clean-up per layer); the models keep their own."""
    import onnx

    from coreply.checkpoint import load_checkpoint
    from coreply.inference import export_onnx

    bi, cross = load_checkpoint(tiny_core / "bi"), load_checkpoint(tiny_core / "cross")
    attention = lambda: [m.config._attn_implementation for m in (bi.context_tower, cross.backbone)]  # noqa: E731
    before = attention()
    export_onnx(bi, cross, tmp_path, "fp32")
    assert attention() == before and "eager" not in before
    for name in ("context", "response", "cross"):
        ops = {node.op_type for node in onnx.load(str(tmp_path / f"{name}.onnx")).graph.node}
        assert "Softmax" in ops and "IsNaN" not in ops, name


def test_normalised_keys(tiny_bundle):
    bundle = load_bundle(tiny_bundle)
    assert bundle.keys == [normalize(t) for t in bundle.texts]


def test_recall_vs_exact_measures_misses():
    from coreply.bundle import apply_search_params
    from index_builder.faiss_index import make_index, recall_vs_exact

    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(2000, 16)).astype("float32")
    queries = rng.normal(size=(50, 16)).astype("float32")
    assert recall_vs_exact(make_index(vectors), vectors, queries)["recall@10"] == 1.0
    ivf = make_index(vectors, "IVF32,Flat")
    apply_search_params(ivf, "nprobe=1")
    narrow = recall_vs_exact(ivf, vectors, queries)["recall@10"]
    apply_search_params(ivf, "nprobe=32")
    assert narrow < 0.9 and recall_vs_exact(ivf, vectors, queries)["recall@10"] == 1.0
    with pytest.raises(ValueError, match=r"do not fit this index: could not set parameter efSearch$"):
        apply_search_params(ivf, "efSearch=10")
    for params in ("nprobe=-1", "nprobe=inf", "nprobe=", "nprobe=4,efSearch=nan"):  # FAISS takes -1 as is
        with pytest.raises(ValueError, match=r"--search-params '.*': \w+ needs a number > 0, not '"):
            apply_search_params(ivf, params)
    with pytest.raises(ValueError, match=r"'nprobe' is not NAME=VALUE, e.g. efSearch=128$"):
        apply_search_params(ivf, "nprobe")


def faiss_flat(vectors: np.ndarray):
    import faiss

    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(np.ascontiguousarray(vectors, dtype="float32"))
    return index


def flat_index_and_queries(n: int = 500, dim: int = 16):
    rng = np.random.default_rng(0)
    return faiss_flat(rng.standard_normal((n, dim))), rng.standard_normal((7, dim)).astype("float32")


def test_torch_exact_search_returns_what_faiss_flat_returns():
    index, queries = flat_index_and_queries()
    want_scores, want_ids = index.search(queries, 10)
    got_scores, got_ids = TorchExactIndex.of(index, "cpu").search(queries, 10)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_scores, want_scores, rtol=1e-5, atol=1e-5)
    assert TorchExactIndex.of(index, "cpu").search(queries, 10_000)[1].shape == (7, 500)  # k capped at ntotal
    many = np.repeat(queries, 100, axis=0)  # 700 queries: three blocks
    _, many_ids = TorchExactIndex.of(index, "cpu").search(many, 10)
    np.testing.assert_array_equal(many_ids, np.repeat(want_ids, 100, axis=0))
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):  # the pool scored in n slices, each query alone too
            torch.set_num_threads(n)
            np.testing.assert_array_equal(TorchExactIndex.of(index, "cpu").search(queries, 10)[1], want_ids)
            alone = [TorchExactIndex.of(index, "cpu").search(q[None], 10)[1][0] for q in queries]
            np.testing.assert_array_equal(np.stack(alone), want_ids)
    finally:
        torch.set_num_threads(threads)
    assert TorchExactIndex(torch.zeros(0, 16)).search(queries, 10)[1].shape == (7, 0)  # no pool, no slices


@pytest.mark.parametrize("first", [FP16_PASS, BF16_PASS], ids=["fp16", "bf16"])
def test_two_pass_search_is_exact_and_searches_again_when_the_first_pass_cannot_tell(monkeypatch, first):
    full_passes: list[int] = []  # queries searched over the whole pool in float32, call by call

    def searcher_of(index):  # the pool in ``first``'s dtype first
        searcher = TorchExactIndex(torch.from_numpy(index.reconstruct_n(0, index.ntotal)), passes=[first])
        scores = searcher._scores
        monkeypatch.setattr(
            searcher, "_scores", lambda block: full_passes.append(len(block)) or scores(block)
        )
        return searcher

    index, queries = flat_index_and_queries()
    want_scores, want_ids = index.search(queries[:4], 10)
    got_scores, got_ids = searcher_of(index).search(queries[:4], 10)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_scores, want_scores, rtol=1e-5, atol=1e-5)
    assert full_passes == []  # all certain from the first pass: random vectors are far apart
    # One direction and copies a hair apart: the first pass cannot rank them, so float32 searches again.
    rng = np.random.default_rng(1)
    close = faiss_flat(rng.standard_normal(16) + 1e-4 * rng.standard_normal((500, 16)))
    lone = close.reconstruct(0)[None] * 3
    searcher = searcher_of(close)
    np.testing.assert_array_equal(searcher.search(lone, 10)[1], close.search(lone, 10)[1])
    assert full_passes == [1]
    zero_scores, zero_ids = searcher.search(np.zeros((1, 16), dtype="float32"), 10)  # no direction at all
    assert zero_ids.shape == (1, 10) and not zero_scores.any()
    low = searcher._passes[0]
    for _ in range(64):  # 4 x 64 more it cannot tell: it stops paying, and searches go to float32 alone
        searcher.search(np.repeat(lone, 4, axis=0), 10)
    assert low.queries == 258 and not low.pays()
    searcher.search(lone, 10)
    assert low.queries == 258 and full_passes[-1] == 1
    assert TorchExactIndex(torch.ones(600, 16), passes=())._passes == []


@pytest.mark.parametrize("first", [FP16_PASS, BF16_PASS], ids=["fp16", "bf16"])
def test_two_pass_search_within_a_mask_is_exact_for_every_share_allowed(monkeypatch, first):
    rng = np.random.default_rng(2)
    vectors, queries = rng.standard_normal((500, 16)), rng.standard_normal((4, 16)).astype("float32")
    allow = np.zeros((4, 500), dtype=bool)
    # none, fewer than k, fewer than the 2k + 64 candidates, all
    for row, share in enumerate((0, 3, 50, 500)):
        allow[row, rng.choice(500, share, replace=False)] = True
    searcher = TorchExactIndex(torch.from_numpy(vectors).float(), passes=[first])
    full_passes: list[int] = []
    scores = searcher._scores
    monkeypatch.setattr(searcher, "_scores", lambda block: full_passes.append(len(block)) or scores(block))
    want = best_within(vectors, queries, 10, allow)
    assert (want == -1).sum() == 10 + 7  # the first query gets none, the second 3 of its 10
    got_scores, got_ids = searcher.search_within(queries, 10, allow)
    np.testing.assert_array_equal(got_ids, want)
    np.testing.assert_array_equal(np.isinf(got_scores), want == -1)
    for row, width in enumerate((0, 3, 10, 10)):  # alone, k is what the query allows, at most 10
        lone = searcher.search_within(queries[row : row + 1], 10, allow[row : row + 1])[1]
        np.testing.assert_array_equal(lone, want[row : row + 1, :width])
    assert full_passes == [] and searcher._passes[0].queries == 4 + 3  # all certain from the first pass
    # Copies a hair apart, half of them allowed: the first pass cannot rank them, float32 searches again
    close = rng.standard_normal(16) + 1e-4 * rng.standard_normal((500, 16))
    lone, half = close[:1].astype("float32") * 3, rng.random((1, 500)) < 0.5
    searcher = TorchExactIndex(torch.from_numpy(close).float(), passes=[first])
    scores = searcher._scores
    monkeypatch.setattr(searcher, "_scores", lambda block: full_passes.append(len(block)) or scores(block))
    np.testing.assert_array_equal(
        searcher.search_within(lone, 10, half)[1], best_within(close, lone, 10, half)
    )
    assert full_passes == [1]


@pytest.mark.parametrize(
    ("amx", "bf16", "want", "served"),
    [
        (True, True, [("bfloat16", 2, 256)], [16 + 17]),
        (False, True, [("float16", 1, 2), ("bfloat16", 1, 256)], [1, 16 + 17]),
        (False, False, [("float16", 1, 4)], [1]),
    ],
    ids=["amx", "bf16-dot", "neither"],
)
def test_the_default_first_passes_are_those_that_pay_as_served_on_this_cpu(
    monkeypatch, amx, bf16, want, served
):
    import coreply.device

    monkeypatch.setattr(coreply.device, "cpu_has_amx", lambda: amx)
    monkeypatch.setattr(coreply.device, "cpu_has_bf16_dot", lambda: bf16)
    index, queries = flat_index_and_queries()
    searcher = TorchExactIndex.of(index, "cpu")
    passes = searcher._passes
    assert [(low.first.dtype, low.first.min_queries, low.first.max_queries) for low in passes] == want
    for size in (1, 16, 17):  # each block by the pass for its size, or one float32 pass: the same ids
        block = np.resize(queries, (size, queries.shape[1]))
        np.testing.assert_array_equal(searcher.search(block, 10)[1], index.search(block, 10)[1])
    assert [low.queries for low in passes] == served


def test_search_moves_only_exact_indexes(tiny_bundle):
    bundle = load_bundle(tiny_bundle)
    moved = search_on(bundle, "cpu")
    assert isinstance(moved.index, TorchExactIndex) and moved.index.ntotal == bundle.index.ntotal
    queries = bundle.index.reconstruct_n(0, 3)
    np.testing.assert_array_equal(moved.index.search(queries, 5)[1], bundle.index.search(queries, 5)[1])
    approximate = load_bundle(tiny_bundle)
    approximate.manifest["index"]["factory"] = "HNSW32"
    assert search_on(approximate, "cuda").index is approximate.index  # stays in FAISS; CUDA never touched


def test_a_bundle_owns_copies_of_its_models(tmp_path, tiny_core):
    """Overwriting the training checkpoint in place (a resumed run, a `cp` over it) leaves the bundle
    intact: the builder copies model files rather than hard-linking them."""
    source = tmp_path / "bi"
    shutil.copytree(tiny_core / "bi", source)
    build_bundle(tmp_path / "bundle", toy_pool(), bi=str(source), onnx="none", progress=False)
    weights = next(p for p in source.rglob("*.safetensors"))
    with open(weights, "r+b") as fh:  # in place: same inode, last byte flipped
        fh.seek(-1, 2)
        last = fh.read(1)[0]
        fh.seek(-1, 2)
        fh.write(bytes([last ^ 1]))
    load_bundle(tmp_path / "bundle")  # every hash still matches


def test_the_restatement_guard_is_calibrated_at_build_and_drops_exactly_what_reaches_it(guarded_bundle):
    from conftest import RESTATED, TOPICS

    from coreply.responder import Responder
    from coreply.restatement import Guard
    from coreply.vectors import unit
    from index_builder.info import describe

    entry = load_bundle(guarded_bundle).manifest["restatement"]
    assert entry["quantile"] == 0.99 and entry["calibrated_on"] == "48 held-out pairs"
    # each of the three thresholds is a quantile (0.99; words 0.995), so it drops its top reply: 1 % of 48.
    # A toy pair's 6 copies share the last turn, so on it and its words they tie and go together (6 each);
    # their earlier turns differ by round ("hi how are you N"), so that threshold drops 1 to 6 of them
    assert 6 <= round(entry["human_replies_dropped"] * 48) <= 18
    assert dict(describe(guarded_bundle))["guard"].startswith(
        f"drops answers restating the context: cosine >= {entry['last_turn']} with the last turn"
    )
    bot = Responder.load(guarded_bundle, backend="torch")
    guard = Guard.of(entry)
    assert bot.pipeline.guard == guard
    context = ["hello", TOPICS["food"][0]]
    everything = bot.respond(context, 13, 13, "retrieval", allow_restatements=True)  # the pool but the echo
    assert len(everything) == 13 and RESTATED in [r.text for r in everything]
    texts = [r.text for r in everything]
    turns = unit(bot.pipeline.retrieve.encode_responses(context))  # [2, D]
    cosine = unit(bot.pipeline.retrieve.encode_responses(texts)) @ turns.T  # [13, 2]
    restating = {
        t for t, (e, last) in zip(texts, cosine, strict=True) if last >= guard.last or e >= guard.earlier
    }
    assert RESTATED in restating and len(restating) < len(texts)  # the guard is not vacuous, nor total
    guarded = bot.respond(context, 13 - len(restating), 13, "retrieval")
    assert [r.text for r in guarded] == [t for t in texts if t not in restating]


@pytest.fixture
def prior_bundle(tmp_path, tiny_core, toy_pairs):
    """The tiny retriever over the toy pool with a response prior: reference contexts from the first 24
    pairs, its weight chosen on the rest."""
    path = tmp_path / "prior"
    build_bundle(
        path,
        toy_pool(),
        bi=str(tiny_core / "bi"),
        onnx="none",
        progress=False,
        guard_pairs=toy_pairs[24:],
        guard_quantile=None,
        prior_pairs=toy_pairs[:24],
    )
    return path


def test_a_response_prior_is_measured_stored_and_served(prior_bundle, toy_pairs):
    from coreply.bundle import IndexRetriever
    from coreply.prior import ALPHAS, Prior, neighbourhood, own_conversations

    bundle = load_bundle(prior_bundle)
    entry = bundle.manifest["prior"]
    assert "prior.npy" in bundle.manifest["files"] and entry["reference_contexts"] == 24
    assert set(entry["hits@1"]) == {f"{a:g}" for a in ALPHAS} and entry["alpha"] in ALPHAS
    assert bundle.prior is not None and bundle.prior.alpha == entry["alpha"]
    from index_builder.info import describe

    assert (
        f"less {entry['alpha']} x each response's mean score against its 24 closest of 24"
        in dict(describe(prior_bundle))["prior"]
    )
    backend = make_backend(bundle)
    vectors = bundle.index.reconstruct_n(0, bundle.index.ntotal)
    contexts = backend.encode_contexts([p.context for p in toy_pairs[:24]])
    masked = own_conversations(bundle.keys, toy_pairs[:24], toy_pairs[:24])
    assert masked  # "hello" opens every toy context and is in the pool
    np.testing.assert_allclose(
        bundle.prior.values, neighbourhood(vectors, contexts, masked=masked), rtol=1e-5
    )
    # served: the retriever's hits are the whole pool's scores less the prior, best first
    prior = Prior(1.0, bundle.prior.values)
    hits = IndexRetriever(backend, bundle.index, prior)([p.context for p in toy_pairs[24:30]], 5)
    queries = backend.encode_contexts([p.context for p in toy_pairs[24:30]])
    expected = queries @ vectors.T - bundle.prior.values[None, :]  # [6, N]
    np.testing.assert_allclose(hits.scores, -np.sort(-expected, axis=1)[:, :5], rtol=1e-5)
    assert hits.ids.shape == (6, 5)


def test_evaluation_fits_and_serves_the_prior_the_bundle_does(prior_bundle, tiny_core, toy_pairs):
    """`coreply eval` recalls through the prior a bundle of the same retriever would serve."""
    from coreply.bundle import IndexRetriever
    from coreply.checkpoint import load_bi
    from coreply.prior import Prior, fit
    from evaluation.protocols import DenseRetriever

    bundle = load_bundle(prior_bundle)
    retrieve = DenseRetriever(load_bi(str(tiny_core / "bi"), "cpu"), bundle.texts)
    vectors = retrieve.index.vectors.numpy()
    fitted, entry = fit(
        retrieve.encode_contexts, retrieve.search, vectors, bundle.keys, toy_pairs[:24], toy_pairs[24:]
    )
    assert entry == bundle.manifest["prior"]
    np.testing.assert_allclose(fitted.values, bundle.prior.values, rtol=1e-4, atol=1e-5)
    retrieve.prior = Prior(1.0, fitted.values)  # a weight that moves the order
    contexts = [p.context for p in toy_pairs[24:]]
    served = IndexRetriever(make_backend(bundle), bundle.index, Prior(1.0, bundle.prior.values))(contexts, 5)
    evaluated = retrieve(contexts, 5)
    np.testing.assert_array_equal(evaluated.ids, served.ids)
    unrescored = DenseRetriever(retrieve.bi, bundle.texts)(contexts, 5)
    assert (unrescored.ids != evaluated.ids).any()  # the prior did move something


def test_added_responses_get_the_median_prior_and_a_bad_prior_file_is_refused(tmp_path, prior_bundle):
    from coreply.bundle import PRIOR

    before = load_bundle(prior_bundle)
    manifest = add_responses(prior_bundle, ["a brand new reply", "another new one"], False)
    after = load_bundle(prior_bundle)
    np.testing.assert_array_equal(after.prior.values[: len(before.texts)], before.prior.values)
    np.testing.assert_array_equal(after.prior.values[-2:], [np.median(before.prior.values)] * 2)
    assert manifest["prior"]["added_at_median"] == 2
    short = resealed(
        prior_bundle, tmp_path, manifest, lambda work: np.save(work / PRIOR, after.prior.values[:-1])
    )
    with pytest.raises(BundleError, match=r"prior\.npy must hold one finite float32 per response \(15\)"):
        load_bundle(short)


def test_a_residual_reranker_is_served_as_a_sum_behind_its_own_retriever_only(
    tmp_path, tiny_core, tiny_model_dir, toy_pairs
):
    """A reranker trained with --cross-residual corrects one retriever's scores: a bundle with another
    retriever is refused, and with its own one the default fusion is their sum."""
    from conftest import train_toy

    from coreply.config import ModelConfig
    from service.app import create_app
    from service.settings import Settings

    model = ModelConfig(base_model=str(tiny_model_dir), dropout=0.0)
    train_toy(tmp_path / "res", model, toy_pairs, mode="independent", models="cross", cross_residual=True,
              init_bi=str(tiny_core / "bi"), max_steps=4, eval_every=4)  # fmt: skip
    cross = str(tmp_path / "res" / "cross")
    with pytest.raises(ValueError, match="correction to retriever"):
        build_bundle(tmp_path / "other", toy_pool(), cross=cross, onnx="none", progress=False)  # zero-shot
    assert not (tmp_path / "other").exists()
    with pytest.raises(ValueError, match="--lexical: a residual reranker"):
        build_bundle(tmp_path / "b", toy_pool(), bi=str(tiny_core / "bi"), cross=cross, onnx="none",
                     lexical_weight=0.5, progress=False)  # fmt: skip
    build_bundle(tmp_path / "b", toy_pool(), bi=str(tiny_core / "bi"), cross=cross, onnx="none",
                 calibration=toy_pairs[:8], progress=False)  # fmt: skip
    fusion = load_bundle(tmp_path / "b").manifest["fusion"]
    assert fusion["default"] == "sum" and "zscore_weight" in fusion
    from fastapi.testclient import TestClient

    settings = Settings(bundle=tmp_path / "b", threads=1, backend="torch", rerank_gate=False)  # always rerank
    with TestClient(create_app(settings)) as client:
        got = client.post("/respond", json={"context": list(toy_pairs[0].context), "top_k": 2})
    assert got.status_code == 200 and got.json()["fusion"] == "sum"


def test_a_lexical_stage_reorders_the_dense_candidates_as_the_bm25_bench_does(lexical_bundle, toy_pairs):
    """The served stage against bench/hybrid_bm25.py's way: the dense pipeline's candidates, BM25 fitted
    afresh on the pool (not the bundle's stored statistics), z-score fusion in evaluation's ``ranked_ids``."""
    from bm25s.stopwords import STOPWORDS_EN
    from conftest import LEXICAL_WEIGHT

    from coreply.lexical import BM25
    from coreply.responder import Responder
    from evaluation.protocols import ranked_ids, retrieve_and_rerank
    from index_builder.info import describe

    bot = Responder.load(lexical_bundle, backend="torch")
    entry = bot.bundle.manifest["lexical"]
    assert (
        entry["weight"] == LEXICAL_WEIGHT
        and entry["depth"] == 8
        and "lexical.json" in bot.bundle.manifest["files"]
    )
    assert dict(describe(lexical_bundle))["lexical"].startswith("BM25 reorders the first 8 candidates")
    stage, bot.pipeline.lexical = bot.pipeline.lexical, None  # the dense stage alone, as the bench takes it
    pairs = [p for p in toy_pairs[::5]]
    got = retrieve_and_rerank(pairs, bot.pipeline, 8, 0)
    fresh = BM25.fit(bot.bundle.texts, STOPWORDS_EN)
    full = [fresh.scores(" ".join(p.context), bot.bundle.texts) for p in pairs]  # [P] per pair
    for c, scores in zip(got.candidates, full, strict=True):
        c.rerank = scores[c.ids]
    expected = ranked_ids(got, "zscore", 8, LEXICAL_WEIGHT)
    bot.pipeline.lexical = stage
    reordered = 0
    for pair, want, dense, scores in zip(pairs, expected, got.candidates, full, strict=True):
        replies = bot.respond(list(pair.context), top_k=3, n_candidates=3, fusion="retrieval")
        assert [r.id for r in replies] == want[:3].tolist()
        assert [r.lexical_score for r in replies] == pytest.approx([scores[r.id] for r in replies])
        reordered += [r.id for r in replies] != dense.ids[:3].tolist()
    assert reordered  # the stage changed some answer


def test_a_lexical_stage_is_chosen_on_pairs_counted_on_add_and_checked_on_load(
    tmp_path, tiny_core, toy_pairs
):
    from bm25s.stopwords import STOPWORDS_EN
    from conftest import TOPICS

    from coreply.bundle import LEXICAL
    from coreply.corpus import Pair
    from coreply.lexical import BM25

    cues = [Pair((f"so, {a.split()[-1]} or {a.split()[-3]}?",), a, n) for n, (_, a) in TOPICS.items()]
    chosen = build_bundle(tmp_path / "cues", toy_pool(), bi=str(tiny_core / "bi"), onnx="none",
                          lexical_pairs=cues, progress=False)  # fmt: skip
    hits = chosen["lexical"]["hits@1"]  # the answer's own words help where the toy retriever was not trained
    assert 0 <= chosen["lexical"]["weight"] < 1 and hits["with lexical"] > hits["dense"]
    assert chosen["lexical"]["calibrated_on"] == "8 held-out pairs, hits@1 of the first answer"
    none = build_bundle(tmp_path / "toy", toy_pool(), bi=str(tiny_core / "bi"), onnx="none",
                        lexical_pairs=toy_pairs[:24], progress=False)  # fmt: skip
    assert "lexical" not in none and not (tmp_path / "toy" / LEXICAL).exists()  # trained on them: no gain
    models = {"bi": str(tiny_core / "bi"), "cross": str(tiny_core / "cross")}
    reranked = build_bundle(tmp_path / "b", toy_pool(), **models, onnx="none", lexical_weight=0.5,
                            calibration=toy_pairs[:8], progress=False)  # fmt: skip
    assert "zscore_weight" in reranked["fusion"]  # calibrated through the lexical stage, reranked after it
    manifest = add_responses(tmp_path / "b", ["a brand new reply about zebras", "hello"], False)
    after = load_bundle(tmp_path / "b")
    assert after.lexical.bm25 == BM25.fit([*toy_pool(), "a brand new reply about zebras"], STOPWORDS_EN)
    assert after.lexical.weight == 0.5
    other_pool = json.dumps(BM25.fit(toy_pool(), STOPWORDS_EN).to_json())  # the statistics before the add
    stale = resealed(tmp_path / "b", tmp_path, manifest, lambda work: (work / LEXICAL).write_text(other_pool))
    with pytest.raises(BundleError, match=r"lexical\.json describes 13 responses, the pool holds 14"):
        load_bundle(stale)
    with pytest.raises(ValueError, match="--lexical: give a weight in"):
        build_bundle(tmp_path / "c", toy_pool(), onnx="none", lexical_weight=1.5, progress=False)


@pytest.mark.parametrize(
    "stages",
    [("restatement", "prior", "fusion"), ("prior", "lexical", "fusion")],  # the guard drops the lexical cues
    ids=lambda stages: "+".join(stages),
)
def test_a_build_with_pinned_choices_is_the_calibrated_build_without_calibrating(
    tmp_path, tiny_core, toy_pairs, monkeypatch, stages
):
    """A reference build's choices (``pins_of``) make the same bundle elsewhere: the same manifest entries
    (each marked pinned), prior and lexical statistics, and none of the calibration's work is done, so
    no held-out pairs are needed."""
    from conftest import TOPICS

    from coreply import prior, restatement
    from coreply.bundle import CALIBRATED, PRIOR
    from coreply.corpus import Pair
    from index_builder import build
    from index_builder.build import pins_of

    cues = [Pair((f"so, {a.split()[-1]} or {a.split()[-3]}?",), a, n) for n, (_, a) in TOPICS.items()]
    models = {"bi": str(tiny_core / "bi"), "cross": str(tiny_core / "cross")}
    guard = 0.99 if "restatement" in stages else None
    options = {"onnx": "none", "progress": False, "prior_pairs": toy_pairs[:24], "guard_quantile": guard}
    held_out = {"guard_pairs": toy_pairs[24:], "calibration": toy_pairs[:16]}
    held_out["lexical_pairs"] = cues if "lexical" in stages else ()
    calibrated = build_bundle(tmp_path / "ref", toy_pool(), **models, **options, **held_out)
    assert tuple(n for n in CALIBRATED if calibrated.get(n)) == stages
    pins = pins_of(calibrated, "the reference build")

    def no_calibration(*args, **kwargs):
        raise AssertionError("a pinned build calibrated")

    for module, name in [(restatement, "calibrate"), (prior, "choose_alpha"), (build, "retrieve_and_rerank")]:
        monkeypatch.setattr(module, name, no_calibration)
    pinned = build_bundle(tmp_path / "pinned", toy_pool(), **models, **options, pinned=pins)  # no pairs
    for name in stages:
        assert pinned[name] == calibrated[name] | {"pinned": "the reference build"}
    assert pinned["files"] == calibrated["files"]  # the prior's values and lexical statistics among them
    assert pins_of(pinned, "the reference build") == pins  # pinning a pinned build changes nothing
    from index_builder.info import describe

    said, before = dict(describe(tmp_path / "pinned")), dict(describe(tmp_path / "ref"))
    assert said["choices"] == "pinned from the reference build" and "choices" not in before
    assert said["prior"] == before["prior"].replace("(", "(pinned: ", 1)  # made by another build
    assert "(pinned: " in said["fusion"] and "pinned" not in before["fusion"]
    with pytest.raises(ValueError, match="need a 'source'"):
        build_bundle(tmp_path / "x", toy_pool(), **models, pinned={"fusion": pins["fusion"]})
    with pytest.raises(ValueError, match="entries among"):
        build_bundle(tmp_path / "x", toy_pool(), **models, pinned=pins | {"guard": {}})
    with pytest.raises(ValueError, match=r"stages this build does not have: \['fusion'\]"):
        build_bundle(tmp_path / "x", toy_pool(), bi=models["bi"], **options, pinned=pins)  # no reranker
    assert not (tmp_path / "x").exists()

    # The reference build's rho as well: no reference contexts are read or encoded.
    monkeypatch.setattr(prior, "neighbourhood", no_calibration)
    rho = np.load(tmp_path / "ref" / PRIOR)
    no_reference = options | {"prior_pairs": ()}
    source = {"rho": rho, "rho_source": "the reference build's"}
    given = build_bundle(tmp_path / "rho", toy_pool(), **models, **no_reference, pinned=pins, **source)
    assert given["prior"] == pinned["prior"] | {"rho": "the reference build's"}
    assert given["files"] == calibrated["files"]
    assert pins_of(given, "the reference build") == pins
    choices = "pinned from the reference build; the prior's values from the reference build's"
    assert dict(describe(tmp_path / "rho"))["choices"] == choices
    without_prior = {name: entry for name, entry in pins.items() if name != "prior"}
    with pytest.raises(ValueError, match="pinned rho needs the prior's pinned entry"):
        build_bundle(tmp_path / "x", toy_pool(), **models, **options, pinned=without_prior, **source)
    with pytest.raises(ValueError, match="and a rho_source"):
        build_bundle(tmp_path / "x", toy_pool(), **models, **options, pinned=pins, rho=rho)
    short = source | {"rho": rho[:3]}
    with pytest.raises(ValueError, match=rf"pinned rho: \(3,\) values \(finite\?\) for a pool of {len(rho)}"):
        build_bundle(tmp_path / "x", toy_pool(), **models, **options, pinned=pins, **short)
    assert not (tmp_path / "x").exists()
