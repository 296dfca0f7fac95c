"""``coreply serve`` and ``chat``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from cli.common import DEFAULTS_SHOWN, CliError, at_least, filter_json, knowledge_file, service_url


def serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve POST /respond, /docs and /chat (builds the default bundle on first use)"
    )
    p.add_argument(
        "--bundle", default=None, help="bundle dir (env COREPLY_BUNDLE; default: the built-in one)"
    )
    p.add_argument("--host", default=None, help="address to listen on (env COREPLY_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (env COREPLY_PORT; default 8000)")
    p.add_argument(
        "--backend",
        choices=["auto", "onnx", "torch", "torch-bf16"],
        default=None,
        help="inference backend (auto: ONNX if exported; torch-bf16: bf16 weights, for CPUs with AMX)",
    )
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (0 = measure at start)")
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N or auto (env COREPLY_DEVICE; default cpu)"
    )
    p.add_argument(
        "--api-keys-file",
        default=None,
        help="a JSON file of named API keys (each its key, or only the key's SHA-256 as key_sha256), "
        "each optionally scoped by a filter its answers meet and limited in requests at once; read "
        'again on SIGHUP (env COREPLY_API_KEYS_FILE): {"NAME": {"key": "...", "filter": {...}, '
        '"max_in_flight": N}}',
    )
    p.add_argument(
        "--tls-cert-file",
        default=None,
        help="a PEM certificate chain: serve HTTPS with it, read again on SIGHUP (env COREPLY_TLS_CERT_FILE)",
    )
    p.add_argument(
        "--tls-key-file",
        default=None,
        help="its PEM private key, unless the certificate file holds it (env COREPLY_TLS_KEY_FILE)",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from coreply.bundle import MANIFEST
    from service.settings import DEFAULT_BUNDLE, Settings

    flags = ("bundle", "host", "port", "backend", "threads", "device", "api_keys_file")
    flags += ("tls_cert_file", "tls_key_file")
    overrides = {k: getattr(args, k) for k in flags if getattr(args, k) is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:  # one line naming the setting, not pydantic's report
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        flag = f"--{field.replace('_', '-')} / " if field in flags else ""  # the rest are environment only
        message = first["msg"].removeprefix("Value error, ")  # one that names no field names its settings
        raise CliError(f"{flag}COREPLY_{field.upper()}: {message}" if field else message) from None
    built_in = settings.bundle == DEFAULT_BUNDLE
    if not built_in and not (settings.bundle / MANIFEST).is_file():  # said before torch's imports
        raise CliError(f"no bundle at {settings.bundle}; build one with `coreply index build -o DIR`")
    from coreply.device import on_own_thread, resolve_device

    try:
        resolve_device(settings.device)  # this host has it
    except ValueError as exc:
        raise CliError(f"--device / COREPLY_DEVICE: {exc}") from None
    if built_in:
        from index_builder.default import ensure_default_bundle

        on_own_thread(ensure_default_bundle, settings.bundle)  # its OpenMP threads end with it
    else:  # fail fast with a clear message rather than inside the server's lifespan
        from coreply.bundle import read_manifest

        read_manifest(settings.bundle)
    if settings.keys.scoped:  # a key's filter this pool cannot read is said here, not in the server's log
        from coreply.bundle import pool_filters
        from service.keys import scope_masks

        try:
            scope_masks(settings.keys, pool_filters(settings.bundle))
        except ValueError as exc:
            raise CliError(f"--api-keys-file / COREPLY_API_KEYS_FILE: {exc}") from None
    from service.server import serve

    serve(settings)
    return 0


def chat_parser(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="talk to a bundle (or a running service) in the terminal; /reset, /quit",
        **DEFAULTS_SHOWN,
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--bundle", default=None, help="bundle dir (default: the built-in one, built if missing)"
    )
    where.add_argument(
        "--url", type=service_url, default=None, help="a running service instead, e.g. http://127.0.0.1:8000"
    )
    p.add_argument(
        "--api-key", default=os.environ.get("COREPLY_API_KEY"), help="for --url (env COREPLY_API_KEY)"
    )
    p.add_argument("--candidates", type=at_least(1), default=10, help="n_r: candidates recalled and reranked")
    p.add_argument("--show", type=at_least(1), default=1, help="replies shown per turn (best first)")
    p.add_argument(
        "--knowledge",
        default=None,
        metavar="FILE",
        help="a persona or facts (one sentence per line) sent with every turn, for a bundle whose reranker "
        "reads knowledge (default: the bundle's own)",
    )
    p.add_argument(
        "--filter",
        type=filter_json,
        default=None,
        metavar="JSON",
        help="""answer only with responses whose metadata matches, as /respond's "filter": '{"intent": """
        """["refund", "billing"], "locale": "en", "price": {"$lt": 20}}' (default: the whole pool)""",
    )


def _remote(url: str, api_key: str | None, knowledge: list[str] | None, where: dict | None):
    """``answer(context, said)`` against a running service's POST /respond."""
    import urllib.error
    import urllib.request

    def answer(context: list[str], said: list[int], n: int, show: int) -> list[dict]:
        body = {"context": context[-10:], "n_candidates": max(n, show), "top_k": show, "exclude": said[-50:]}
        if knowledge:
            body["knowledge"] = knowledge
        if where:
            body["filter"] = where
        headers = {"Content-Type": "application/json"} | ({"X-API-Key": api_key} if api_key else {})
        request = urllib.request.Request(url.rstrip("/") + "/respond", json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                result = json.load(r)
        except urllib.error.HTTPError as exc:
            raise CliError(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:200]}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise CliError(f"{url}: cannot reach the service ({exc}); is `coreply serve` running?") from None
        if result.get("fallback") is not None:
            return [{"text": result["fallback"], "id": None, "score": float("nan")}]
        return result["responses"]

    return answer


def _local(path: Path, knowledge: list[str] | None, where: dict | None):
    """``answer(context, said)`` in-process through :class:`coreply.Responder`."""
    from coreply.bundle import read_manifest

    read_manifest(path, verify=False)  # a bundle, said at once; loading it verifies every hash
    from coreply.filters import FilterError
    from coreply.responder import Responder

    bot = Responder.load(path)
    if knowledge and not bot.pipeline.reads_knowledge:
        raise CliError(f"--knowledge: the reranker of {path} does not read knowledge")
    if where:
        try:
            bot.bundle.filters.allowed(where)  # a field the pool lacks, said before the first turn
        except FilterError as exc:
            raise CliError(f"--filter: {exc}") from None

    def answer(context: list[str], said: list[int], n: int, show: int) -> list[dict]:
        found = bot.respond(
            context[-10:],
            top_k=show,
            n_candidates=max(n, show),
            exclude_ids=said[-50:],
            knowledge=knowledge,
            filter=where,
        )
        return [{"text": r.text, "id": r.id, "score": r.score} for r in found]

    return answer


def cmd_chat(args: argparse.Namespace) -> int:
    knowledge = knowledge_file(args.knowledge) if args.knowledge else None
    if args.url:
        answer = _remote(args.url, args.api_key, knowledge, args.filter)
    else:
        from service.settings import DEFAULT_BUNDLE

        path = Path(args.bundle) if args.bundle else DEFAULT_BUNDLE
        if args.bundle is None:
            from index_builder.default import ensure_default_bundle

            ensure_default_bundle(path)
        answer = _local(path, knowledge, args.filter)
    print("coreply chat: type a message; /reset starts over, /quit (or Ctrl-D) leaves", flush=True)
    context: list[str] = []
    said: list[int] = []
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line in ("/quit", "/exit"):
            return 0
        if line == "/reset":
            context, said = [], []
            continue
        if not line:
            continue
        context.append(line)
        found = answer(context, said, args.candidates, args.show)
        if not found:
            print(
                "bot> (no answer: every candidate was excluded"
                + (", or --filter allows none)" if args.filter else ")")
            )
            continue
        for rank, reply in enumerate(found):
            prefix = "bot> " if rank == 0 else f"  {rank + 1}. "
            print(f"{prefix}{reply['text']}  [{reply['score']:.2f}]", flush=True)
        context.append(found[0]["text"])
        if found[0]["id"] is not None:
            said.append(found[0]["id"])
