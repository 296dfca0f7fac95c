"""Where the CPU reranker's time goes: a bundle's int8 ONNX cross-encoder on the pairs a request
reranks (the first chitchat test contexts and their n_r recalled candidates), timed as the service runs
it, then once more under ONNX Runtime's profiler, summed per operator type.

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

from coreply.bundle import BundleError, IndexRetriever, load_bundle, make_backend
from coreply.corpus import load_chitchat
from coreply.inference import ONNX_FILES, OnnxBackend, _session
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
    try:
        bundle = load_bundle(args.bundle)
    except BundleError as exc:
        raise SystemExit(f"--bundle: {exc}") from None
    backend = make_backend(bundle, "onnx", threads=args.threads)
    if not isinstance(backend, OnnxBackend) or backend.cross is None or backend.cross_tokenizer is None:
        raise SystemExit(f"--bundle {args.bundle}: needs a reranker exported to ONNX")
    contexts = [list(pair.context) for pair in load_chitchat()["test"][: args.requests]]
    hits = IndexRetriever(backend, bundle.index)(contexts, args.n_r)
    requests = [
        ([c] * len(row), [bundle.texts[i] for i in row if i >= 0])
        for c, row in zip(contexts, hits.ids, strict=True)
    ]
    lengths = [len(row) for c, r in requests for row, _ in backend.cross_tokenizer.pair_rows(c, r)]
    print(f"{len(requests)} requests x {args.n_r} pairs, {np.mean(lengths):.1f} tokens a pair")

    rounds = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for c, r in requests:
            backend.score_pairs(c, r)
        rounds.append(1000 * (time.perf_counter() - start) / len(requests))
    median = np.median(rounds)
    print(f"rerank ms per request ({args.threads} threads): median {median:.1f}, min {min(rounds):.1f}")

    with tempfile.TemporaryDirectory() as tmp:
        path = bundle.root / "onnx" / ONNX_FILES["cross"]
        session = _session(path, 1, cuda=False, profile=Path(tmp) / "ort")  # as the backend: a pair a thread
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
