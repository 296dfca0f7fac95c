"""HTTPS without a proxy in front: the certificate chain and key named by ``COREPLY_TLS_CERT_FILE`` and
``COREPLY_TLS_KEY_FILE``, read again on SIGHUP so that a renewed certificate is served without a restart.

uvicorn is handed one server context for the life of the process. Its SNI callback, which runs in every
handshake, gives the connection the context read last: a renewal swaps a whole context, read and checked
before it is used (never a new certificate beside the old key), and connections already open keep theirs."""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import ssl
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.DOTALL)
RENEW_WITHIN_DAYS = 14  # alert CoreplyCertificateExpiring's threshold (docker/prometheus/alerts.yml)


def read_context(cert: Path, key: Path | None) -> ssl.SSLContext:
    """A TLS 1.2+ server context holding the chain in ``cert`` and its private key (``key``, or ``cert``
    when that file holds both). A ValueError says in one line what is wrong with the files."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    for path in [cert] if key is None else [cert, key]:  # a file that cannot be read is named alone
        try:
            path.read_bytes()
        except OSError as exc:
            raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    files = str(cert) if key is None else f"{cert} and {key}"
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        why = f" ({exc.reason})" if exc.reason else "" if key else " (no key in it: name the key's file too)"
        raise ValueError(f"{files}: not a PEM certificate chain and its private key{why}") from None
    except OSError as exc:
        raise ValueError(f"{exc.filename or files}: cannot read it ({exc.strerror})") from None
    return context


def not_after(pem: bytes) -> float:
    """When the first certificate in ``pem`` (the one served: a chain starts with it) expires, as Unix
    time: its X.509 ``validity.notAfter``. A ValueError when there is no readable certificate."""
    block = _PEM.search(pem)
    try:
        der = base64.b64decode(block.group(1)) if block else b""
        _, body, _ = _tlv(der, 0)  # Certificate ::= SEQUENCE { tbsCertificate, signature...
        _, at, _ = _tlv(der, body)  # TBSCertificate ::= SEQUENCE {
        tag, _, end = _tlv(der, at)
        at = end if tag == 0xA0 else at  # [0] version, absent in v1 certificates
        for _ in range(3):  # serialNumber, signature algorithm, issuer
            at = _tlv(der, at)[2]
        _, validity, _ = _tlv(der, at)  # Validity ::= SEQUENCE { notBefore, notAfter }
        tag, start, end = _tlv(der, _tlv(der, validity)[2])
        text = der[start:end].decode("ascii")
        # RFC 5280: UTCTime YYMMDDHHMMSSZ (years 1950-2049), GeneralizedTime YYYYMMDDHHMMSSZ from 2050
        when = datetime.strptime(text, "%y%m%d%H%M%SZ" if tag == 0x17 else "%Y%m%d%H%M%SZ")
    except (IndexError, ValueError, UnicodeDecodeError, binascii.Error):
        raise ValueError("no X.509 certificate with a validity period in it") from None
    return when.replace(tzinfo=timezone.utc).timestamp()


def expiry_warning(not_after: float, now: float) -> str | None:
    """What the log warns of a certificate served until ``not_after`` (Unix time) at ``now``: that it has
    expired, or expires within RENEW_WITHIN_DAYS; None when it does neither."""
    days = (not_after - now) / 86400
    if days <= 0:
        return "the TLS certificate served has expired, so clients refuse it: renew its files and send SIGHUP"
    if days < RENEW_WITHIN_DAYS:
        return (
            f"the TLS certificate served expires in {days:.1f} days (renewal tools renew a month ahead): "
            "renew its files and send SIGHUP"
        )
    return None


def _tlv(der: bytes, at: int) -> tuple[int, int, int]:
    """The DER element at ``at``: its tag, where its contents start and where they end."""
    tag, length, at = der[at], der[at + 1], at + 2
    if length & 0x80:  # long form: the next (length & 0x7F) bytes hold the length
        width = length & 0x7F
        length, at = int.from_bytes(der[at : at + width], "big"), at + width
    if at + length > len(der):
        raise IndexError("element runs past the end")
    return tag, at, at + length


class Renewal(NamedTuple):
    """The certificate files as :meth:`Certificate.read` found them, checked."""

    context: ssl.SSLContext
    digest: str
    not_after: float  # Unix time


class Certificate:
    """The certificate served: ``server`` is the context uvicorn listens with. :meth:`read` reads the files
    again, :meth:`use` has every new handshake use what it read (a reload does both, and uses it only
    when the whole reload succeeds)."""

    def __init__(self, cert: Path, key: Path | None) -> None:
        self.cert, self.key = cert, key
        first = self._read_files(served=None)
        assert first is not None
        self.server = first.context
        self.server.sni_callback = self._handshake
        self._current, self._read, self.not_after = first  # not_after: of the certificate served

    def _read_files(self, served: str | None) -> Renewal | None:
        """The files read once for their digest and expiry, then loaded; None when the digest is
        ``served``. Read before they are loaded, so a file replaced in between has another digest and
        the next read loads it again."""
        files = [self.cert] if self.key is None else [self.cert, self.key]
        try:
            contents = [f.read_bytes() for f in files]
        except OSError as exc:
            raise ValueError(f"{exc.filename}: cannot read it ({exc.strerror})") from None
        digest = hashlib.sha256(b"".join(contents)).hexdigest()
        if digest == served:
            return None
        context = read_context(self.cert, self.key)
        try:
            return Renewal(context, digest, not_after(contents[0]))
        except ValueError as exc:
            raise ValueError(f"{self.cert}: {exc}") from None

    def _handshake(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        if self._current is not context:
            connection.context = self._current

    def read(self) -> Renewal | None:
        """The files as they are now, checked, for :meth:`use`; None when they have not changed since they
        were last used. A ValueError says what is wrong with them."""
        return self._read_files(served=self._read)

    def describe(self) -> dict[str, str]:
        """The certificate served, for the log: its file and when it expires."""
        expires = datetime.fromtimestamp(self.not_after, timezone.utc).isoformat()
        return {"cert": str(self.cert), "not_after": expires}

    def use(self, renewal: Renewal) -> None:
        """Hand every new handshake from now on what :meth:`read` returned; open connections keep theirs."""
        self._current, self._read, self.not_after = renewal
