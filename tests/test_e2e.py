"""End to end: the real server (``coreply serve`` under uvicorn, in a subprocess) over real HTTP;
schema-based fuzzing of /respond; a real Prometheus server scraping /metrics."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import schemathesis
from conftest import TOPICS, check_drain_under_load, free_port, make_cert, wait_for
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)


@pytest.fixture(scope="module")
def server(tiny_bundle, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "COREPLY_MAX_TURNS": "6", "COREPLY_MAX_UTTERANCE_CHARS": "200"}
    cmd = [sys.executable, "-m", "cli", "serve", "--bundle", str(tiny_bundle), "--port", str(port)]
    with open(log, "w") as out:
        process = subprocess.Popen([*cmd, "--threads", "1"], stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(base + "/readyz", process)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)
    # uvicorn re-raises the SIGTERM it handled after a clean shutdown
    assert process.returncode in (0, -15) and "Application shutdown complete" in log.read_text()


def test_respond_over_http(server):
    question, answer = TOPICS["sport"]
    r = httpx.post(server + "/respond", json={"context": ["hi", question], "top_k": 3, "fusion": "sum"})
    assert r.status_code == 200
    body = r.json()
    assert body["responses"][0]["text"] == answer
    scores = [c["score"] for c in body["responses"]]
    assert scores == sorted(scores, reverse=True)
    assert body["timings_ms"]["total"] > 0 and body["bundle_version"]


@pytest.mark.parametrize("where", ["bundle", "url"])
def test_coreply_chat_in_the_terminal(server, tiny_bundle, where):
    """`coreply chat` in-process (--bundle) and against the running service (--url): a question gets
    the topic's answer, /reset starts over, and an answer already given is not repeated."""
    target = ["--bundle", str(tiny_bundle)] if where == "bundle" else ["--url", server]
    question, answer = TOPICS["pet"]
    session = f"{question}\n{question}\n/reset\n{question}\n/quit\n"
    done = subprocess.run(
        [sys.executable, "-m", "cli", "chat", *target],
        input=session,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    said = [re.sub(r"^(you> )*bot> ", "", line) for line in done.stdout.splitlines() if "bot> " in line]
    texts = [line.rsplit("  [", 1)[0] for line in said]  # "text  [score]"
    assert len(texts) == 3 and texts[0] == answer and texts[2] == answer
    assert texts[1] != answer  # the second time the bot does not repeat itself


def test_coreply_chat_sends_its_filter_to_the_service(server):
    """`coreply chat --url --filter`: the service reads the filter (this pool has no fields, so it names
    the one asked for in a 422), and chat says so in one line instead of a traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "cli", "chat", "--url", server, "--filter", '{"intent": "pet"}'],
        input="hi\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert (
        "HTTP 422" in done.stderr and "filter.intent: no response in this pool has this field" in done.stderr
    )


def test_errors_over_http(server):
    r = httpx.post(server + "/respond", json={"context": ["x"] * 7})
    assert r.status_code == 422 and r.json()["error"].startswith("context:")
    r = httpx.post(server + "/respond", json={"context": ["x" * 201]})
    assert r.status_code == 422 and r.json()["error"].startswith("context.0:")
    r = httpx.post(server + "/respond", content=b"x" * 70_000)
    assert r.status_code == 413
    r = httpx.get(server + "/respond")
    assert r.status_code == 405


def test_metrics_over_http(server):
    def respond_count() -> float:
        for line in httpx.get(server + "/metrics").text.splitlines():
            if line.startswith('coreply_requests_total{route="/respond",status="2xx"}'):
                return float(line.split()[-1])
        return 0.0

    before = respond_count()
    for _ in range(3):
        httpx.post(server + "/respond", json={"context": ["hello"]})
    assert respond_count() == before + 3


def test_fuzz_never_5xx_and_matches_schema(server):
    """Requests generated from /openapi.json (valid and invalid): never a 5xx, answers match the schema.
    The one allowed 5xx is the documented 504 for a request whose own X-Request-Timeout-Ms ran out."""
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    api = schemathesis.openapi.from_url(server + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/respond", "/healthz", "/readyz", "/metrics"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(base_url=server)
            if response.status_code == 504:
                assert "X-Request-Timeout-Ms" in (case.headers or {}), response.text
                assert response.json()["error"].startswith("deadline exceeded")
                case.validate_response(response, checks=checks[1:])
            else:
                case.validate_response(response, checks=checks)

        check()


@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs the Debian package prometheus (.ci/run installs it)"
)
def test_prometheus_scrapes_the_service(server, tmp_path):
    host_port = server.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n"
        f"  - job_name: coreply\n    static_configs:\n      - targets: ['{host_port}']\n"
    )
    port = free_port()
    prometheus = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    api_url = f"http://127.0.0.1:{port}/api/v1/query"
    query = (
        'histogram_quantile(0.99, sum by (le) (coreply_request_duration_seconds_bucket{route="/respond"}))'
    )
    try:
        wait_for(f"http://127.0.0.1:{port}/-/ready", prometheus, timeout=60)
        result = []
        deadline = time.monotonic() + 60
        while not result and time.monotonic() < deadline:
            httpx.post(server + "/respond", json={"context": ["do you play a sport ?"]})
            data = httpx.get(api_url, params={"query": query}).json()
            assert data["status"] == "success"
            result = [r for r in data["data"]["result"] if r["value"][1] not in ("NaN", "+Inf")]
            time.sleep(0.5)
        assert result, "Prometheus returned no data for the request-latency histogram"
        assert 0 < float(result[0]["value"][1]) < 5
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)


def test_sigterm_under_load_drains_every_admitted_request(tiny_bundle, tmp_path):
    """SIGTERM while requests are queued: readiness goes 503 (or the listener is already closed), every
    request the server accepted is answered 200, and the process exits cleanly within the drain."""
    import signal

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "cli", "serve", "--bundle", str(tiny_bundle), "--port", str(port)]
    env = {**os.environ, "COREPLY_DRAIN_SECONDS": "15", "COREPLY_QUEUE_MAX": "1000"}
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen([*cmd, "--threads", "1"], stdout=out, stderr=subprocess.STDOUT, env=env)
    wait_for(base + "/readyz", process)
    body = {"context": ["hi", "how are you ?", TOPICS["sport"][0]], "n_candidates": 13, "fusion": "sum"}
    check_drain_under_load(base, body, lambda: process.send_signal(signal.SIGTERM))
    process.wait(timeout=30)
    assert process.returncode in (0, -15) and "Application shutdown complete" in log.read_text()


def test_sighup_reloads_the_bundle_and_the_api_keys_in_a_real_server(tiny_bundle, tmp_path):
    import signal

    from index_builder.build import add_responses

    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    shutil.copytree(tiny_bundle, v1)
    shutil.copytree(tiny_bundle, v2)
    new = add_responses(v2, ["a brand new reply about gardening"], progress=False)["bundle_version"]
    current = tmp_path / "current"
    current.symlink_to(v1)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"bot": {"key": "k-old"}}))
    cmd = [sys.executable, "-m", "cli", "serve", "--bundle", str(current), "--port", str(port)]
    cmd += ["--api-keys-file", str(keys)]
    with open(tmp_path / "server.log", "w") as out:
        process = subprocess.Popen([*cmd, "--threads", "1"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(base + "/readyz", process)
        assert httpx.get(base + "/readyz").json()["bundle_version"] != new
        current.unlink()
        current.symlink_to(v2)
        keys.write_text(json.dumps({"bot": {"key": "k-new"}}))  # the key rotated with the bundle
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while httpx.get(base + "/readyz").json()["bundle_version"] != new:
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-2000:]
            time.sleep(0.2)
        hello = {"context": ["hello"]}
        assert httpx.post(base + "/respond", json=hello, headers={"X-API-Key": "k-new"}).status_code == 200
        assert httpx.post(base + "/respond", json=hello, headers={"X-API-Key": "k-old"}).status_code == 401
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert '"message": "reloaded"' in (tmp_path / "server.log").read_text()


def test_https_serves_a_renewed_certificate_after_sighup_and_keeps_it_through_a_wrong_one(
    tiny_bundle, tmp_path
):
    """A real server over HTTPS: SIGHUP with renewed files hands new connections the new certificate
    (the old one no longer verifies), and a key that does not match keeps the renewed one served."""
    import signal
    import ssl

    a, b = make_cert(tmp_path, "cert-a"), make_cert(tmp_path, "cert-b", days=30)
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    shutil.copy(a[0], cert)
    shutil.copy(a[1], key)
    trusts = {name: ssl.create_default_context(cafile=pair[0]) for name, pair in (("a", a), ("b", b))}
    port = free_port()
    base = f"https://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "cli", "serve", "--bundle", str(tiny_bundle), "--port", str(port)]
    cmd += ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--threads", "1"]
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(base + "/readyz", process, verify=trusts["a"])
        hello = {"context": ["hello"]}
        assert httpx.post(base + "/respond", json=hello, verify=trusts["a"]).status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/healthz")  # plain HTTP is not served beside it
        shutil.copy(b[0], cert)
        shutil.copy(b[1], key)
        process.send_signal(signal.SIGHUP)
        wait_for(base + "/readyz", process, timeout=30, verify=trusts["b"])
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(base + "/healthz", verify=trusts["a"])
        shutil.copy(a[1], key)  # the old key beside the new certificate: refused, cert-b still served
        process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while 'result="failed"' not in (metrics := httpx.get(base + "/metrics", verify=trusts["b"]).text):
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        assert httpx.post(base + "/respond", json=hello, verify=trusts["b"]).status_code == 200
        expiry = re.search(r"^coreply_tls_certificate_expiry_timestamp_seconds (\S+)$", metrics, re.M)
        assert expiry and 29 * 86400 < float(expiry.group(1)) - time.time() <= 30 * 86400  # b's, kept
    finally:
        process.terminate()
        process.wait(timeout=30)
    text = log.read_text()
    assert "Uvicorn running on https://" in text and "reloaded the TLS certificate" in text
    assert "KEY_VALUES_MISMATCH" in text
