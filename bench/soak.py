"""Soak: steady load on the real server for a long time; reports resident memory growth and latency
drift per window. Loopback only; `make soak` runs it for an hour (not in CI).

    python bench/soak.py --bundle artifacts/default-bundle --minutes 60 --out docs/soak-cpu.json

Load: ``--concurrency`` closed-loop clients sending chitchat test contexts (``fusion`` as the bundle's
default), which keeps the server busy without queueing without bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx

from bench import (  # bench/bench.py: this script's directory is on sys.path
    Server,
    percentiles,
    provenance,
    refuse_below,
)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def soak(server: Server, contexts: list[list[str]], minutes: float, window_s: float, clients: int):
    windows: list[dict] = []
    latencies: list[float] = []
    errors = 0
    stop = time.monotonic() + 60 * minutes

    async def client_loop(client: httpx.AsyncClient, offset: int) -> None:
        nonlocal errors
        i = offset
        while time.monotonic() < stop:
            start = time.perf_counter()
            r = await client.post(server.url + "/respond", json={"context": contexts[i % len(contexts)]})
            if r.status_code == 200:
                latencies.append(1000 * (time.perf_counter() - start))
            else:
                errors += 1
            i += clients

    async def sampler() -> None:
        begin = time.monotonic()
        while time.monotonic() < stop:
            await asyncio.sleep(window_s)
            batch = latencies[:]
            latencies.clear()
            windows.append(
                {
                    "t_s": round(time.monotonic() - begin),
                    "rss_mb": round(rss_mb(server.process.pid), 1),
                    "requests": len(batch),
                    "latency_ms": percentiles(batch) if batch else None,
                    "errors_so_far": errors,
                }
            )
            print(json.dumps(windows[-1]), flush=True)

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(sampler(), *(client_loop(client, k) for k in range(clients)))
    return windows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    refuse_below(args, window_s=1, concurrency=1)
    if not args.minutes * 60 >= args.window_s:
        raise SystemExit(f"--minutes {args.minutes}: shorter than one --window-s window; give a longer run")

    from coreply.corpus import load_chitchat

    contexts = [list(pair.context) for pair in load_chitchat()["test"][:1000]]
    server = Server(args.bundle, threads=0)
    try:
        start_rss = rss_mb(server.process.pid)
        windows = asyncio.run(soak(server, contexts, args.minutes, args.window_s, args.concurrency))
    finally:
        server.stop()
    first, last = windows[0], windows[-1]
    report = {
        **provenance(),
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "rss_mb_ready": round(start_rss, 1),
        "rss_growth_mb_first_to_last_window": round(last["rss_mb"] - first["rss_mb"], 1),
        "p50_drift_ms_first_to_last_window": round(last["latency_ms"]["p50"] - first["latency_ms"]["p50"], 1),
        "errors": last["errors_so_far"],
        "windows": windows,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "windows"}, indent=2))


if __name__ == "__main__":
    main()
