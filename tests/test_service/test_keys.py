"""Named and scoped API keys (service/keys.py): the key file is refused whole when any entry is wrong,
and a scoped key is answered only from the responses its filter allows, on every route it reaches and
through a reload."""

import hashlib
import json
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import TOPICS, Gate
from fastapi.testclient import TestClient
from pydantic import ValidationError

from index_builder.build import build_bundle
from service.app import create_app
from service.errors import Unauthorized
from service.keys import KeyRing, env_keys, read_key_file
from service.settings import Settings
from service.state import make_job

PET = {"context": [TOPICS["pet"][0]], "fusion": "retrieval"}
SAME_SHA256 = hashlib.sha256(b"same").hexdigest()


@pytest.fixture(scope="module")
def tagged_bundle(tmp_path_factory, tiny_core):
    """TOPICS' answers, each with an intent, a locale (en, de alternately) and a rank."""
    root = tmp_path_factory.mktemp("tagged") / "b"
    answers = [a for _, a in TOPICS.values()]
    metadata = [{"intent": t, "locale": "en" if i % 2 else "de", "rank": i} for i, t in enumerate(TOPICS)]
    build_bundle(root, answers, bi=str(tiny_core / "bi"), onnx="none", progress=False, metadata=metadata)
    return root


def key_file(tmp_path, entries) -> str:
    path = tmp_path / "keys.json"
    path.write_text(entries if isinstance(entries, str) else json.dumps(entries))
    return str(path)


@pytest.mark.parametrize(
    "entries, says",
    [
        ("{", "not JSON"),
        ({}, "holds no keys"),
        ([{"key": "a"}], "holds no keys"),
        ({"bad name": {"key": "a"}}, "'bad name': a name is 1-64 letters"),
        ({"default": {"key": "a"}}, "and not 'default'"),
        ({"bot": "a"}, "'bot': write {\"key\""),
        ({"bot": {"filter": {"x": 1}}}, "'bot': write {\"key\""),
        ({"bot": {"key": "a", "scope": {"x": 1}}}, "'bot': write {\"key\""),
        ({"bot": {"key": ""}}, "'bot': the key is a text without spaces"),
        ({"bot": {"key": " a"}}, "'bot': the key is a text without spaces"),
        ({"bot": {"key": 7}}, "'bot': the key is a text without spaces"),
        ({"a": {"key": "same"}, "b": {"key": "same"}}, "'b': the same key as 'a'"),
        ({"a": {"key": "same"}, "b": {"key_sha256": SAME_SHA256.upper()}}, "'b': the same key as 'a'"),
        ({"bot": {"key": "a", "key_sha256": SAME_SHA256}}, "'bot': write {\"key\""),
        *(
            ({"bot": {"key_sha256": given}}, "'bot': key_sha256 is the key's SHA-256 in 64 hex digits")
            for given in (SAME_SHA256[:-1], SAME_SHA256[:-1] + "g", 7, "")
        ),
        ({"bot": {"key": "a", "filter": ["x"]}}, "'bot': the filter is a JSON object"),
        ('{"bot": {"key": "a"}, "bot": {"key": "b"}}', "'bot' is given twice"),
        ('{"bot": {"key": "a", "filter": {"x": 1, "x": 2}}}', "'x' is given twice"),
        *(
            ({"bot": {"key": "a", "max_in_flight": n}}, "'bot': max_in_flight is a whole")
            for n in (0, -1, "4", 1.5, True)
        ),
    ],
)
def test_a_key_file_with_any_wrong_entry_is_refused_naming_it(tmp_path, entries, says):
    path = key_file(tmp_path, entries)
    with pytest.raises(ValueError, match=r"keys\.json: ") as got:
        read_key_file(Path(path))
    assert says in str(got.value)
    with pytest.raises(ValidationError) as got:  # the setting refuses it the same way, at start
        Settings(api_keys_file=path)
    assert got.value.errors()[0]["loc"] == ("api_keys_file",) and says in str(got.value)


def test_keys_that_would_be_ambiguous_or_scope_nothing_are_refused(tmp_path):
    with pytest.raises(ValidationError, match="'bot' holds a key COREPLY_API_KEYS also holds"):
        Settings(api_keys="k1,k2", api_keys_file=key_file(tmp_path, {"bot": {"key": "k2"}}))
    scoped = key_file(tmp_path, {"bot": {"key": "k", "filter": {"locale": "de"}}})
    with pytest.raises(ValidationError, match="opens /respond to everyone"):
        Settings(api_keys_file=scoped, public_routes="/healthz,/respond")
    with pytest.raises(ValidationError, match="cannot read it"):
        Settings(api_keys_file=str(tmp_path / "missing.json"))
    assert Settings(api_keys_file="").api_keys_file is None  # set but empty: no file, as for no keys


def test_the_ring_matches_each_key_to_its_name_and_nothing_else(tmp_path):
    entries = {
        "bot": {"key": "kb", "filter": {"x": 1}},
        "ops": {"key": "ko", "filter": {}},
        "hashed": {"key_sha256": hashlib.sha256(b"kh").hexdigest()},  # the file does not hold the key
    }
    named = read_key_file(Path(key_file(tmp_path, entries)))
    ring = KeyRing(env_keys(" k1, ,k2 ") + named)
    assert [(k.name, k.scope) for k in ring.keys] == [
        ("default", None),
        ("default", None),
        ("bot", {"x": 1}),
        ("ops", None),  # an empty filter allows everything: not a scope
        ("hashed", None),
    ]
    assert [k.name for k in ring.scoped] == ["bot"]
    assert ring.match(b"kb").name == "bot" and ring.match(b"k2").name == "default"
    assert ring.match(b"kh").name == "hashed"
    wrong = (b"", b"k", b"kb ", b"k1k2", b"KB", hashlib.sha256(b"kh").hexdigest().encode())
    assert all(ring.match(given) is None for given in wrong)  # the digest is not the key
    assert "kb" not in repr(ring.keys)  # a key never shows in a log or a traceback
    assert not KeyRing(env_keys(""))


def test_a_scoped_key_is_answered_only_within_its_filter(tagged_bundle, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="coreply")
    keys = {
        "de-bot": {"key": "k-de", "filter": {"locale": "de"}},
        "ops": {"key": "k-ops"},
        "later": {"key": "k-later", "filter": {"intent": "farewell"}},  # nothing in this pool yet
    }
    settings = Settings(
        bundle=tagged_bundle,
        threads=1,
        api_keys="k-env",
        api_keys_file=key_file(tmp_path, keys),
        fallback_text="Let me get a human.",
    )
    with TestClient(create_app(settings)) as c:

        def ask(key, **extra):
            return c.post("/respond", json=PET | extra, headers={"X-API-Key": key}).json()

        every = len(TOPICS)
        ranked = ask("k-ops", top_k=every, n_candidates=every)["responses"]  # unscoped: the whole pool
        assert len(ranked) == every
        assert [r["id"] for r in ask("k-env", top_k=every, n_candidates=every)["responses"]] == [
            r["id"] for r in ranked
        ]
        german = [r["id"] for r in ranked if r["metadata"]["locale"] == "de"]
        got = ask("k-de", top_k=3)
        assert [r["id"] for r in got["responses"]] == german[:3] and got["fallback"] is None
        # the request's own filter is met together with the key's, never instead of it
        sport_or_pet = {"intent": {"$in": ["sport", "pet"]}}
        both = [
            r["id"]
            for r in ranked
            if r["metadata"]["locale"] == "de" and r["metadata"]["intent"] in ("sport", "pet")
        ]
        assert [r["id"] for r in ask("k-de", top_k=3, filter=sport_or_pet)["responses"]] == both[:3]
        outside = ask("k-de", filter={"locale": "en"})
        assert outside["responses"] == [] and outside["fallback"] == "Let me get a human."
        widened = ask(
            "k-de", top_k=every, n_candidates=every, filter={"$or": [{"locale": "en"}, {"rank": {"$gte": 0}}]}
        )
        assert [r["id"] for r in widened["responses"]] == german  # all the scope allows, and no more
        assert ask("k-later")["responses"] == [] and ask("k-later")["fallback"] == "Let me get a human."
        r = c.post("/respond", json=PET, headers={"Authorization": "Bearer k-nobody"})
        assert r.status_code == 401
        metrics = c.get("/metrics", headers={"Authorization": "Bearer k-de"}).text
    assert 'coreply_key_requests_total{key="de-bot",status="2xx"} 4.0' in metrics  # not yet /metrics
    assert 'coreply_key_requests_total{key="later",status="2xx"} 2.0' in metrics
    assert 'coreply_key_requests_total{key="default",status="2xx"} 1.0' in metrics
    lines = [
        r.fields for r in caplog.records if r.name == "coreply.access" and r.fields["route"] == "/respond"
    ]
    assert [line.get("key") for line in lines] == ["ops", "default", *["de-bot"] * 4, "later", "later", None]
    logged = json.dumps([getattr(r, "fields", {}) for r in caplog.records])
    assert "k-de" not in logged and "k-ops" not in logged  # names, never keys
    (scopes,) = [r.fields for r in caplog.records if r.getMessage() == "API key scopes"]
    assert scopes["responses"] == {"de-bot": len(german), "later": 0}
    (empty,) = [
        r.fields
        for r in caplog.records
        if r.levelname == "WARNING" and "allows no response" in r.getMessage()
    ]
    assert empty["keys"] == ["later"]


def test_a_bundle_a_key_scope_cannot_read_is_never_served(tagged_bundle, tiny_bundle, tmp_path):
    """At start the service does not come up; on a reload the live bundle keeps serving, scoped."""
    keys = key_file(tmp_path, {"de-bot": {"key": "k-de", "filter": {"locale": "de"}}})
    unreadable = create_app(Settings(bundle=tiny_bundle, threads=1, api_keys_file=keys))
    with pytest.raises(ValueError, match=r"API key 'de-bot': its filter\.locale: no response in this pool"):
        TestClient(unreadable).__enter__()
    current = tmp_path / "current"
    current.symlink_to(shutil.copytree(tagged_bundle, tmp_path / "v1"))
    app = create_app(Settings(bundle=current, threads=1, api_keys_file=keys))
    with TestClient(app) as c:
        current.unlink()
        current.symlink_to(tiny_bundle)  # a pool without the field the key's filter reads
        assert c.portal.call(app.reload) is False
        body = c.post("/respond", json=PET | {"top_k": 5}, headers={"X-API-Key": "k-de"}).json()
        assert body["responses"] and {r["metadata"]["locale"] for r in body["responses"]} == {"de"}
        key_file(tmp_path, {"any-bot": {"key": "k-any"}})  # keys this pool can serve: both swap in
        assert c.portal.call(app.reload) is True
        assert c.post("/respond", json=PET, headers={"X-API-Key": "k-de"}).status_code == 401
        assert c.post("/respond", json=PET, headers={"X-API-Key": "k-any"}).json()["responses"]
        assert c.get("/readyz").json()["filter_fields"] == []  # the pool without the field


def test_a_reload_reads_the_keys_again_and_keeps_the_live_ones_when_the_file_is_wrong(
    tagged_bundle, tmp_path, caplog
):
    """SIGHUP rotates, adds, withdraws and rescopes keys without a restart, on the bundle serving; a key
    file with a wrong entry, or a scope this pool cannot read, is refused whole and the live keys serve."""
    caplog.set_level(logging.INFO, logger="coreply")
    keys = {"de-bot": {"key": "k-de", "filter": {"locale": "de"}}, "ops": {"key": "k-old"}}
    app = create_app(Settings(bundle=tagged_bundle, threads=1, api_keys_file=key_file(tmp_path, keys)))
    every = {"top_k": len(TOPICS), "n_candidates": len(TOPICS)}
    with TestClient(app) as c:

        def ask(key):
            r = c.post("/respond", json=PET | every, headers={"X-API-Key": key})
            return r.status_code, {a["metadata"]["locale"] for a in r.json().get("responses", [])}

        assert ask("k-de") == (200, {"de"}) and ask("k-old") == (200, {"de", "en"})
        de_bot = app.state.keys.match(b"k-de")
        version = c.get("/readyz").json()["bundle_version"]
        rotated = {
            "ops": {"key": "k-new"},  # a new key for the same name
            "en-bot": {"key": "k-en", "filter": {"locale": "en"}, "max_in_flight": 4},  # a new caller
        }  # and de-bot withdrawn
        key_file(tmp_path, rotated)
        assert c.portal.call(app.reload) is True
        assert c.get("/readyz").json()["bundle_version"] == version  # the bundle was not loaded again
        assert ask("k-old") == (401, set()) and ask("k-de") == (401, set())
        assert ask("k-new") == (200, {"de", "en"}) and ask("k-en") == (200, {"en"})
        # a request checked with de-bot's key just before the swap is not answered from the whole pool
        body = app.state.request_model(context=PET["context"])
        with pytest.raises(Unauthorized, match="'de-bot' was withdrawn"):
            make_job(body, app.state.engine, None, de_bot)
        rescoped = rotated | {"en-bot": {"key": "k-en", "filter": {"locale": "de"}}}
        key_file(tmp_path, rescoped)
        assert c.portal.call(app.reload) is True and ask("k-en") == (200, {"de"})
        assert c.portal.call(app.reload) is True  # the same keys and bundle: nothing to swap
        for wrong in ("{", {"ops": {"key": "k-new"}, "x": {"key": "k-x", "filter": {"colour": "red"}}}):
            key_file(tmp_path, wrong)
            assert c.portal.call(app.reload) is False
            assert ask("k-x")[0] == 401 and ask("k-new")[0] == 200 and ask("k-en") == (200, {"de"})
        metrics = c.get("/metrics").text
    for result, n in (("ok", 2), ("unchanged", 1), ("failed", 2)):
        assert f'coreply_reloads_total{{result="{result}"}} {n}.0' in metrics
    swaps = [r.fields for r in caplog.records if r.getMessage() == "reloaded the API keys"]
    assert swaps == [
        {"added": ["en-bot"], "withdrawn": ["de-bot"], "changed": ["ops"]},
        {"added": [], "withdrawn": [], "changed": ["en-bot"]},
    ]
    failures = [r.fields["error"] for r in caplog.records if r.getMessage().startswith("reload failed")]
    assert "keys.json: not JSON" in failures[0]
    assert "API key 'x': its filter.colour: no response in this pool has this field" in failures[1]
    logged = json.dumps([getattr(r, "fields", {}) for r in caplog.records])
    assert "k-new" not in logged and "k-old" not in logged  # names, never keys


def test_a_key_at_its_limit_is_refused_while_other_keys_are_served(tiny_bundle, tmp_path):
    """``max_in_flight``: a key's requests past its limit are a 429 with Retry-After at once, another
    key's still queue and are served, and a place comes back when a request ends, whatever its end."""
    keys = {"greedy": {"key": "k-g", "max_in_flight": 2}, "polite": {"key": "k-p"}}
    gate = Gate()
    app = create_app(
        Settings(bundle=tiny_bundle, threads=1, batch_max_contexts=1, api_keys_file=key_file(tmp_path, keys)),
        gate.factory,
    )
    hello = {"context": ["hello"]}
    as_greedy, as_polite = {"X-API-Key": "k-g"}, {"X-API-Key": "k-p"}
    with TestClient(app) as c, ThreadPoolExecutor(4) as pool:
        gate.close()
        held = [pool.submit(c.post, "/respond", json=hello, headers=as_greedy)]
        assert gate.entered.wait(10)  # one greedy request holds the model
        held.append(pool.submit(c.post, "/respond", json=hello, headers=as_greedy))  # one queued
        polite = pool.submit(c.post, "/respond", json=hello, headers=as_polite)
        deadline = time.monotonic() + 10
        while app.state.admission.in_flight["greedy"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = c.post("/respond", json=hello, headers=as_greedy)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"] == "too many requests: 'greedy' has its 2 requests in flight"
        late = c.post("/respond", json=hello, headers=as_greedy | {"X-Request-Timeout-Ms": "1"})
        assert late.status_code == 429  # refused before it could queue
        gate.opened.set()
        assert [f.result().status_code for f in [*held, polite]] == [200, 200, 200]
        assert app.state.admission.in_flight["greedy"] == 0
        gate.close()
        timed_out = pool.submit(c.post, "/respond", json=hello, headers=as_polite)
        assert gate.entered.wait(10)
        ended = c.post("/respond", json=hello, headers=as_greedy | {"X-Request-Timeout-Ms": "50"})
        gate.opened.set()
        assert ended.status_code == 504 and timed_out.result().status_code == 200
        assert app.state.admission.in_flight["greedy"] == 0  # a place comes back from a 504 too
        assert c.post("/respond", json=hello, headers=as_greedy).status_code == 200
