"""HTTPS settings (COREPLY_TLS_CERT_FILE, COREPLY_TLS_KEY_FILE): what is refused at start, in one line,
and what a renewal reads. A real server's handshakes before and after a SIGHUP: tests/test_e2e.py."""

import json
import logging
import shutil
import ssl
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
from conftest import make_cert
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service.app import create_app
from service.settings import Settings
from service.tls import Certificate, expiry_warning, not_after, read_context


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tls")
    make_cert(folder, "a")
    make_cert(folder, "b", days=30)
    make_cert(folder, "c", days=10_000)  # past 2049: a GeneralizedTime, not a UTCTime
    (folder / "both.pem").write_bytes((folder / "a.crt").read_bytes() + (folder / "a.key").read_bytes())
    (folder / "key-first.pem").write_bytes((folder / "c.key").read_bytes() + (folder / "c.crt").read_bytes())
    (folder / "junk").write_text("not pem\n")
    return folder


def test_a_certificate_and_its_key_are_served_from_two_files_or_one(certs):
    assert read_context(certs / "a.crt", certs / "a.key").minimum_version.name == "TLSv1_2"
    read_context(certs / "both.pem", None)
    settings = Settings(tls_cert_file=certs / "a.crt", tls_key_file=certs / "a.key")
    assert settings.tls_cert_file == certs / "a.crt"
    assert Settings(tls_cert_file="", tls_key_file="").tls_cert_file is None  # set but empty: none


@pytest.mark.parametrize(
    "cert, key, says",
    [
        (
            "a.crt",
            "b.key",
            "a.crt and {d}/b.key: not a PEM certificate chain and its private key (KEY_VALUES",
        ),
        ("a.crt", None, "a.crt: not a PEM certificate chain and its private key (no key in it: name the key"),
        ("a.key", "a.crt", "a.key and {d}/a.crt: not a PEM certificate chain"),
        ("junk", "a.key", "junk and {d}/a.key: not a PEM certificate chain"),
        ("missing.crt", "a.key", "--tls-key-file: {d}/missing.crt: cannot read it (No such file or"),
        ("a.crt", ".", "--tls-key-file: {d}: cannot read it (Is a directory)"),
        (None, "a.key", "COREPLY_TLS_KEY_FILE is set without COREPLY_TLS_CERT_FILE"),
    ],
)
def test_files_that_cannot_serve_https_are_refused_at_start_naming_them(certs, cert, key, says):
    paths = {"tls_cert_file": cert and certs / cert, "tls_key_file": key and certs / key}
    with pytest.raises(ValidationError) as refused:
        Settings(**{name: path for name, path in paths.items() if path is not None})
    message = refused.value.errors()[0]["msg"]
    assert says.format(d=certs) in message
    if cert is not None:
        assert message.startswith("Value error, --tls-cert-file / --tls-key-file: ")


def openssl_not_after(cert: Path) -> float:
    said = subprocess.run(["openssl", "x509", "-enddate", "-noout", "-in", str(cert)], capture_output=True)
    return ssl.cert_time_to_seconds(said.stdout.decode().strip().removeprefix("notAfter="))


@pytest.mark.parametrize("name, file", [("a", "a.crt"), ("b", "b.crt"), ("c", "c.crt"), ("a", "both.pem"),
                                        ("c", "key-first.pem")])  # fmt: skip
def test_the_expiry_read_is_the_one_openssl_reads(certs, name, file):
    assert not_after((certs / file).read_bytes()) == openssl_not_after(certs / f"{name}.crt")


def test_a_file_without_a_readable_certificate_has_no_expiry(certs):
    pem = (certs / "a.crt").read_bytes()
    body = pem.split(b"\n")
    truncated = b"\n".join([*body[:3], body[-2]])  # header, two lines of base64, footer
    for wrong in (b"", b"not pem\n", (certs / "a.key").read_bytes(), truncated):
        with pytest.raises(ValueError, match=r"no X\.509 certificate with a validity period in it"):
            not_after(wrong)


@pytest.mark.parametrize(
    ("days_left", "says"),
    [
        (-3, "has expired"),
        (0, "has expired"),
        (0.5, "expires in 0.5 days"),
        (13.96, "expires in 14.0 days"),
        (14, None),
        (90, None),
    ],
)
def test_a_certificate_expired_or_within_the_alerts_14_days_is_warned_of(days_left, says):
    now = 1_800_000_000.0
    warning = expiry_warning(now + days_left * 86400, now)
    assert warning is None if says is None else says in warning and "SIGHUP" in warning


def test_a_renewal_reads_the_files_again_and_keeps_the_served_one_when_they_are_wrong(certs, tmp_path):
    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    shutil.copy(certs / "a.crt", cert)
    shutil.copy(certs / "a.key", key)
    live = Certificate(cert, key)
    assert live.server.sni_callback is not None and live.read() is None  # the same files
    assert live.not_after == openssl_not_after(certs / "a.crt")
    shutil.copy(certs / "b.crt", cert)
    with pytest.raises(ValueError, match="KEY_VALUES_MISMATCH"):  # halfway through a rotation
        live.read()
    shutil.copy(certs / "b.key", key)
    renewal = live.read()
    assert renewal is not None and live.read() is not None  # read, not yet used
    assert live.not_after == openssl_not_after(certs / "a.crt")
    live.use(renewal)
    assert live.read() is None and live.not_after == openssl_not_after(certs / "b.crt")
    key.unlink()
    with pytest.raises(ValueError, match=r"live\.key: cannot read it"):
        live.read()


def expiry(metrics: str) -> float:
    (line,) = [
        x for x in metrics.splitlines() if x.startswith("coreply_tls_certificate_expiry_timestamp_seconds ")
    ]
    return float(line.split()[1])


def test_files_renewed_while_they_are_loaded_are_loaded_again_on_the_next_read(certs, tmp_path, monkeypatch):
    import service.tls

    cert, key = tmp_path / "live.crt", tmp_path / "live.key"
    shutil.copy(certs / "a.crt", cert)
    shutil.copy(certs / "a.key", key)

    def load_then_renew(*files: Path):  # the renewal lands just after the files were loaded
        context = read_context(*files)
        shutil.copy(certs / "b.crt", cert)
        shutil.copy(certs / "b.key", key)
        return context

    monkeypatch.setattr(service.tls, "read_context", load_then_renew)
    live = Certificate(cert, key)
    monkeypatch.undo()
    assert live.not_after == openssl_not_after(certs / "a.crt")  # what is served
    renewal = live.read()
    assert renewal is not None and renewal.not_after == openssl_not_after(certs / "b.crt")


def test_a_reload_that_fails_uses_no_renewed_certificate(tiny_bundle, certs, tmp_path, caplog):
    """Certificate, keys and bundle are swapped together or not at all: a renewed certificate beside a
    key scoped by a field the pool lacks is not used, and is once the key file is right."""
    cert, key, keys = tmp_path / "live.crt", tmp_path / "live.key", tmp_path / "keys.json"
    shutil.copy(certs / "a.crt", cert)
    shutil.copy(certs / "a.key", key)
    keys.write_text(json.dumps({"bot": {"key": "k1"}}))
    settings = Settings(
        bundle=tiny_bundle, threads=1, tls_cert_file=cert, tls_key_file=key, api_keys_file=keys
    )
    app = create_app(settings)
    caplog.set_level(logging.INFO, logger="coreply.service")
    with TestClient(app) as c:
        assert expiry(c.get("/metrics", headers={"X-API-Key": "k1"}).text) == openssl_not_after(
            certs / "a.crt"
        )
        shutil.copy(certs / "b.crt", cert)
        shutil.copy(certs / "b.key", key)
        keys.write_text(json.dumps({"bot": {"key": "k1", "filter": {"locale": "de"}}}))  # a field it lacks
        assert c.portal.call(app.reload) is False
        assert app.state.tls.read() is not None  # still not used
        keys.write_text(json.dumps({"bot": {"key": "k1"}}))
        assert c.portal.call(app.reload) is True  # the same keys and bundle: only the certificate
        assert app.state.tls.read() is None
        assert c.portal.call(app.reload) is True
        metrics = c.get("/metrics", headers={"X-API-Key": "k1"}).text
    assert expiry(metrics) == openssl_not_after(certs / "b.crt")
    logged = {r.getMessage(): r.fields for r in caplog.records if hasattr(r, "fields")}
    started, renewed = logged["serving"]["tls"], logged["reloaded the TLS certificate"]
    assert datetime.fromisoformat(started["not_after"]).timestamp() == openssl_not_after(certs / "a.crt")
    assert datetime.fromisoformat(renewed["not_after"]).timestamp() == openssl_not_after(certs / "b.crt")
    assert started["cert"] == renewed["cert"] == str(cert)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "TLS" in r.getMessage()]
    assert len(warned) == 1  # at start, for "a" (2 days left); not for the refused reload, nor for "b"
    assert warned[0].getMessage().startswith("the TLS certificate served expires in ")  # ~2 days
    assert warned[0].fields == started
    for result, n in (("ok", 1), ("unchanged", 1), ("failed", 1)):
        assert f'coreply_reloads_total{{result="{result}"}} {n}.0' in metrics


def test_a_reload_that_keeps_an_expiring_certificate_warns_again(tiny_bundle, certs, caplog):
    """A SIGHUP that finds no renewal says so again: the operator learns the renewal did not happen."""
    app = create_app(
        Settings(bundle=tiny_bundle, threads=1, tls_cert_file=certs / "a.crt", tls_key_file=certs / "a.key")
    )
    caplog.set_level(logging.INFO, logger="coreply.service")
    with TestClient(app) as c:
        assert c.portal.call(app.reload) is True
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and all(m.startswith("the TLS certificate served expires in") for m in warned)
