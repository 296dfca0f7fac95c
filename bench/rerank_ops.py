"""Where the CPU reranker's time goes: a bundle's int8 ONNX cross-encoder on the pairs a request
reranks (the first chitchat test contexts and their n_r recalled candidates), timed as the service runs
it and, round by round beside it, with every fusion ONNX Runtime makes (how fast, how far apart), then
once more under ONNX Runtime's profiler, summed per operator type.

    python bench/rerank_ops.py --bundle artifacts/bench-bundle --n-r 10
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench import onnx_rerank_requests  # bench/bench.py: this script's directory is on sys.path
from coreply.inference import ONNX_FILES, _session
from coreply.tokenization import score_by_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True, help="a bundle with a reranker and an ONNX export")
    p.add_argument("--n-r", type=int, default=10, help="candidates reranked per request")
    p.add_argument("--requests", type=int, default=30, help="test contexts (one request each)")
    p.add_argument("--threads", type=int, default=2, help="threads the pairs are spread over, as served")
    p.add_argument("--rounds", type=int, default=5, help="timed passes over the requests (median kept)")
    args = p.parse_args()
    if min(args.n_r, args.requests, args.threads, args.rounds) < 1:
        raise SystemExit("--n-r, --requests, --threads and --rounds must be >= 1")
    bundle, backend, requests = onnx_rerank_requests(args.bundle, args.threads, args.n_r, args.requests)
    lengths = [len(row) for c, r in requests for row, _ in backend.cross_tokenizer.pair_rows(c, r)]
    print(f"{len(requests)} requests x {args.n_r} pairs, {np.mean(lengths):.1f} tokens a pair")

    # The served session, and beside it, round by round, the graph with every fusion ONNX Runtime makes
    # (performance.md §20: its SkipLayerNormalization is slower on the CPU than the ops it fuses).
    path = bundle.root / "onnx" / ONNX_FILES["cross"]
    sessions = {"served": backend.cross, "all fusions": _session(path, 1, cuda=False)}
    rounds: dict[str, list[float]] = {name: [] for name in sessions}
    scores = {}
    for _ in range(args.rounds):
        for name, session in sessions.items():
            backend.cross = session
            start = time.perf_counter()
            scores[name] = np.concatenate([backend.score_pairs(c, r) for c, r in requests])
            rounds[name].append(1000 * (time.perf_counter() - start) / len(requests))
    backend.cross = sessions["served"]
    for name, ms in rounds.items():
        print(f"rerank ms a request, {name} ({args.threads} threads): median {np.median(ms):.1f}", end="")
        print(f", min {min(ms):.1f}")
    split = np.cumsum([len(r) for _, r in requests])[:-1]
    top = [[int(np.argmax(x)) for x in np.split(scores[name], split)] for name in sessions]
    print(
        f"their scores differ by at most {np.abs(scores['served'] - scores['all fusions']).max():.3f}; "
        f"the same top-1 for {sum(a == b for a, b in zip(*top, strict=True))} of {len(requests)} requests"
    )

    with tempfile.TemporaryDirectory() as tmp:
        session = backend.cross_session(path, profile=Path(tmp) / "ort")  # as the backend runs it
        for c, r in requests:
            run = lambda batch: backend._run(session, batch).numpy()  # noqa: E731
            score_by_tokens(backend.cross_tokenizer, c, r, backend.max_batch_tokens, run)
        events = json.loads(Path(session.end_profiling()).read_text())
    per_op: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_op[event["args"]["op_name"]] += event["dur"]  # microseconds
    total = sum(per_op.values())
    print(f"\nunder the profiler: {total / 1000 / len(requests):.1f} ms of kernels per request")
    print("| operator | ms per request | share |\n|---|---|---|")
    for op, us in per_op.most_common(12):
        print(f"| {op} | {us / 1000 / len(requests):.2f} | {100 * us / total:.1f} % |")


if __name__ == "__main__":
    main()
