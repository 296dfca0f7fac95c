"""Calls from web pages on other origins (COREPLY_CORS_ORIGINS): which are allowed, what a browser is
told, and that every answer an allowed page gets, errors too, is one it can read."""

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service.app import create_app
from service.cors import Origins, parse_origins
from service.settings import Settings

PAGE = "https://chat.example.com"
KEY = {"X-API-Key": "k1"}


def preflight(client, origin: str, method: str = "POST", headers: str = "content-type, x-api-key"):
    asked = {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": headers,
    }
    return client.options("/respond", headers=asked)


@pytest.mark.parametrize(
    "text, want",
    [
        ("", Origins()),
        (" , ", Origins()),
        ("*", Origins(any=True)),
        (f"{PAGE}, http://localhost:3000,{PAGE}", Origins((PAGE, "http://localhost:3000"))),
        ("http://[::1]:8080", Origins(("http://[::1]:8080",))),
        ("https://*.example.com", Origins((), r"https://[a-z0-9-]+(?:\.[a-z0-9-]+)*\.example\.com")),
    ],
)
def test_origins_are_read_as_browsers_send_them(text, want):
    assert parse_origins(text) == want


@pytest.mark.parametrize(
    "text, says",
    [
        ("https://chat.example.com/", "no path, no trailing /"),
        ("https://chat.example.com/widget", "no path, no trailing /"),
        ("chat.example.com", "e.g. https://chat.example.com"),
        ("ftp://chat.example.com", "write scheme://host[:port]"),
        ("https://Chat.Example.com", "browsers send it in lower case"),
        ("https://chat.example.com:443", "browsers send it without :443; write https://chat.example.com"),
        ("http://*.example.com:80", "write http://*.example.com"),
        ("http://localhost:99999", "port 99999 is out of range"),
        ("https://*", "is not an origin"),
        ("https://chat.*.com", "is not an origin"),
    ],
)
def test_an_origin_no_browser_could_send_is_refused_naming_it(text, says):
    with pytest.raises(ValueError) as refused:
        parse_origins(text)
    assert says in str(refused.value) and repr(text) in str(refused.value)
    with pytest.raises(ValidationError, match="cors_origins"):
        Settings(cors_origins=f"{PAGE},{text}")


@pytest.fixture(scope="module")
def client(tiny_bundle):
    settings = Settings(
        bundle=tiny_bundle, threads=1, api_keys="k1", max_body_bytes=2048,
        cors_origins=f"{PAGE}, https://*.example.org",
    )  # fmt: skip
    with TestClient(create_app(settings)) as c:
        yield c


def test_an_allowed_page_is_told_what_it_may_send_before_it_sends_it(client):
    for origin in (PAGE, "https://a.example.org", "https://b.c.example.org"):
        r = preflight(client, origin)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert set(r.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
        allowed = set(r.headers["access-control-allow-headers"].lower().split(", "))
        assert allowed >= {
            "content-type",
            "authorization",
            "x-api-key",
            "x-request-id",
            "x-request-timeout-ms",
            "traceparent",
            "tracestate",
        }
        assert r.headers["access-control-max-age"] == "600"
        assert "access-control-allow-credentials" not in r.headers


@pytest.mark.parametrize(
    "origin, method, headers, says",
    [
        ("https://evil.example.com", "POST", "content-type", "'https://evil.example.com' is not one of"),
        ("https://example.org", "POST", "content-type", "origin 'https://example.org'"),  # not a subdomain
        ("https://a.example.org.evil.net", "POST", "content-type", "origin 'https://a.example.org.evil.net'"),
        ("http://chat.example.com", "POST", "content-type", "origin 'http://chat.example.com'"),
        (PAGE + ":8443", "POST", "content-type", "origin"),
        (PAGE, "DELETE", "content-type", "method 'DELETE' (the API takes GET and POST)"),
        (PAGE, "POST", "content-type, x-secret", "header 'x-secret'"),
    ],
)
def test_a_refused_preflight_is_a_403_that_names_what_was_refused(client, origin, method, headers, says):
    r = preflight(client, origin, method, headers)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert r.json()["error"].startswith("cross-origin request refused: ") and says in r.json()["error"]
    assert "Origin" in r.headers["vary"]


def test_an_allowed_page_reads_answers_and_errors_alike(client):
    page = {"Origin": PAGE}
    answered = client.post(
        "/respond", json={"context": ["hello"]}, headers=page | KEY | {"X-Request-Id": "r-1"}
    )
    assert answered.status_code == 200 and answered.json()["responses"]
    assert answered.headers["access-control-allow-origin"] == PAGE and "Origin" in answered.headers["vary"]
    exposed = set(answered.headers["access-control-expose-headers"].split(", "))
    assert exposed == {"x-request-id", "retry-after"}
    assert answered.headers["x-request-id"] == "r-1"
    refused = {
        401: client.post("/respond", json={"context": ["hello"]}, headers=page),
        413: client.post("/respond", content=b"{" + b" " * 4096 + b"}", headers=page | KEY),
        422: client.post("/respond", json={"context": []}, headers=page | KEY),
        404: client.get("/nowhere", headers=page | KEY),
    }
    for status, r in refused.items():
        assert r.status_code == status and r.headers["access-control-allow-origin"] == PAGE, status
        assert "error" in r.json()
    assert client.get("/readyz", headers=page | KEY).headers["access-control-allow-origin"] == PAGE


def test_another_page_gets_the_answer_without_leave_to_read_it(client):
    """The browser, not the service, keeps a page from reading an answer: the request is served (a
    server-side caller sends no Origin, or any), but without the header the browser needs."""
    other = {"Origin": "https://evil.example.com"}
    r = client.post("/respond", json={"context": ["hello"]}, headers=other | KEY)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = client.post("/respond", json={"context": ["hello"]}, headers=KEY)  # no Origin: no CORS headers
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_any_page_with_a_star_and_none_by_default(tiny_bundle):
    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=1, cors_origins="*"))) as c:
        r = preflight(c, "https://anywhere.test", headers="content-type")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = c.post("/respond", json={"context": ["hello"]}, headers={"Origin": "https://anywhere.test"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    with TestClient(create_app(Settings(bundle=tiny_bundle, threads=1))) as c:
        r = preflight(c, PAGE)
        assert r.status_code == 405 and "error" in r.json()  # as before: no route answers OPTIONS
        r = c.post("/respond", json={"context": ["hello"]}, headers={"Origin": PAGE})
        assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
