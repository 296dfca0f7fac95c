"""What an idle thread's OpenMP team costs PyTorch on a small host (docs/performance.md §11).

Times one of a MiniLM layer's matmuls (by default a context's 40 tokens through the 384 -> 1,536
feed-forward) on this thread: first while it holds the process's only OpenMP team, then while another
thread that has run parallel work is still alive (its team outlives the work), then after that thread
has ended. The cost is per parallel region, so it shows best on short ones (``--tokens 4``).

    python bench/omp_teams.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch


def time_linear(layer: torch.nn.Linear, x: torch.Tensor, rounds: int) -> float:
    """Median microseconds of ``layer(x)`` over ``rounds`` blocks of 200 calls."""
    with torch.inference_mode():
        for _ in range(50):
            layer(x)
        blocks = []
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(200):
                layer(x)
            blocks.append((time.perf_counter() - t) / 200 * 1e6)
    return round(sorted(blocks)[len(blocks) // 2], 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (each team's size)")
    p.add_argument("--rounds", type=int, default=7, help="timed blocks per measurement (median kept)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--tokens", type=int, default=40, help="rows of the input (a context's tokens)")
    args = p.parse_args()
    if min(args.threads, args.rounds, args.tokens) < 1:
        raise SystemExit("--threads, --rounds and --tokens must be >= 1")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    layer = torch.nn.Linear(384, 1536).to(dtype)
    x = torch.randn(args.tokens, 384, dtype=dtype)  # [tokens, hidden]
    result = {
        "threads": args.threads,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "only_team_us": time_linear(layer, x, args.rounds),
    }

    release = threading.Event()

    def other() -> None:  # parallel work, then idle but alive, as a loader thread kept in a pool is
        torch.set_num_threads(args.threads)
        with torch.inference_mode():
            layer(x)
        release.wait()

    helper = threading.Thread(target=other)
    helper.start()
    time.sleep(0.5)
    result["second_team_alive_us"] = time_linear(layer, x, args.rounds)
    release.set()
    helper.join()
    result["second_thread_ended_us"] = time_linear(layer, x, args.rounds)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
