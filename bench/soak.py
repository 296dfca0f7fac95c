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
from coreply.artifacts import write_json_atomic


def rss_mb(pid: int) -> float | None:
    """The process's resident memory in MB; None once it has exited."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except FileNotFoundError:
        return None
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("VmRSS:")), None)


def change(first: float | None, last: float | None) -> float | None:
    return None if first is None or last is None else round(last - first, 1)


async def soak(server: Server, contexts: list[list[str]], minutes: float, window_s: float, clients: int):
    windows: list[dict] = []
    latencies: list[float] = []
    errors = 0
    stop = time.monotonic() + 60 * minutes

    def going() -> bool:  # a server that exits ends the run early: its windows and errors are the result
        return time.monotonic() < stop and server.process.poll() is None

    async def client_loop(client: httpx.AsyncClient, offset: int) -> None:
        nonlocal errors
        i = offset
        while going():
            start = time.perf_counter()
            try:
                r = await client.post(server.url + "/respond", json={"context": contexts[i % len(contexts)]})
                ok = r.status_code == 200
            except httpx.HTTPError:  # refused, reset or timed out: counted, and the run goes on
                ok = False
            if ok:
                latencies.append(1000 * (time.perf_counter() - start))
            else:
                errors += 1
            i += clients

    async def sampler() -> None:
        begin = time.monotonic()
        while going():
            await asyncio.sleep(window_s)
            batch = latencies[:]
            latencies.clear()
            windows.append(
                {
                    "t_s": round(time.monotonic() - begin),
                    "rss_mb": None if (rss := rss_mb(server.process.pid)) is None else round(rss, 1),
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
        exited = server.process.poll()
    finally:
        server.stop()
    if not windows:
        raise SystemExit(f"coreply serve exited ({exited}) before the first --window-s window ended")
    first, last = windows[0], windows[-1]
    p50 = [w["latency_ms"]["p50"] if w["latency_ms"] else None for w in (first, last)]
    report = {
        **provenance(),
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "rss_mb_ready": round(start_rss, 1),
        "rss_growth_mb_first_to_last_window": change(first["rss_mb"], last["rss_mb"]),
        "p50_drift_ms_first_to_last_window": change(*p50),
        "errors": last["errors_so_far"],
        "server_exit_code": exited,  # None: it served to the end
        "windows": windows,
    }
    write_json_atomic(args.out, report, sort_keys=False)
    print(json.dumps({k: v for k, v in report.items() if k != "windows"}, indent=2))
    if exited is not None:
        raise SystemExit(f"coreply serve exited ({exited}) after {last['t_s']} s; see {args.out}")


if __name__ == "__main__":
    main()
