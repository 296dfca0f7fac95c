"""HTTPS without a proxy in front: the certificate chain and key named by ``COREPLY_TLS_CERT_FILE`` and
``COREPLY_TLS_KEY_FILE``, read again on SIGHUP so that a renewed certificate is served without a restart.

uvicorn is handed one server context for the life of the process. Its SNI callback, which runs in every
handshake, gives the connection the context read last: a renewal swaps a whole context, read and checked
before it is used (never a new certificate beside the old key), and connections already open keep theirs."""

from __future__ import annotations

import hashlib
import ssl
from pathlib import Path


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


class Certificate:
    """The certificate served: ``server`` is the context uvicorn listens with. :meth:`read` reads the files
    again, :meth:`use` has every new handshake use what it read (a reload does both, and uses it only
    when the whole reload succeeds)."""

    def __init__(self, cert: Path, key: Path | None) -> None:
        self.cert, self.key = cert, key
        self.server = read_context(cert, key)
        self.server.sni_callback = self._handshake
        self._current, self._read = self.server, self._digest()

    def _digest(self) -> str:
        files = [self.cert] if self.key is None else [self.cert, self.key]
        try:
            return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()
        except OSError as exc:
            raise ValueError(f"{exc.filename}: cannot read it ({exc.strerror})") from None

    def _handshake(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        if self._current is not context:
            connection.context = self._current

    def read(self) -> tuple[ssl.SSLContext, str] | None:
        """The files as they are now, checked, with their digest for :meth:`use`; None when they have not
        changed since they were last used. A ValueError says what is wrong with them."""
        digest = self._digest()
        return None if digest == self._read else (read_context(self.cert, self.key), digest)

    def use(self, renewal: tuple[ssl.SSLContext, str]) -> None:
        """Hand every new handshake from now on what :meth:`read` returned; open connections keep theirs."""
        self._current, self._read = renewal
