"""Latency and throughput of coreply's /respond against a naive in-process peer, side by side.

coreply runs as the real server (``coreply serve`` under uvicorn, a subprocess) and is called over
HTTP at concurrency 1 / 4 / 16; the peer is the pipeline a team would hand-roll on the same weights:
the context encoded in PyTorch fp32 (``SentenceTransformer.encode`` of the turns joined for a zero-shot
retriever, else the bundle's trained one through its own model) -> FAISS exact search over the bundle's
index (or, with ``--peer-pool own``, its own index of the pool encoded by its retriever in fp32) -> the
cross-encoder in PyTorch fp32, one batch per request.
The two alternate in blocks within one invocation so that machine noise hits both alike.

    python bench/bench.py --bundle artifacts/bench-bundle --out docs/perf-cpu.json

Quality beside the timings: each side's hits@1 on the same requests (its top answer the test reply), a
one-sided paired bootstrap p that coreply's is not higher, and the fraction of requests whose top-1 is
the same for both (coreply runs int8 ONNX and its own stages, the peer fp32 PyTorch and none).

The requests are chitchat test contexts, whose every turn the pool holds; ``--typed-user-turns`` sends
the user's turns as text it does not hold, as a deployed service receives them (performance.md §39).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from coreply.artifacts import check_out_file, write_json_atomic
from coreply.text import normalize
from evaluation.metrics import paired_bootstrap

if TYPE_CHECKING:
    from coreply.bundle import Bundle
    from coreply.inference import OnnxBackend
    from coreply.responder import Responder


def percentiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {f"p{q}": round(float(np.percentile(a, q)), 1) for q in (50, 95, 99)} | {
        "mean": round(float(a.mean()), 1)
    }


def provenance() -> dict[str, str]:
    """When, where and how a benchmark result was produced."""
    import torch

    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return {
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} vCPUs{gpu}, {platform.platform()}",
        "command": " ".join(sys.argv),
    }


def refuse_below(args: argparse.Namespace, **floors: float) -> None:
    """A one-line exit naming the first flag under its floor (``batch_size=1`` is ``--batch-size``),
    or ``--out`` where its folder does not exist or it is one: before any slow work starts."""
    for flag, least in floors.items():
        if not (value := getattr(args, flag)) >= least:  # NaN too
            raise SystemExit(f"--{flag.replace('_', '-')}: give at least {least}, got {value}")
    if (out := getattr(args, "out", None)) is not None:
        try:
            check_out_file(out)
        except ValueError as e:
            raise SystemExit(f"--out: {e}") from None


def paired_hits(hit: np.ndarray, base: np.ndarray, p_name: str) -> dict:
    """hits@1 of the per-pair ``hit`` [N] (0/1), its wins and losses against ``base`` [N], and under
    ``p_name`` the one-sided paired bootstrap p that it is not better."""
    return {
        "hits@1": round(100 * float(hit.mean()), 2),
        "wins": int(((hit == 1) & (base == 0)).sum()),
        "losses": int(((hit == 0) & (base == 1)).sum()),
        p_name: round(paired_bootstrap(hit, base), 4),
    }


Span = tuple[str, int, int]  # split, start, limit


def span(flag: str, text: str) -> Span:
    """``split:start:limit`` (e.g. ``valid:2000:4622``) as a tuple; a one-line exit naming ``flag``."""
    try:
        split, start, limit = text.split(":")
        parsed = (split, int(start), int(limit))
    except ValueError:
        raise SystemExit(f"{flag}: {text!r} is not split:start:limit, e.g. test:0:2000") from None
    if split not in ("valid", "test") or parsed[1] < 0 or parsed[2] < 1:
        raise SystemExit(f"{flag}: {text!r} needs split valid or test, start >= 0 and limit >= 1")
    return parsed


def disjoint_spans(flag: str, texts: list[str], taken: tuple[Span, ...] = (), named: str = "") -> list[Span]:
    """Each of ``texts`` as a :func:`span`; a one-line exit naming ``flag`` where one overlaps another or
    one of ``taken`` (``named``: the flag that gave those), since pooled pairs must be distinct and a
    choice measured on the pairs it was made on is not held out."""
    spans, seen = [span(flag, t) for t in texts], list(taken)
    for split, start, limit in spans:
        if any(s == split and a < start + limit and start < a + n for s, a, n in seen):
            what = f"{named} or another span" if named else "another span"
            raise SystemExit(f"{flag}: {split}:{start}:{limit} overlaps {what}; give disjoint ones")
        seen.append((split, start, limit))
    return spans


def span_pairs(flag: str, splits: dict[str, list], given: Span) -> list:
    """The pairs of the span ``given`` (by ``flag``); a one-line exit where it runs past its split."""
    split, start, limit = given
    if start + limit > len(splits[split]):
        raise SystemExit(
            f"{flag}: {split}:{start}:{limit} runs past the {split} split's {len(splits[split])} pairs"
        )
    return splits[split][start : start + limit]


def span_name(split: str, start: int, limit: int) -> str:
    """How results name a span: ``test[0:2000]``."""
    return f"{split}[{start}:{start + limit}]"


def add_pairs_args(p: argparse.ArgumentParser, split: str, start: int, limit: int) -> None:
    """``--split``, ``--start`` and ``--limit`` (which chitchat pairs a bench measures) and ``--out``
    (its JSON file); :func:`chosen_pairs` checks them."""
    p.add_argument("--split", default=split, choices=["valid", "test"])
    p.add_argument("--start", type=int, default=start, help="skip the split's first N pairs")
    p.add_argument("--limit", type=int, default=limit, help="N pairs of the split, from --start")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")


def chosen_pairs(args: argparse.Namespace) -> list:
    """The pairs :func:`add_pairs_args`' flags name; a one-line exit naming the flag when they name
    none or ``--out`` has no folder."""
    from coreply.corpus import load_chitchat

    refuse_below(args, start=0, limit=1)
    pairs = load_chitchat()[args.split][args.start : args.start + args.limit]
    if not pairs:
        raise SystemExit(f"--start {args.start}: the {args.split} split has fewer pairs; give a smaller one")
    return pairs


def responder(path: str, **options) -> Responder:
    """``Responder.load(path, **options)``, or a one-line exit naming ``--bundle`` with why it did not
    load (missing, unreadable, or failing its checks)."""
    from coreply.responder import Responder

    try:
        return Responder.load(path, **options)
    except (OSError, ValueError) as exc:  # a BundleError too
        raise SystemExit(f"--bundle: {exc}") from None


def open_bundle(path: str) -> Bundle:
    """``load_bundle(path)``, or a one-line exit naming ``--bundle`` with why it did not load."""
    from coreply.bundle import load_bundle

    try:
        return load_bundle(path)
    except (OSError, ValueError) as exc:  # a BundleError too
        raise SystemExit(f"--bundle: {exc}") from None


def onnx_rerank_requests(
    path: str, threads: int, n_r: int, count: int
) -> tuple[Bundle, OnnxBackend, list[tuple[list[list[str]], list[str]]]]:
    """The bundle at ``path`` on its ONNX graphs (``threads`` as served) and what its rerank stage gets
    for the first ``count`` chitchat test contexts: per request the context once per candidate and the
    ``n_r`` recalled candidates' texts. A one-line exit naming ``--bundle`` unless it loads and has a
    reranker exported to ONNX."""
    from coreply.bundle import IndexRetriever, make_backend
    from coreply.corpus import load_chitchat
    from coreply.inference import OnnxBackend

    bundle = open_bundle(path)
    try:
        backend = make_backend(bundle, "onnx", threads=threads)
    except ValueError as exc:  # a BundleError: no ONNX export
        raise SystemExit(f"--bundle: {exc}") from None
    if not isinstance(backend, OnnxBackend) or backend.cross is None or backend.cross_tokenizer is None:
        raise SystemExit(f"--bundle {path}: needs a reranker exported to ONNX")
    contexts = [list(pair.context) for pair in load_chitchat()["test"][:count]]
    requests = []
    for context, row in zip(contexts, IndexRetriever(backend, bundle.index)(contexts, n_r).ids, strict=True):
        texts = [bundle.texts[i] for i in row if i >= 0]
        requests.append(([context] * len(texts), texts))
    return bundle, backend, requests


def onnx_reranker(bundle: str) -> Responder:
    """The bundle's :class:`~coreply.responder.Responder` on its ONNX graphs; a one-line exit naming
    ``--bundle`` unless it loads and has a reranker exported to ONNX."""
    from coreply.inference import OnnxBackend

    bot = responder(bundle, backend="onnx")
    if not isinstance(bot.backend, OnnxBackend) or bot.backend.cross is None:
        raise SystemExit(f"--bundle {bundle}: needs a reranker exported to ONNX")
    return bot


def operators(prof, cuda: bool, batches: int, top: int) -> list[dict]:
    """The ``top`` operators of a ``torch.profiler`` run by self device time (host time without CUDA),
    per batch (or step), in ms."""
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) if cuda else 0
        rows.append(
            {
                "op": event.key,
                "calls_per_batch": round(event.count / batches, 1),
                "self_host_ms": round(event.self_cpu_time_total / 1000 / batches, 3),
                "self_device_ms": round(device_us / 1000 / batches, 3),
            }
        )
    rows.sort(key=lambda r: r["self_device_ms" if cuda else "self_host_ms"], reverse=True)
    return rows[:top]


def device_busy_share(prof, wall: float) -> float:
    """The share of ``wall`` seconds in which a ``torch.profiler`` run's CUDA kernels ran."""
    return round(sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / wall, 3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``coreply serve`` in a subprocess; a one-line exit naming ``--bundle`` where it is not a bundle, or
    saying why the server stopped before it was ready (the last line it wrote)."""

    def __init__(self, bundle: str, threads: int, env: dict[str, str] | None = None) -> None:
        from coreply.bundle import BundleError, read_manifest

        try:  # its files' hashes are the server's to check as it loads: its last line says what failed
            read_manifest(Path(bundle), verify=False)
        except BundleError as exc:
            raise SystemExit(f"--bundle: {exc}") from None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "COREPLY_MAX_CANDIDATES": "200", "COREPLY_QUEUE_MAX": "1024"} | {
            "COREPLY_CASCADE": "false",  # measure the work asked for, not the load-adaptive shortcut
            **(env or {}),
        }
        cmd = [sys.executable, "-m", "cli", "serve", "--bundle", bundle, "--port", str(self.port)]
        cmd += ["--threads", str(threads)]
        with tempfile.TemporaryFile() as log:  # the server's own copy outlives this one
            self.process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                if (code := self.process.poll()) is not None:
                    log.seek(0)
                    last = (log.read().decode(errors="replace").strip().splitlines() or ["no output"])[-1]
                    raise SystemExit(f"coreply serve --bundle {bundle} exited ({code}): {last}")
                try:
                    if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                        return
                except httpx.HTTPError:
                    time.sleep(0.3)
        self.stop()
        raise SystemExit(f"coreply serve --bundle {bundle} was not ready in 300 s")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def typed_user_turns(context: list[str]) -> list[str]:
    """``context`` as a deployed service receives it: the user's turns (the last, and every second one
    before it) are text its pool does not hold verbatim. chitchat's pool holds every test line, so the
    restatement guard reads those turns' vectors from the index (performance.md §23), which a user's own
    words never allow. A trailing space rules that out and nothing else: the tokenizers drop it, so the
    model inputs, the scores and the answers are the same (performance.md §39)."""
    last = len(context) - 1
    return [turn + " " if (last - i) % 2 == 0 else turn for i, turn in enumerate(context)]


def respond_body(context: list[str], n_r: int, fusion: str) -> dict:
    """A POST /respond body; fusion "default" names none, as a client that takes the bundle's own
    (gated) answers does."""
    return {"context": context, "n_candidates": n_r} | ({} if fusion == "default" else {"fusion": fusion})


async def load(
    url: str,
    contexts: list[list[str]],
    n_r: int,
    concurrency: int,
    fusion: str = "rerank",
    think_ms: float = 0,
) -> dict:
    """Send every context once with ``concurrency`` clients, each pausing ``think_ms`` after an answer
    before its next request; client-side latency per request."""
    latencies, stages, tops = [], [], []
    queue = list(enumerate(contexts))
    results: dict[int, int] = {}

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i, context = queue.pop(0)
            body = respond_body(context, n_r, fusion)
            start = time.perf_counter()
            response = await client.post(url + "/respond", json=body)
            latencies.append(1000 * (time.perf_counter() - start))
            if response.is_error:  # e.g. --fusion rerank on a bundle without a reranker
                raise SystemExit(f"bench: POST /respond answered {response.status_code}: {response.text}")
            data = response.json()
            stages.append(data["timings_ms"])
            results[i] = data["responses"][0]["id"]
            await asyncio.sleep(think_ms / 1000)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    tops = [results[i] for i in range(len(contexts))]
    mean_stage = {k: round(float(np.mean([s[k] for s in stages])), 1) for k in stages[0]}
    return {
        "latency_ms": percentiles(latencies),
        "rps": round(len(contexts) / wall, 1),
        "stages_ms": mean_stage,
        "top1": tops,
    }


class Peer:
    """The naive pipeline: encode in PyTorch fp32 -> FAISS -> cross-encoder fp32, per request."""

    def __init__(self, bundle_dir: str, cross_dir: str | None = None, own_pool: bool = False) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        from coreply.bundle import load_bundle
        from coreply.checkpoint import load_checkpoint
        from coreply.models import resolve_base_model

        bundle = load_bundle(bundle_dir)
        self.bundle = bundle
        device = "cuda" if torch.cuda.is_available() else "cpu"  # where a team would run it
        if bundle.manifest["models"]["bi"]["source"] == "zero-shot":  # all-MiniLM-L6-v2 as published
            encoder = SentenceTransformer(str(resolve_base_model("default")), device=device)
            self.encode = lambda c: encoder.encode(
                [" ".join(c)], convert_to_numpy=True, normalize_embeddings=True
            )
            encode_pool = lambda texts: encoder.encode(  # noqa: E731
                texts, batch_size=128, convert_to_numpy=True, normalize_embeddings=True
            )
        else:  # trained weights: their own model, as the training code runs it
            bi = load_checkpoint(bundle.model_dir("bi"), device, expect="bi")
            self.encode = lambda c: bi.embed_contexts([c]).numpy()
            encode_pool = lambda texts: bi.embed_responses(texts).numpy()  # noqa: E731
        self.index, self.pool_encode_s = bundle.index, None
        if own_pool:  # the pool as a team would index it: its own fp32 vectors, exact inner product
            import faiss

            start = time.perf_counter()
            vectors = np.ascontiguousarray(encode_pool(bundle.texts), dtype="float32")  # [N, D]
            self.index = faiss.IndexFlatIP(vectors.shape[1])
            self.index.add(vectors)
            self.pool_encode_s = round(time.perf_counter() - start, 1)
        self.cross = load_checkpoint(cross_dir or bundle.model_dir("cross"), device, expect="cross")
        self.torch = torch

    def __call__(self, context: list[str], n_r: int) -> tuple[int, dict[str, float]]:
        t0 = time.perf_counter()
        query = self.encode(context)  # each encoder runs without autograd itself
        t1 = time.perf_counter()
        _, ids = self.index.search(query.astype("float32"), n_r + len(context))
        said = {normalize(u) for u in context}
        ids = [int(i) for i in ids[0] if i >= 0 and self.bundle.keys[i] not in said][:n_r]
        t2 = time.perf_counter()
        texts = [self.bundle.texts[i] for i in ids]
        with self.torch.inference_mode():  # one padded batch per request, as a team would write it
            batch = self.cross.tokenizer.pairs([context] * len(texts), texts).to(self.cross.device)
            scores = self.cross(batch).float().cpu().numpy()
        t3 = time.perf_counter()
        stages = {"encode": 1000 * (t1 - t0), "search": 1000 * (t2 - t1), "rerank": 1000 * (t3 - t2)}
        return ids[int(np.argmax(scores))], stages


def run_peer(peer: Peer, contexts: list[list[str]], n_r: int, think_ms: float = 0) -> dict:
    latencies, stages, tops = [], [], []
    for context in contexts:
        time.sleep(think_ms / 1000)
        start = time.perf_counter()
        top, stage = peer(context, n_r)
        latencies.append(1000 * (time.perf_counter() - start))
        stages.append(stage)
        tops.append(top)
    mean_stage = {k: round(float(np.mean([s[k] for s in stages])), 1) for k in stages[0]}
    return {
        "latency_ms": percentiles(latencies),
        "rps": round(1000 / np.mean(latencies), 1),
        "stages_ms": mean_stage,
        "top1": tops,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True, help="for the peer: a bundle with a reranker")
    p.add_argument("--n-r", type=int, nargs="+", default=[10, 20, 50, 100])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=60, help="requests per cell (distinct test contexts)")
    p.add_argument("--threads", type=int, default=0, help="server intra-op threads (0 = its own measurement)")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument(
        "--peer-cross",
        default=None,
        help="the peer's reranker checkpoint (default: the bundle's own), e.g. the 6-layer reranker that "
        "a smaller served one replaces",
    )
    p.add_argument(
        "--peer-pool",
        default="bundle",
        choices=["bundle", "own"],
        help="what the peer searches: the bundle's index (coreply's vectors), or its own: the pool "
        "encoded at start by its retriever in PyTorch fp32 into an exact FAISS index, as a team would",
    )
    p.add_argument(
        "--fusion",
        default="rerank",
        choices=["rerank", "retrieval", "default"],
        help="retrieval: time recall only (bundles without a reranker, e.g. the default); no peer. "
        "default: name no fusion, so the bundle's own answers, behind its rerank gate",
    )
    p.add_argument(
        "--think-ms",
        type=float,
        default=0,
        help="each client's pause after an answer, as a user reads and types (the peer's too); "
        "requests/s then counts the pauses",
    )
    p.add_argument(
        "--typed-user-turns",
        action="store_true",
        help="send the user's turns as text the pool does not hold verbatim, as a deployed service sees "
        "them (the same answers; see typed_user_turns), the peer's too",
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    refuse_below(args, requests=1, threads=0)
    if min(args.n_r + args.concurrency) < 1:
        raise SystemExit(f"--n-r, --concurrency: each at least 1, got {args.n_r} and {args.concurrency}")
    if not 0 <= args.think_ms < float("inf"):  # NaN too
        raise SystemExit(f"--think-ms must be a number of milliseconds >= 0, got {args.think_ms}")
    if args.fusion == "retrieval":
        args.no_peer = True

    from coreply.corpus import load_chitchat

    pairs = load_chitchat()["test"][: args.requests]
    contexts = [list(pair.context) for pair in pairs]
    if args.typed_user_turns:
        contexts = [typed_user_turns(context) for context in contexts]
    golds = [normalize(pair.response) for pair in pairs]
    warm = contexts[:5]
    from coreply.bundle import BundleError, read_manifest, read_responses

    try:
        manifest = read_manifest(Path(args.bundle), verify=False)  # the server checks its hashes
    except BundleError as exc:
        raise SystemExit(f"--bundle: {exc}") from None
    if args.fusion == "rerank" and manifest["models"].get("cross") is None:
        raise SystemExit("--fusion rerank: this bundle has no reranker; give --fusion retrieval or default")
    peer = None if args.no_peer else Peer(args.bundle, args.peer_cross, args.peer_pool == "own")
    keys = [normalize(t) for t in read_responses(Path(args.bundle) / "responses.jsonl")[0]]
    server = Server(args.bundle, args.threads)
    rows = []
    try:
        ready = httpx.get(server.url + "/readyz").json()
        for n_r in args.n_r:
            asyncio.run(load(server.url, warm, n_r, 1, args.fusion))  # warm the path for this n_r
            if peer is not None:
                run_peer(peer, warm, n_r)
            for concurrency in args.concurrency:
                ours = asyncio.run(load(server.url, contexts, n_r, concurrency, args.fusion, args.think_ms))
                row = {"n_r": n_r, "concurrency": concurrency, "coreply": ours}
                if peer is not None and concurrency == 1:  # the naive script serves one request at a time
                    theirs = run_peer(peer, contexts, n_r, args.think_ms)
                    row["peer"] = theirs
                    hit = {
                        side: np.array([keys[t] == g for t, g in zip(res["top1"], golds, strict=True)], float)
                        for side, res in (("coreply", ours), ("peer", theirs))
                    }
                    row["hits@1"] = {side: round(100 * float(h.mean()), 2) for side, h in hit.items()}
                    row["p_coreply_better"] = round(paired_bootstrap(hit["coreply"], hit["peer"]), 4)
                    row["same_top1"] = round(
                        float(np.mean([a == b for a, b in zip(ours["top1"], theirs["top1"], strict=True)])), 3
                    )
                    row["p50_speedup"] = round(theirs["latency_ms"]["p50"] / ours["latency_ms"]["p50"], 2)
                rows.append(row)
                print(
                    json.dumps(
                        {k: v for k, v in row.items() if k not in ("coreply", "peer")}
                        | {
                            "ours_ms": ours["latency_ms"],
                            "ours_rps": ours["rps"],
                            "peer_ms": row.get("peer", {}).get("latency_ms"),
                        }
                    ),
                    flush=True,
                )
    except httpx.TransportError as exc:  # a refused or cut connection: say whether the server is gone
        try:  # a dying process closes its sockets before it can be reaped: give it a moment
            code = server.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None  # still running
        said = f"coreply serve exited ({code})" if code is not None else f"POST /respond failed ({exc!r})"
        said += f" after {len(rows)} of {len(args.n_r) * len(args.concurrency)} cells"
        raise SystemExit(f"bench: {said}; {args.out} not written") from None
    finally:
        server.stop()
    for row in rows:
        for side in ("coreply", "peer"):
            row.get(side, {}).pop("top1", None)
    result = {**provenance(), "bundle": ready, "peer_cross": args.peer_cross, "think_ms": args.think_ms,
              "typed_user_turns": args.typed_user_turns, "peer_pool": args.peer_pool,
              "peer_pool_encode_s": peer.pool_encode_s if peer else None, "rows": rows}  # fmt: skip
    write_json_atomic(args.out, result, sort_keys=False)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
