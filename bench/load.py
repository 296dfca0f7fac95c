"""Open-loop overload test: requests arrive at a fixed rate (a multiple of the measured capacity) for a
fixed time, whatever the server's answers, as a spiking front-end would send them. Reports every status
code, the shed count (503), and latency of the admitted (200) requests. Loopback only.

    python bench/load.py --bundle artifacts/default-bundle --factor 3 --seconds 60 --out docs/load-cpu.json

Capacity is measured first with one closed-loop client (requests/s at concurrency 1) sending the same
request, unless --rps gives the rate directly. The load-adaptive cascade is off unless --cascade is
given; with it, the answers it degraded are counted by level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import httpx

from bench import (  # bench/bench.py: this script's directory is on sys.path
    Server,
    load,
    percentiles,
    provenance,
    refuse_below,
    respond_body,
)
from coreply.artifacts import write_json_atomic


async def open_loop(
    url: str, contexts: list[list[str]], rps: float, seconds: float, n_r: int, fusion: str
) -> dict:
    """Send one request every 1/rps seconds for ``seconds``; wait for all of them."""
    codes: Counter[str] = Counter()
    degraded: Counter[str] = Counter()
    admitted_ms: list[float] = []

    async def one(client: httpx.AsyncClient, context: list[str]) -> None:
        start = time.perf_counter()
        try:
            r = await client.post(url + "/respond", json=respond_body(context, n_r, fusion))
            codes[str(r.status_code)] += 1
            if r.status_code == 200:
                admitted_ms.append(1000 * (time.perf_counter() - start))
                level = (r.json().get("degraded") or {}).get("level", 0)
                degraded[f"level_{level}"] += 1
        except httpx.HTTPError as exc:
            codes[type(exc).__name__] += 1

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        tasks, begin, i = [], time.perf_counter(), 0
        while (now := time.perf_counter()) - begin < seconds:
            due = begin + i / rps
            if now < due:
                await asyncio.sleep(due - now)
            tasks.append(asyncio.create_task(one(client, contexts[i % len(contexts)])))
            i += 1
        sent_s = time.perf_counter() - begin
        await asyncio.gather(*tasks)
    return {
        "sent": i,
        "sent_rps": round(i / sent_s, 1),
        "codes": dict(codes),
        "shed_503": codes.get("503", 0),
        "admitted_by_cascade_level": dict(sorted(degraded.items())),
        "admitted_latency_ms": percentiles(admitted_ms) if admitted_ms else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True)
    p.add_argument("--factor", type=float, default=3.0, help="offered load as a multiple of capacity")
    p.add_argument("--rps", type=float, default=None, help="offered requests/s (skips the capacity run)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--queue-max", type=int, default=256, help="COREPLY_QUEUE_MAX for the server")
    p.add_argument("--n-r", type=int, default=10, help="n_candidates of every request")
    p.add_argument(
        "--fusion",
        default="retrieval",
        choices=["retrieval", "rerank", "sum", "zscore", "default"],
        help="fusion of every request (default: none named, the bundle's own answers)",
    )
    p.add_argument("--cascade", action="store_true", help="leave the load-adaptive cascade on")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    refuse_below(args, factor=0.01, seconds=1, queue_max=1, n_r=1)
    if args.rps is not None:
        refuse_below(args, rps=0.01)

    from coreply.corpus import load_chitchat

    contexts = [list(pair.context) for pair in load_chitchat()["test"][:200]]
    env = {"COREPLY_QUEUE_MAX": str(args.queue_max), "COREPLY_CASCADE": str(args.cascade).lower()}
    server = Server(args.bundle, threads=0, env=env)
    try:
        asyncio.run(load(server.url, contexts[:10], args.n_r, 1, args.fusion))  # warm-up
        capacity = None
        if args.rps is None:
            capacity = asyncio.run(load(server.url, contexts[:100], args.n_r, 1, args.fusion))["rps"]
        rps = args.rps or args.factor * capacity
        result = asyncio.run(open_loop(server.url, contexts, rps, args.seconds, args.n_r, args.fusion))
        ready = httpx.get(server.url + "/readyz").json()
    finally:
        server.stop()
    report = {
        **provenance(),
        "bundle": ready,
        "capacity_rps_one_client": capacity,
        "offered_rps": round(rps, 1),
        "seconds": args.seconds,
        "queue_max": args.queue_max,
        "request": {"n_candidates": args.n_r, "fusion": args.fusion},
        "cascade": args.cascade,
        **result,
    }
    write_json_atomic(args.out, report, sort_keys=False)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
