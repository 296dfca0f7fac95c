"""The service in process (Starlette's TestClient runs the lifespan): validation limits, echo and
exclude filtering, fusion, metrics, and the micro-batcher."""

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import SAYS_NOTHING, TOPICS, Gate
from fastapi.testclient import TestClient

from coreply.bundle import load_bundle
from coreply.gate import lead
from coreply.ranking import Query, zscore
from coreply.responder import Responder
from index_builder.build import build_bundle
from service.app import create_app
from service.batching import DeadlineExceeded, MicroBatcher, Overloaded
from service.routes import build_router
from service.schemas import respond_request_model
from service.settings import Settings

LIMITS = dict(
    default_candidates=6,
    max_turns=4,
    max_utterance_chars=50,
    max_top_k=5,
    max_candidates=8,
    max_exclude=3,
    max_body_bytes=2048,
)


@pytest.fixture(scope="module")
def client(tiny_bundle):
    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=1, **LIMITS))) as c:
        yield c


def post(client, **body):
    return client.post("/respond", json=body)


def test_ready_and_health(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and ready["reranker"] and ready["backend"] == "onnx"
    assert ready["threads"] == 1 and ready["responses"] == 13 and ready["withdrawn"] == 0
    assert ready["filter_fields"] == []  # the toy pool gave no metadata


def test_no_route_hands_a_dependency_to_a_worker_thread(tiny_bundle):
    """FastAPI runs a plain-function dependency on its thread pool: a hand-over there and back on every
    request (docs/performance.md §31). Every dependency of every route is a coroutine, with API keys on
    and off."""
    for keys in ("", "k1"):
        settings = Settings(bundle=tiny_bundle, api_keys=keys)
        router = build_router(settings, respond_request_model(settings))
        pending = [route.dependant for route in router.routes]
        assert len(pending) == 4  # /respond, /healthz, /readyz, /metrics
        while pending:
            dependant = pending.pop()
            for dependency in dependant.dependencies:
                assert asyncio.iscoroutinefunction(dependency.call), dependency.call
                pending.append(dependency)


def test_respond_ranks_by_fused_score(client):
    question, answer = TOPICS["pet"]
    body = post(client, context=["hello", question], top_k=5, fusion="sum").json()
    scores = [r["score"] for r in body["responses"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == 5
    for r in body["responses"]:
        assert r["score"] == pytest.approx(r["retrieval_score"] + r["rerank_score"])
    assert body["responses"][0]["text"] == answer  # the toy models learned this topic
    stages = {"total", "queue_wait", "encode", "search", "filter", "lexical", "knowledge", "rerank"}
    assert set(body["timings_ms"]) == stages
    assert body["timings_ms"]["total"] >= body["timings_ms"]["encode"] > 0 == body["timings_ms"]["lexical"]
    assert body["n_candidates"] == 6 and body["fusion"] == "sum"


def test_fusion_modes(client, tiny_bundle):
    context = ["what is your favorite food ?"]
    retrieval = post(client, context=context, top_k=3, fusion="retrieval").json()
    assert all(r["rerank_score"] is None for r in retrieval["responses"])
    assert retrieval["timings_ms"]["rerank"] == 0
    rerank = post(client, context=context, top_k=3, fusion="rerank").json()
    assert [r["score"] for r in rerank["responses"]] == [r["rerank_score"] for r in rerank["responses"]]
    calibrated = load_bundle(tiny_bundle).manifest["fusion"]  # at build time
    default = post(client, context=context, top_k=5, n_candidates=5).json()  # every candidate returned
    assert default["fusion"] == ("retrieval" if default["rerank_gated"] else calibrated["default"])
    assert len(default["responses"]) == 5
    for fusion in ("zscore", "sum"):
        got = post(client, context=context, top_k=5, n_candidates=5, fusion=fusion).json()["responses"]
        r = np.array([c["retrieval_score"] for c in got])
        g = np.array([c["rerank_score"] for c in got])
        weight = calibrated["zscore_weight"]
        want = weight * zscore(r) + (1 - weight) * zscore(g) if fusion == "zscore" else r + g
        np.testing.assert_allclose([c["score"] for c in got], want, atol=1e-6)


def test_service_and_evaluation_rank_identically(tiny_bundle):
    """The same contexts through ``/respond`` and through protocol B's code (the evaluation's
    retrieve_and_rerank + ranked_ids, on the bundle's own backend and index) give the same answers.
    PyTorch fp32 on both sides: the evaluation batches all contexts, the service one at a time, and int8
    ONNX quantises activations per batch."""
    from coreply.bundle import make_backend, pipeline
    from coreply.corpus import Pair
    from evaluation.protocols import ranked_ids, retrieve_and_rerank

    bundle = load_bundle(tiny_bundle)
    backend = make_backend(bundle, "torch", threads=1)
    weight = bundle.manifest["fusion"]["zscore_weight"]
    contexts = [["hello", q] for q, _ in TOPICS.values()] + [[a] for _, a in TOPICS.values()]
    pairs = [Pair(tuple(c), "") for c in contexts]
    got = retrieve_and_rerank(pairs, pipeline(bundle, backend), 5, 5)
    gate = float(np.median([lead(c) for c in got.candidates]))  # about half the contexts pass it
    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=1, backend="torch", **LIMITS))) as c:
        engine = c.app.state.engine
        engine.pipeline.gate = gate
        for fusion in ("retrieval", "rerank", "sum", "zscore", None):  # None: the default, gated
            body = {} if fusion is None else {"fusion": fusion}
            answers = [post(c, context=x, top_k=5, n_candidates=5, **body).json() for x in contexts]
            ids = ranked_ids(got, fusion or engine.default_fusion, 5, weight, None if fusion else gate)
            assert [[r["id"] for r in a["responses"]] for a in answers] == [i.tolist() for i in ids], fusion
        assert 0 < sum(a["rerank_gated"] for a in answers) < len(answers)
        engine.pipeline.gate, engine.pipeline.reach = None, 2 * gate  # the reach alone: one answer each
        answers = [post(c, context=x, n_candidates=5).json() for x in contexts]
        ids = ranked_ids(got, engine.default_fusion, 5, weight, None, 2 * gate)
        assert [[r["id"] for r in a["responses"]] for a in answers] == [i[:1].tolist() for i in ids]
        assert 1 < np.mean([a["reranked"] for a in answers]) < 5


def test_a_request_that_names_no_fusion_skips_the_reranker_where_the_first_stage_leads_past_the_gate(
    tiny_bundle,
):
    context = ["what is your favorite food ?"]
    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=1, **LIMITS))) as c:
        engine = c.app.state.engine
        fusion = engine.default_fusion
        (candidates,) = engine.pipeline.recall([Query(tuple(context))], [5])
        # served scores may differ from these in the last float bits (another thread, another batch)
        engine.pipeline.gate = lead(candidates) - 1e-3  # reached: the first stage answers
        gated = post(c, context=context, top_k=3, n_candidates=5).json()
        assert gated["rerank_gated"] and gated["fusion"] == "retrieval" and gated["timings_ms"]["rerank"] == 0
        assert all(r["rerank_score"] is None for r in gated["responses"])
        named = post(c, context=context, top_k=3, n_candidates=5, fusion=fusion).json()  # always reranks
        assert not named["rerank_gated"] and named["fusion"] == fusion
        engine.pipeline.gate = lead(candidates) + 1e-3  # not reached
        assert post(c, context=context, n_candidates=5).json()["fusion"] == fusion
        assert c.get("/readyz").json()["rerank_gate"] == engine.pipeline.gate
    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=1, rerank_gate=False, **LIMITS))) as c:
        c.app.state.engine.pipeline.gate = -1.0  # every lead reaches it, and it is off
        got = post(c, context=context, n_candidates=5).json()
        assert not got["rerank_gated"] and got["fusion"] == fusion
        assert c.get("/readyz").json()["rerank_gate"] is None


def test_a_request_that_names_no_fusion_reranks_only_the_candidates_within_the_reach(tiny_bundle):
    context = ["what is your favorite food ?"]
    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=1, **LIMITS))) as c:
        engine = c.app.state.engine
        fusion = engine.default_fusion
        (candidates,) = engine.pipeline.recall([Query(tuple(context))], [5])
        behind = candidates.first_stage[0] - candidates.first_stage  # [5] how far each trails the first
        assert behind[3] - behind[2] > 1e-3  # served scores may differ from these in the last bits
        engine.pipeline.gate, engine.pipeline.reach = None, (behind[2] + behind[3]) / 2  # reads three
        got = post(c, context=context, n_candidates=5).json()
        assert got["reranked"] == 3 and not got["rerank_gated"] and got["fusion"] == fusion
        named = post(c, context=context, top_k=5, n_candidates=5, fusion=fusion).json()  # reads all
        assert named["reranked"] == 5
        score = {r["id"]: r["score"] for r in named["responses"]}
        assert got["responses"][0]["id"] == max(candidates.ids[:3].tolist(), key=score.__getitem__)
        assert post(c, context=context, top_k=4, n_candidates=5).json()["reranked"] == 4  # >= top_k
        assert c.get("/readyz").json()["rerank_reach"] == engine.pipeline.reach
        bot = Responder.load(tiny_bundle)  # the library answers alike
        bot.pipeline.gate, bot.pipeline.reach = None, engine.pipeline.reach
        assert bot.respond(context, n_candidates=5)[0].id == got["responses"][0]["id"]
    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=1, rerank_gate=False, **LIMITS))) as c:
        c.app.state.engine.pipeline.reach = 1e-9  # it would read one, and it is off
        assert post(c, context=context, n_candidates=5).json()["reranked"] == 5
        assert c.get("/readyz").json()["rerank_reach"] is None


def test_the_service_guards_against_restatements_like_the_library_unless_a_request_allows_them(
    guarded_bundle,
):
    from conftest import RESTATED

    from coreply.responder import Responder

    bot = Responder.load(guarded_bundle, backend="torch")
    context = ["hello", TOPICS["food"][0]]
    with TestClient(create_app(Settings(bundle=guarded_bundle, threads=1, backend="torch", **LIMITS))) as c:
        ready = c.get("/readyz").json()
        assert ready["restatement_guard"] == load_bundle(guarded_bundle).manifest["restatement"]
        assert ready["response_prior"] is None  # built without one
        for allow in (False, True):
            got = post(
                c, context=context, top_k=5, n_candidates=8, fusion="retrieval", allow_restatements=allow
            )
            want = bot.respond(context, 5, 8, "retrieval", allow_restatements=allow)
            assert [r["text"] for r in got.json()["responses"]] == [r.text for r in want]
            assert (RESTATED in [r.text for r in want]) == allow  # it ranks in the top 5 when allowed
        bad = post(c, context=context, allow_restatements="yes")
        assert bad.status_code == 422 and "allow_restatements" in bad.text
        metrics = c.get("/metrics").text
        assert 'coreply_stage_duration_seconds_count{stage="filter"} 2.0' in metrics  # not the warm-up


def test_answers_are_distinct_unless_a_request_allows_spelling_variants(variants_bundle):
    """Over a pool holding variants of two answers, every candidate asked for: by default each variant
    after its best-ranked form is passed over (the service as the library), with it they all come back in
    the order the variants are passed over in; a smaller ``top_k`` is filled from further down, past a
    rerank reach too (the candidate there has no rerank score)."""
    from coreply.text import variant_key

    bot = Responder.load(variants_bundle, backend="torch")
    n = len(bot.bundle.texts)
    with TestClient(create_app(Settings(bundle=variants_bundle, threads=1, backend="torch"))) as c:
        for context in (["hello", TOPICS["food"][0]], ["ok then"]):
            texts = {}
            for allow in (True, False):
                got = post(c, context=context, top_k=n, n_candidates=n, allow_variants=allow).json()
                want = bot.respond(context, n, n, allow_variants=allow)
                texts[allow] = [r["text"] for r in got["responses"]]
                assert texts[allow] == [r.text for r in want]
            keys = [variant_key(t) for t in texts[True]]
            assert texts[False] == [t for i, t in enumerate(texts[True]) if variant_key(t) not in keys[:i]]
            assert len(texts[False]) == len(set(keys)) < len(texts[True])  # variants were there, and dropped
            top3 = [r["text"] for r in post(c, context=context, top_k=3, n_candidates=n).json()["responses"]]
            assert top3 == texts[False][:3]
        for responder_or_engine in (bot, c.app.state.engine):  # a reach: the reranker reads top_k candidates
            responder_or_engine.pipeline.gate, responder_or_engine.pipeline.reach = None, 0.0
        got = post(c, context=["hi"], top_k=2, n_candidates=n).json()
        assert [r["text"] for r in got["responses"]] == [r.text for r in bot.respond(["hi"], 2, n)]
        assert got["reranked"] == 2 and got["responses"][1]["rerank_score"] is None  # from past the reach
        bad = post(c, context=["hello"], allow_variants="yes")
        assert bad.status_code == 422 and "allow_variants" in bad.text


def test_a_reply_that_says_nothing_is_never_an_answer(variants_bundle):
    """Asked for every candidate, neither the service nor the library answers with a reply that is only
    "..." or "? !"; every other reply of the pool comes back, and /readyz counts none withdrawn."""
    bot = Responder.load(variants_bundle, backend="torch")
    n = len(bot.bundle.texts)
    silent = {i for i, text in enumerate(bot.bundle.texts) if text in SAYS_NOTHING}
    assert len(silent) == len(SAYS_NOTHING)
    with TestClient(create_app(Settings(bundle=variants_bundle, threads=1, backend="torch"))) as c:
        assert c.get("/readyz").json()["withdrawn"] == 0
        for context in (["why?"], ["so what now"]):  # neither is a pool text (an echo)
            got = post(c, context=context, top_k=n, n_candidates=n, allow_variants=True).json()["responses"]
            assert [r["id"] for r in got] == [r.id for r in bot.respond(context, n, n, allow_variants=True)]
            assert len(got) == n - len(silent) and not silent & {r["id"] for r in got}


def test_the_service_serves_a_lexical_stage_like_the_library_and_reports_it(lexical_bundle):
    from coreply.responder import Responder

    bot = Responder.load(lexical_bundle, backend="torch")
    context = ["hello", "i play a sport: tennis, or football?"]
    with TestClient(create_app(Settings(bundle=lexical_bundle, threads=1, backend="torch", **LIMITS))) as c:
        assert c.get("/readyz").json()["lexical"] == load_bundle(lexical_bundle).manifest["lexical"]
        for fusion in ("retrieval", "zscore"):
            body = post(c, context=context, top_k=3, n_candidates=5, fusion=fusion).json()
            want = bot.respond(context, 3, 5, fusion)
            assert [(r["id"], r["lexical_score"]) for r in body["responses"]] == [
                (r.id, pytest.approx(r.lexical_score)) for r in want
            ]
            assert body["responses"][0]["lexical_score"] > 0 and body["timings_ms"]["lexical"] > 0
        metrics = c.get("/metrics").text
        assert 'coreply_stage_duration_seconds_count{stage="lexical"} 2.0' in metrics  # not the warm-up


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_overlapping_stages_answer_concurrent_requests_like_one_thread(tiny_bundle, monkeypatch, backend):
    """With a thread per stage (the default) concurrent requests get the answers of one thread, whatever
    requests share their micro-batches: int8 ONNX too, whose rows run alone (activations are quantised
    per call). The cascade is off: on a loaded host it would rightly shrink n_r."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)  # room for two one-thread teams (test below)
    contexts = [["hello", q] for q, _ in TOPICS.values()] * 3
    body = lambda c: {"context": c, "top_k": 5, "n_candidates": 6, "fusion": "sum"}  # noqa: E731
    options = dict(bundle=tiny_bundle, threads=1, backend=backend, cascade=False, **LIMITS)
    with TestClient(create_app(Settings(**options, overlap_stages=False))) as single:
        want = [[r["id"] for r in post(single, **body(c)).json()["responses"]] for c in contexts]
    settings = Settings(**options)
    with TestClient(create_app(settings)) as overlapped, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda c: overlapped.post("/respond", json=body(c)).json(), contexts))
        names = {t.name.split("_")[0] for t in threading.enumerate()}
    assert [[r["id"] for r in a["responses"]] for a in answers] == want
    assert {"coreply-retrieve", "coreply-rerank"} <= names


def test_stages_share_one_thread_where_two_would_oversubscribe_the_cores(tiny_bundle, monkeypatch):
    """PyTorch on the CPU in both stages with a team as large as the host: one inference thread, said by
    /readyz; ONNX Runtime (its own thread pools) keeps a thread per stage. Loading ran on a thread that
    has ended, so the only threads left running PyTorch are the engine's."""
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    for backend, threads, overlap in (("torch", 2, False), ("torch", 1, True), ("onnx", 2, True)):
        settings = Settings(bundle=tiny_bundle, threads=threads, backend=backend, **LIMITS)
        before = set(threading.enumerate())  # other tests' services may still be up
        with TestClient(create_app(settings)) as c:
            assert c.get("/readyz").json()["overlap_stages"] is overlap
            names = [t.name.split("_")[0] for t in set(threading.enumerate()) - before]
        assert ("coreply-rerank" in names) is overlap and "coreply-once" not in names


def test_echoes_are_never_returned(client):
    _, answer = TOPICS["food"]
    for fusion in ("retrieval", "sum"):
        body = post(client, context=["hi", answer.upper()], top_k=5, n_candidates=8, fusion=fusion).json()
        assert answer not in [r["text"] for r in body["responses"]]


def test_exclude_by_id_and_text(client):
    question, _ = TOPICS["pet"]
    first = post(client, context=[question], top_k=2, fusion="retrieval").json()["responses"]
    by_id = post(client, context=[question], top_k=2, fusion="retrieval", exclude=[first[0]["id"]]).json()
    assert by_id["responses"][0]["id"] == first[1]["id"]
    by_text = post(
        client, context=[question], top_k=2, fusion="retrieval", exclude=[f"  {first[0]['text']} "]
    )
    assert by_text.json()["responses"][0]["id"] == first[1]["id"]


@pytest.mark.parametrize(
    ("field", "ok", "bad"),
    [
        ("context", {"context": ["hi"] * 4}, {"context": ["hi"] * 5}),
        ("context.0", {"context": ["x" * 50]}, {"context": ["x" * 51]}),
        ("top_k", {"context": ["hi"], "top_k": 5}, {"context": ["hi"], "top_k": 6}),
        ("n_candidates", {"context": ["hi"], "n_candidates": 8}, {"context": ["hi"], "n_candidates": 9}),
        (
            "exclude",
            {"context": ["hi"], "exclude": [1, 2, "x"]},
            {"context": ["hi"], "exclude": [1, 2, 3, 4]},
        ),
    ],
)
def test_limits_n_ok_n_plus_one_refused(client, field, ok, bad):
    assert post(client, **ok).status_code == 200
    response = post(client, **bad)
    assert response.status_code == 422
    assert response.json()["error"].startswith(f"{field}:")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "context"),
        ({"context": []}, "context"),
        ({"context": "hello"}, "context"),
        ({"context": ["ok", "   "]}, "context"),
        ({"context": [3]}, "context.0"),
        ({"context": ["hi"], "top_k": 0}, "top_k"),
        ({"context": ["hi"], "top_k": "2"}, "top_k"),
        ({"context": ["hi"], "fusion": "max"}, "fusion"),
        ({"context": ["hi"], "surprise": 1}, "surprise"),
        ({"context": ["hi"], "top_k": 5, "n_candidates": 3}, "top_k"),
        ({"context": ["hi"], "exclude": [3, -1]}, "exclude.1"),
        ({"context": ["hi"], "exclude": [1.5]}, "exclude.0"),
    ],
)
def test_bad_requests_name_the_field(client, body, field):
    response = post(client, **body)
    assert response.status_code == 422, response.text
    assert response.json()["error"].startswith(f"{field}:"), response.json()


def test_body_limit_n_ok_n_plus_one_refused(client):
    body = json.dumps({"context": ["hi"]}).encode()
    exactly = body[:-1] + b" " * (2048 - len(body)) + b"}"  # JSON padded with spaces to the limit
    json_type = {"content-type": "application/json"}
    assert (
        len(exactly) == 2048
        and client.post("/respond", content=exactly, headers=json_type).status_code == 200
    )
    over = exactly[:-1] + b" }"
    assert len(over) == 2049 and client.post("/respond", content=over, headers=json_type).status_code == 413


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-1e999"])
def test_scores_must_be_finite(client, number):
    """Python's JSON reads NaN and overflowing numbers as floats: a threshold of NaN would drop every
    response without a word, so it is refused by name."""
    body = '{"context": ["hi"], "min_retrieval_score": ' + number + "}"
    response = client.post("/respond", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["error"].startswith("min_retrieval_score:")


def test_framework_errors_have_the_same_shape(client, tiny_bundle):
    """No route, a wrong method and a body the parser gives up on answer {"error": ...} as every other
    error does (the method one with its Allow header; the body one saying why)."""
    response = client.get("/nowhere")
    assert response.status_code == 404 and response.json() == {"error": "Not Found"}
    response = client.get("/respond")
    assert response.status_code == 405 and response.json() == {"error": "Method Not Allowed"}
    assert response.headers["allow"] == "POST"
    deep = "[" * 100_000 + "]" * 100_000  # past any Python's JSON nesting limit, under this app's body limit
    settings = Settings(bundle=tiny_bundle, threads=1, **LIMITS | {"max_body_bytes": 1 << 20})
    with TestClient(create_app(settings)) as roomy:
        response = roomy.post("/respond", content=deep, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json() == {"error": "body: JSON nested too deeply"}
    latin1 = '{"context": ["café"]}'.encode("latin-1")
    response = client.post("/respond", content=latin1, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"].startswith("body: not UTF-8 (byte 17)")


def test_body_limits(client):
    response = client.post("/respond", content=json.dumps({"context": ["x" * 3000]}))
    assert response.status_code == 413 and "2048 bytes" in response.json()["error"]
    response = client.post("/respond", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["error"].startswith("body:")


def test_metrics_count_requests(client):
    before = client.get("/metrics").text
    post(client, context=["hi"])
    post(client, context=[])
    text = client.get("/metrics").text

    def value(page, series):
        line = next((ln for ln in page.splitlines() if ln.startswith(series + " ")), None)
        return float(line.split()[-1]) if line else 0.0

    ok = 'coreply_requests_total{route="/respond",status="2xx"}'
    bad = 'coreply_requests_total{route="/respond",status="4xx"}'
    assert value(text, ok) == value(before, ok) + 1
    assert value(text, bad) == value(before, bad) + 1
    assert value(text, 'coreply_request_duration_seconds_count{route="/respond"}') >= 2
    assert 'coreply_stage_duration_seconds_bucket{le="0.01",stage="rerank"}' in text
    client.get("/no/such/path/12345")
    assert "/no/such/path" not in client.get("/metrics").text  # unknown paths share one label


def test_retrieval_only_bundle_refuses_rerank(tmp_path, tiny_core):
    build_bundle(
        tmp_path / "b", [a for _, a in TOPICS.values()], bi=str(tiny_core / "bi"), onnx="none", progress=False
    )
    with TestClient(create_app(Settings(bundle=tmp_path / "b", threads=1))) as c:
        assert c.get("/readyz").json()["backend"] == "torch"
        body = c.post("/respond", json={"context": ["do you have a pet ?"]}).json()
        assert body["fusion"] == "retrieval"
        refused = c.post("/respond", json={"context": ["hi"], "fusion": "sum"})
        assert refused.status_code == 422 and "needs a reranker" in refused.json()["error"]


def test_thread_count_is_measured_when_not_set(tiny_bundle):
    import os

    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=0))) as c:
        ready = c.get("/readyz").json()
        assert ready["threads"] in {1, os.cpu_count()}
        assert c.post("/respond", json={"context": ["hello"]}).status_code == 200


# ---------------------------------------------------------------------------------------- batching


def run_batcher(coro_fn):
    async def main():
        executor = ThreadPoolExecutor(1)
        try:
            return await coro_fn(executor)
        finally:
            executor.shutdown()

    return asyncio.run(main())


def test_concurrent_requests_share_a_batch():
    seen = []

    def run(items):
        seen.append(list(items))
        return [x * 10 for x in items], {"work": 0.0}

    async def scenario(executor):
        batcher = MicroBatcher("t", run, executor, max_size=8, max_wait_s=0.05, max_queue=16)
        batcher.start()
        done = await asyncio.gather(*(batcher.submit(i) for i in range(5)))
        await batcher.stop()
        return done

    done = run_batcher(scenario)
    assert [d.result for d in done] == [0, 10, 20, 30, 40]
    assert seen == [[0, 1, 2, 3, 4]] and all(d.batch_items == 5 for d in done)


def test_batches_are_bounded_and_errors_reach_every_caller():
    sizes = []

    def run(items):
        sizes.append(len(items))
        if "boom" in items:
            raise RuntimeError("model failed")
        return list(items), {}

    async def scenario(executor):
        batcher = MicroBatcher("t", run, executor, max_size=2, max_wait_s=0.05, max_queue=2)
        batcher.start()
        results = await asyncio.gather(*(batcher.submit(x) for x in ("a", "b", "c")), return_exceptions=True)
        with pytest.raises(Overloaded):
            await asyncio.gather(*(batcher.submit(x) for x in "defg"))
        failed = await asyncio.gather(batcher.submit("boom"), batcher.submit("x"), return_exceptions=True)
        await batcher.stop()
        return results, failed

    results, failed = run_batcher(scenario)
    assert [r.result for r in results[:2]] == ["a", "b"]
    assert isinstance(results[2], Overloaded)  # a queue of 2: the third waiting request is refused
    assert max(sizes) <= 2
    assert all(isinstance(f, RuntimeError) for f in failed)


def test_a_stopped_batcher_answers_what_it_holds_and_refuses_more():
    """No caller waits forever on a retired engine: jobs queued or taken at stop() get Overloaded (503,
    retry), and so does a submit after it."""
    started = threading.Event()
    release = threading.Event()

    def run(items):
        started.set()
        release.wait(5)
        return list(items), {}

    async def scenario(executor):
        batcher = MicroBatcher("t", run, executor, max_size=1, max_wait_s=0.0, max_queue=4)
        batcher.start()
        running = asyncio.ensure_future(batcher.submit("a"))
        queued = asyncio.ensure_future(batcher.submit("b"))
        while not started.is_set():
            await asyncio.sleep(0.01)
        await batcher.stop()
        release.set()
        late = await asyncio.gather(asyncio.wait_for(batcher.submit("c"), 2), return_exceptions=True)
        held = asyncio.gather(running, queued, return_exceptions=True)
        return await asyncio.wait_for(held, 5), late  # a timeout here: a caller left waiting

    held, late = run_batcher(scenario)
    assert all(isinstance(r, Overloaded) for r in [*held, *late]), (held, late)


def test_draining_turns_readiness_off_at_once_but_serves_admitted_requests(tiny_bundle):
    app = create_app(Settings(bundle=tiny_bundle, threads=1))
    with TestClient(app) as c:
        assert c.get("/readyz").status_code == 200
        app.begin_drain()  # what the server does on SIGTERM, before it stops accepting
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["error"] == "shutting down"
        assert c.post("/respond", json={"context": ["hello"]}).status_code == 200
        assert "coreply_ready 0.0" in c.get("/metrics").text


def test_api_keys_guard_each_non_public_route(tiny_bundle):
    settings = Settings(bundle=tiny_bundle, threads=1, api_keys="old-key, new-key", public_routes="/healthz")
    with TestClient(create_app(settings)) as c:
        body = {"context": ["hello"]}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-API-Key": "old-key-but-longer"}):
            r = c.post("/respond", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"] == "missing or invalid API key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert c.post("/respond", json={"context": []}).status_code == 401  # before validation
        for headers in ({"Authorization": "Bearer old-key"}, {"X-API-Key": "new-key"}):  # rotation
            assert c.post("/respond", json=body, headers=headers).status_code == 200
        assert c.get("/healthz").status_code == 200  # public
        assert c.get("/readyz").status_code == 401 and c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"X-API-Key": "new-key"}).status_code == 200


def access_lines(caplog) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "coreply.access"]


def test_request_ids_are_echoed_or_made_and_every_request_is_logged(client, caplog):
    caplog.set_level(logging.INFO, logger="coreply.access")
    r = client.post("/respond", json={"context": ["hello"]}, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    made = client.get("/healthz", headers={"X-Request-Id": "bad id\\n"}).headers["x-request-id"]
    assert len(made) == 32 and made != "bad id\\n"  # not echoed: a fresh one
    assert client.post("/respond", json={"context": []}).headers["x-request-id"]  # errors too
    lines = access_lines(caplog)
    seen = [(x["route"], x["status"]) for x in lines]
    assert seen == [("/respond", 200), ("/healthz", 200), ("/respond", 422)]
    assert lines[0]["request_id"] == "abc-123" and lines[1]["request_id"] == made
    assert set(lines[0]["timings_ms"]) >= {"encode", "search", "total"}
    assert "hello" not in json.dumps(lines)  # no dialogue text unless COREPLY_LOG_TEXT


def test_the_start_says_what_is_served_in_one_line_and_readyz_says_the_same(tiny_bundle, caplog):
    caplog.set_level(logging.INFO, logger="coreply.service")
    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=1, api_keys="sekrit-key"))) as c:
        ready = c.get("/readyz", headers={"X-API-Key": "sekrit-key"}).json()
    (line,) = [r.fields for r in caplog.records if r.getMessage() == "serving"]
    assert ready.pop("status") == "ready" and ready.items() <= line.items()
    assert line["bundle_version"] == load_bundle(tiny_bundle).version and line["load_s"] > 0
    assert line["tls"] is None and line["api_keys"] == ["default"]
    assert "sekrit" not in json.dumps(line)  # the keys' names, never the keys


TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.mark.parametrize(
    "header, expected",
    [
        (f"00-{TRACE_ID}-{PARENT_ID}-01", {"trace_id": TRACE_ID, "parent_id": PARENT_ID}),
        (f"00-{TRACE_ID}-{PARENT_ID}-00", {"trace_id": TRACE_ID, "parent_id": PARENT_ID}),  # not sampled
        (f"cc-{TRACE_ID}-{PARENT_ID}-01-later", {"trace_id": TRACE_ID, "parent_id": PARENT_ID}),  # future
        (f"00-{TRACE_ID}-{PARENT_ID}-01-later", {}),  # version 00 has exactly four fields
        (f"ff-{TRACE_ID}-{PARENT_ID}-01", {}),  # forbidden version
        (f"00-{'0' * 32}-{PARENT_ID}-01", {}),  # all-zero trace id
        (f"00-{TRACE_ID}-{'0' * 16}-01", {}),  # all-zero parent id
        (f"00-{TRACE_ID.upper()}-{PARENT_ID}-01", {}),  # upper-case hex
        (f"00-{TRACE_ID[:-1]}-{PARENT_ID}-01", {}),
        ("", {}),
        (None, {}),
    ],
)
def test_trace_context_is_read_from_a_valid_traceparent_only(header, expected):
    from service.logs import trace_context

    assert trace_context(header) == expected


def test_a_traceparent_joins_the_access_log_and_the_latency_exemplars_to_the_callers_trace(client, caplog):
    caplog.set_level(logging.INFO, logger="coreply.access")
    traced = client.post(
        "/respond", json={"context": ["hello"]}, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    )
    assert traced.status_code == 200
    bad = client.post("/respond", json={"context": ["hello"]}, headers={"traceparent": "00-nonsense"})
    assert bad.status_code == 200  # an invalid header is ignored, never an error
    first, second = [x for x in access_lines(caplog) if x["route"] == "/respond"][-2:]
    assert first["trace_id"] == TRACE_ID and first["parent_id"] == PARENT_ID
    assert "trace_id" not in second and "parent_id" not in second
    plain = client.get("/metrics")
    assert plain.headers["content-type"].startswith("text/plain") and TRACE_ID not in plain.text
    openmetrics = client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")
    exemplars = [ln for ln in openmetrics.text.splitlines() if f'# {{trace_id="{TRACE_ID}"}}' in ln]
    assert exemplars, "no exemplar carries the trace id"
    for line in exemplars:
        assert line.startswith("coreply_request_duration_seconds_bucket{") and 'route="/respond"' in line


def test_dialogue_text_is_logged_only_when_enabled(tiny_bundle, caplog):
    caplog.set_level(logging.INFO, logger="coreply.access")
    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=1, log_text=True))) as c:
        c.post("/respond", json={"context": ["hello there"]})
    (line,) = [x for x in access_lines(caplog) if x["route"] == "/respond"]
    assert line["context"] == ["hello there"] and line["responses"]


def test_log_lines_are_json_objects():
    from service.logs import JsonFormatter

    record = logging.LogRecord("coreply.access", logging.INFO, __file__, 1, "request", None, None)
    record.fields = {"request_id": "r1", "status": 200}
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "request" and line["request_id"] == "r1" and line["level"] == "info"


def test_a_job_past_its_deadline_is_answered_then_and_never_run():
    import threading

    gate, seen = threading.Event(), []

    def run(items):
        seen.extend(items)
        gate.wait(5)
        return list(items), {}

    async def scenario(executor):
        batcher = MicroBatcher("t", run, executor, max_size=1, max_wait_s=0.0, max_queue=4)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit("first"))
        await asyncio.sleep(0.05)  # "first" is running and holds the inference thread
        started = time.perf_counter()
        with pytest.raises(DeadlineExceeded):
            await batcher.submit("late", deadline=started + 0.1)
        waited = time.perf_counter() - started
        gate.set()
        done = await first
        await asyncio.sleep(0.05)  # let the worker reach the expired job
        await batcher.stop()
        return waited, done

    waited, done = run_batcher(scenario)
    assert 0.09 <= waited < 1.0  # answered at its deadline, not when the worker got to it
    assert done.result == "first" and seen == ["first"]  # the expired job never reached the model


def test_queue_of_q_plus_k_more_requests_sheds_exactly_k_and_serves_the_rest(tiny_bundle):
    q, k = 4, 3
    gate = Gate()
    settings = Settings(bundle=tiny_bundle, threads=1, queue_max=q, batch_max_contexts=1)
    with TestClient(create_app(settings, gate.factory)) as c, ThreadPoolExecutor(q + k + 1) as pool:
        body = {"context": ["hello"]}
        gate.close()
        running = pool.submit(c.post, "/respond", json=body)
        assert gate.entered.wait(10)  # one request holds the model; the queue is empty
        waiting = [pool.submit(c.post, "/respond", json=body) for _ in range(q + k)]
        deadline = time.monotonic() + 10
        while sum(f.done() for f in waiting) < k and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.opened.set()
        codes = [f.result().status_code for f in [running, *waiting]]
    assert codes.count(503) == k and codes.count(200) == q + 1
    shed = [f.result() for f in waiting if f.result().status_code == 503]
    assert all(r.headers["retry-after"] == "1" for r in shed)


def test_deadline_header_gives_504_while_queued_and_is_validated(tiny_bundle):
    gate = Gate()
    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=1), gate.factory)) as c:
        r = c.post("/respond", json={"context": ["hi"]}, headers={"X-Request-Timeout-Ms": "0"})
        assert r.status_code == 422 and r.json()["error"].startswith("header.X-Request-Timeout-Ms")
        with ThreadPoolExecutor(2) as pool:
            gate.close()
            running = pool.submit(c.post, "/respond", json={"context": ["hello"]})
            assert gate.entered.wait(10)
            late = c.post("/respond", json={"context": ["hi"]}, headers={"X-Request-Timeout-Ms": "100"})
            gate.opened.set()
            assert running.result().status_code == 200
        assert late.status_code == 504 and late.json()["error"].startswith("deadline exceeded")
        relaxed = c.post("/respond", json={"context": ["hi"]}, headers={"X-Request-Timeout-Ms": "5000"})
        assert relaxed.status_code == 200


def test_hot_reload_swaps_a_valid_bundle_keeps_the_same_one_and_serves_through_a_corrupt_one(
    tiny_bundle, tmp_path
):
    import shutil

    from index_builder.build import add_responses

    v1, v2, v3 = tmp_path / "v1", tmp_path / "v2", tmp_path / "v3"
    shutil.copytree(tiny_bundle, v1)
    shutil.copytree(tiny_bundle, v2)
    add_responses(v2, ["a brand new reply about gardening"], progress=False)
    shutil.copytree(v2, v3)
    with open(v3 / "responses.jsonl", "a") as fh:
        fh.write('{"id": 999, "text": "tampered"}\n')
    current = tmp_path / "current"
    current.symlink_to(v1)
    app = create_app(Settings(bundle=current, threads=1))

    def point_to(target):
        current.unlink()
        current.symlink_to(target)

    with TestClient(app) as c, ThreadPoolExecutor(4) as pool:
        first = c.get("/readyz").json()["bundle_version"]
        stop, codes = threading.Event(), []

        def hammer():
            while not stop.is_set():
                codes.append(c.post("/respond", json={"context": ["do you have a pet ?"]}).status_code)

        workers = [pool.submit(hammer) for _ in range(3)]  # load during both reloads
        point_to(v2)
        assert c.portal.call(app.reload) is True
        second = c.get("/readyz").json()["bundle_version"]
        serving = app.state.engine
        assert c.portal.call(app.reload) is True and app.state.engine is serving  # the same version: kept
        point_to(v3)  # v2's version, one file tampered with: refused, not taken for the live one
        assert c.portal.call(app.reload) is False  # refused: the live bundle stays
        assert c.get("/readyz").json()["bundle_version"] == second != first
        stop.set()
        for w in workers:
            w.result()
        metrics = c.get("/metrics").text
    assert codes and set(codes) == {200}
    assert 'coreply_reloads_total{result="ok"} 1.0' in metrics
    assert 'coreply_reloads_total{result="failed"} 1.0' in metrics
    assert 'coreply_reloads_total{result="unchanged"} 1.0' in metrics
    assert f'coreply_bundle_info{{version="{second}"}} 1.0' in metrics and first not in metrics


def test_a_withdrawn_response_is_not_answered_after_a_reload_and_readyz_and_metrics_count_it(
    tiny_bundle, tmp_path
):
    """... and the golden query that warms each engine, at start and at the reload, is counted nowhere."""
    import shutil

    from index_builder.withdraw import withdraw

    shutil.copytree(tiny_bundle, tmp_path / "b")
    app = create_app(Settings(bundle=tmp_path / "b", threads=1))
    question = TOPICS["pet"][0]
    counts = (
        'coreply_stage_duration_seconds_count{stage="encode"} 2.0',
        'coreply_stage_duration_seconds_count{stage="rerank"} 2.0',
        "coreply_candidates_reranked_count 2.0",
        'coreply_batch_requests_count{batcher="retrieve"} 2.0',
        "coreply_answer_retrieval_score_count 2.0",
    )
    with TestClient(app) as c:
        size = c.get("/readyz").json()["responses"]
        started = c.get("/metrics").text
        assert f'coreply_pool_responses{{state="answerable"}} {size}.0' in started
        assert 'coreply_stage_duration_seconds_count{stage="encode"} 0.0' in started
        assert "coreply_answer_retrieval_score_count 0.0" in started
        before = [r["id"] for r in post(c, context=[question], top_k=3, fusion="sum").json()["responses"]]
        withdraw(tmp_path / "b", [before[0]])
        assert c.portal.call(app.reload) is True
        after = [r["id"] for r in post(c, context=[question], top_k=3, fusion="sum").json()["responses"]]
        assert c.get("/readyz").json()["withdrawn"] == 1
        metrics = c.get("/metrics").text
    assert after[:2] == before[1:] and len(after) == 3
    assert all(count in metrics for count in counts), metrics  # the two requests, not the warm-ups
    assert f'coreply_pool_responses{{state="answerable"}} {size - 1}.0' in metrics
    assert 'coreply_pool_responses{state="withdrawn"} 1.0' in metrics


def test_cascade_steps_up_under_queueing_down_when_it_clears_and_respects_floors():
    from service.cascade import MAX_LEVEL, Cascade, Plan

    cascade = Cascade(high_ms=100, low_ms=20, floor=5, skip_rerank=True, step_s=1.0, smoothing=0.5)
    assert cascade.plan(20, reranks=True) == Plan(20, False, 0)
    now = 0.0
    for _ in range(3):  # a burst within one step interval moves at most one level
        cascade.observe(0.5, now)
    assert cascade.level == 1
    for _ in range(10):
        now += 1.0
        cascade.observe(0.5, now)
    assert cascade.level == MAX_LEVEL
    assert cascade.plan(20, reranks=True).n_candidates == 5 and cascade.plan(20, True).skip_rerank
    assert cascade.plan(3, reranks=True).n_candidates == 3  # never more than asked
    assert cascade.plan(20, reranks=True, top_k=8).n_candidates == 8  # never fewer than wanted back
    assert cascade.plan(20, reranks=False).level == 0  # retrieval-only work is not degraded
    cascade.observe(0.05, now + 1.0)  # between the thresholds: stays
    assert cascade.level == MAX_LEVEL
    for _ in range(10):
        now += 1.0
        cascade.observe(0.0, now)
    assert cascade.level == 0 and cascade.plan(20, True).n_candidates == 20


@pytest.mark.parametrize("enabled", [True, False])
def test_cascade_is_reported_in_the_response_and_metrics(tiny_bundle, enabled):
    settings = Settings(
        bundle=tiny_bundle,
        threads=1,
        cascade=enabled,
        cascade_high_ms=0.0,  # any queue wait at all counts as queueing: every request steps up
        cascade_low_ms=0.0,
        cascade_step_s=0.0,
    )
    with TestClient(create_app(settings)) as c:
        body = {"context": ["hi", TOPICS["pet"][0]], "n_candidates": 8, "fusion": "sum", "top_k": 2}
        for _ in range(3):
            c.post("/respond", json=body)
        r = c.post("/respond", json=body).json()
        metrics = c.get("/metrics").text
    if enabled:
        assert r["degraded"] == {"level": 3, "requested_candidates": 8, "requested_fusion": "sum"}
        assert r["fusion"] == "retrieval" and r["n_candidates"] == 5
        assert all(x["rerank_score"] is None for x in r["responses"])
        assert "coreply_cascade_level 3.0" in metrics
    else:
        assert r["degraded"] is None and r["fusion"] == "sum" and r["n_candidates"] == 8
        assert "coreply_degraded_requests_total 0.0" in metrics


def test_pool_metadata_reaches_the_answer(tmp_path, tiny_core):
    """A team's ids and intents from the pool file come back with each response ({} stays null)."""
    answers = [a for _, a in TOPICS.values()]
    metadata = [
        {"id": f"faq-{i}", "intent": name} if name != "sport" else {} for i, name in enumerate(TOPICS)
    ]
    build_bundle(
        tmp_path / "b", answers, bi=str(tiny_core / "bi"), onnx="none", progress=False, metadata=metadata
    )
    with TestClient(create_app(Settings(bundle=tmp_path / "b", threads=1))) as c:
        pet = c.post("/respond", json={"context": [TOPICS["pet"][0]]}).json()["responses"][0]
        assert pet["text"] == TOPICS["pet"][1] and pet["metadata"] == {"id": "faq-1", "intent": "pet"}
        sport = c.post("/respond", json={"context": [TOPICS["sport"][0]]}).json()["responses"][0]
        assert sport["text"] == TOPICS["sport"][1] and sport["metadata"] is None


def test_a_filter_answers_within_the_responses_whose_metadata_matches(tmp_path, tiny_core):
    """The service reads the filter as the library does (tests/test_coreply/test_filters.py checks its
    answers against a pool of the allowed responses alone); a filter that cannot match as meant is a 422
    naming the field, one that allows nothing answers with the fallback."""
    answers = [a for _, a in TOPICS.values()]
    metadata = [{"intent": t, "locale": "en" if i % 2 else "de", "rank": i} for i, t in enumerate(TOPICS)]
    build_bundle(
        tmp_path / "b", answers, bi=str(tiny_core / "bi"), onnx="none", progress=False, metadata=metadata
    )
    settings = Settings(bundle=tmp_path / "b", threads=1, fallback_text="Let me get a human.")
    with TestClient(create_app(settings)) as c:
        pet = {"context": [TOPICS["pet"][0]], "fusion": "retrieval"}
        everything = c.post("/respond", json=pet | {"top_k": len(answers), "n_candidates": len(answers)})
        ranked = everything.json()["responses"]  # the whole pool, best first
        assert ranked[0]["metadata"]["intent"] == "pet"
        assert c.get("/readyz").json()["filter_fields"] == ["intent", "locale", "rank"]
        for where, matches in (
            ({"locale": "de"}, lambda m: m["locale"] == "de"),
            ({"intent": ["sport", "food"]}, lambda m: m["intent"] in ("sport", "food")),
            ({"locale": "en", "intent": "pet"}, lambda m: m["locale"] == "en" and m["intent"] == "pet"),
            ({"intent": {"$nin": ["pet", "food"]}}, lambda m: m["intent"] not in ("pet", "food")),
            ({"rank": {"$gte": 1, "$lt": 3}, "locale": {"$ne": "en"}}, lambda m: m["rank"] == 2),
            (
                {"$or": [{"intent": "pet"}, {"rank": {"$gt": 4}}]},
                lambda m: m["intent"] == "pet" or m["rank"] > 4,
            ),
        ):
            body = c.post("/respond", json=pet | {"filter": where, "top_k": 2}).json()
            expected = [r["id"] for r in ranked if matches(r["metadata"])][:2]
            assert [r["id"] for r in body["responses"]] == expected and body["fallback"] is None
        nobody = c.post("/respond", json=pet | {"filter": {"intent": "farewell"}}).json()
        assert nobody["responses"] == [] and nobody["fallback"] == "Let me get a human."
        for where, says in (
            (
                {"intnet": "pet"},
                "filter.intnet: no response in this pool has this field (fields: intent, locale, rank)",
            ),
            ({"intent": {"$in": [["pet"]]}}, "filter.intent.$in: ['pet'] is not a text, number or boolean"),
            ({"intent": []}, "filter.intent: an empty list of values matches nothing"),
            ({"$or": [{"intent": "pet"}, {"intnet": "x"}]}, "filter.$or.1.intnet: no response in this pool"),
            ({"rank": {"$gt": "2"}}, "filter.rank.$gt: takes a finite number, not '2'"),
            ({"intent": {"in": ["pet"]}}, "filter.intent.in: not an operator (operators: $eq, $ne,"),
        ):
            refused = c.post("/respond", json=pet | {"filter": where})
            assert refused.status_code == 422 and refused.json()["error"].startswith(says), refused.text


def answer_scores(client) -> dict:
    """``coreply_answer_retrieval_score`` as /metrics shows it: count and cumulative buckets (no sum: its
    buckets go below zero)."""
    got: dict = {"buckets": {}}
    for line in client.get("/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("coreply_answer_retrieval_score_bucket"):
            le = name.split('le="')[1].rstrip('"}')
            got["buckets"][float(le)] = float(value)
        elif name == "coreply_answer_retrieval_score_count":
            got["count"] = float(value)
    return got


def test_fallback_when_no_response_is_similar_enough(tiny_bundle):
    settings = Settings(
        bundle=tiny_bundle, threads=1, min_retrieval_score=1e6, fallback_text="Let me get a human."
    )
    with TestClient(create_app(settings)) as c:
        before = answer_scores(c)
        body = c.post("/respond", json={"context": ["do you have a pet ?"], "top_k": 3}).json()
        assert body["responses"] == [] and body["fallback"] == "Let me get a human."
        assert "coreply_fallback_responses_total 1.0" in c.get("/metrics").text
        pet = {"context": ["do you have a pet ?"], "min_retrieval_score": -1e6}
        score = c.post("/respond", json=pet).json()["responses"][0]["retrieval_score"]  # as the one cut
        after = answer_scores(c)
        assert after["count"] - before["count"] == 2
        below, above = (
            max(b for b in after["buckets"] if b < score),
            min(b for b in after["buckets"] if b >= score),
        )
        assert after["buckets"][below] == before["buckets"][below]  # in the bucket the score falls in
        assert after["buckets"][above] - before["buckets"][above] == 2
        lenient = c.post("/respond", json={"context": ["hi"], "top_k": 3, "min_retrieval_score": -1e6}).json()
        assert len(lenient["responses"]) == 3 and lenient["fallback"] is None
        some = c.post("/respond", json={"context": ["hi"], "top_k": 3, "min_retrieval_score": None}).json()
        assert len(some["responses"]) == 3  # null: no threshold for this request
        cut = lenient["responses"][1]["retrieval_score"]  # keeps the first two only
        kept = c.post("/respond", json={"context": ["hi"], "top_k": 3, "min_retrieval_score": cut}).json()
        assert [r["id"] for r in kept["responses"]] == [r["id"] for r in lenient["responses"][:2]]
        bad = c.post("/respond", json={"context": ["hi"], "min_retrieval_score": "high"})
        assert bad.status_code == 422 and "min_retrieval_score" in bad.text


def test_api_docs_and_chat_page_are_served_without_a_cdn(client):
    docs = client.get("/docs")
    assert docs.status_code == 200 and "/assets/swagger/swagger-ui-bundle.js" in docs.text
    assert "cdn" not in docs.text.lower() and "https://" not in docs.text.replace("https://fastapi", "")
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        assert client.get(f"/assets/swagger/{asset}").status_code == 200
    chat = client.get("/chat")
    assert chat.status_code == 200 and chat.headers["content-type"].startswith("text/html")
    assert 'fetch("respond"' in chat.text and "https://" not in chat.text
    schema = client.get("/openapi.json").json()
    assert "min_retrieval_score" in json.dumps(schema) and "metadata" in json.dumps(schema)
    documented = set(schema["paths"]["/respond"]["post"]["responses"])
    assert {"400", "401", "413", "422", "503", "504"} <= documented, documented
