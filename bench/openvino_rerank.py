"""Would OpenVINO run the CPU reranker faster than the served ONNX Runtime int8 graph? A bundle's reranker
on the pairs a request reranks (the first chitchat test contexts and their n_r recalled candidates),
round by round: ONNX Runtime int8 as served (each pair alone, spread over the threads); OpenVINO on the
reranker's fp32 graph in bf16 (its default where the CPU has bf16 instructions) and in fp32; OpenVINO on
the served int8 graph. OpenVINO runs each request's length-sorted batches on all threads. Every variant
is compared with the PyTorch fp32 reranker's scores on the same pairs.

OpenVINO is not a coreply dependency: ``pip install openvino`` first (docs/performance.md §44).

    python bench/openvino_rerank.py --bundle artifacts/default-bundle --n-r 10 --requests 40
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench import onnx_rerank_requests  # bench/bench.py: this script's directory is on sys.path
from coreply.bundle import make_backend
from coreply.inference import ONNX_FILES, export_reranker
from coreply.tokenization import Batch, DialogueTokenizer, score_by_tokens

Scorer = Callable[[Sequence[Sequence[str]], Sequence[str]], np.ndarray]


def openvino_scorer(path: Path, precision: str, threads: int, tok: DialogueTokenizer) -> Scorer:
    """A scorer running the graph at ``path`` in OpenVINO, one request's batches at a time."""
    import openvino as ov

    config = {"INFERENCE_PRECISION_HINT": precision, "INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1}
    compiled = ov.Core().compile_model(str(path), "CPU", config)
    request, names = compiled.create_infer_request(), [i.get_any_name() for i in compiled.inputs]

    def run(batch: Batch) -> np.ndarray:  # [N] scores of a right-padded batch
        outputs = request.infer({name: getattr(batch, name).numpy() for name in names})
        return np.array(outputs[compiled.outputs[0]]).reshape(-1)

    return lambda contexts, responses: score_by_tokens(tok, contexts, responses, 4096, run)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", required=True, help="a bundle with a reranker and an ONNX export")
    p.add_argument("--n-r", type=int, default=10, help="candidates reranked per request")
    p.add_argument("--requests", type=int, default=40, help="test contexts (one request each)")
    p.add_argument("--threads", type=int, default=2, help="threads each runtime uses")
    p.add_argument("--rounds", type=int, default=3, help="timed passes over the requests (median kept)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args()
    if min(args.n_r, args.requests, args.threads, args.rounds) < 1:
        raise SystemExit("--n-r, --requests, --threads and --rounds must be >= 1")
    try:
        import openvino as ov
    except ImportError:
        raise SystemExit("openvino is not installed: pip install openvino, then run this again") from None
    bundle, served, requests = onnx_rerank_requests(args.bundle, args.threads, args.n_r, args.requests)
    tok = served.cross_tokenizer
    tokens = np.mean([len(row) for c, r in requests for row, _ in tok.pair_rows(c, r)])
    print(
        f"{len(requests)} requests x {args.n_r} pairs, {tokens:.1f} tokens a pair; OpenVINO {ov.__version__}"
    )

    fp32_model = make_backend(bundle, "torch", threads=args.threads)
    reference = np.concatenate([fp32_model.score_pairs(c, r) for c, r in requests])
    capabilities = ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    with tempfile.TemporaryDirectory() as tmp:
        fp32_graph = Path(tmp) / "cross.onnx"
        export_reranker(fp32_model.cross, fp32_graph, "fp32")  # type: ignore[arg-type]
        variants: dict[str, Scorer] = {"ONNX Runtime int8 (served)": served.score_pairs}
        if "BF16" in capabilities:
            variants["PyTorch bf16 (torch-bf16)"] = make_backend(
                bundle, "torch-bf16", threads=args.threads
            ).score_pairs
            variants["OpenVINO bf16, fp32 graph"] = openvino_scorer(fp32_graph, "bf16", args.threads, tok)
        variants["OpenVINO fp32, fp32 graph"] = openvino_scorer(fp32_graph, "f32", args.threads, tok)
        int8_graph = bundle.root / "onnx" / ONNX_FILES["cross"]
        variants["OpenVINO, served int8 graph"] = openvino_scorer(int8_graph, "f32", args.threads, tok)

        rounds: dict[str, list[float]] = {name: [] for name in variants}
        scores: dict[str, np.ndarray] = {}
        for _ in range(args.rounds):  # variants alternate, so the host's drift reaches each alike
            for name, score in variants.items():
                start = time.perf_counter()
                scores[name] = np.concatenate([score(c, r) for c, r in requests])
                rounds[name].append(1000 * (time.perf_counter() - start) / len(requests))

    split = np.cumsum([len(r) for _, r in requests])[:-1]
    tops = lambda s: [int(np.argmax(x)) for x in np.split(s, split)]  # noqa: E731
    results = {}
    print("| reranker | ms a request (median / min) | Pearson r with fp32 | max abs diff | top-1 as fp32's |")
    print("|---|---|---|---|---|")
    for name, ms in rounds.items():
        same = sum(a == b for a, b in zip(tops(scores[name]), tops(reference), strict=True))
        results[name] = {
            "ms_median": float(np.median(ms)),
            "ms_min": min(ms),
            "pearson": float(np.corrcoef(scores[name], reference)[0, 1]),
            "max_abs_diff": float(np.abs(scores[name] - reference).max()),
            "top1_as_fp32": same / len(requests),
        }
        r = results[name]
        print(f"| {name} | {r['ms_median']:.1f} / {r['ms_min']:.1f} | {r['pearson']:.4f} | ", end="")
        print(f"{r['max_abs_diff']:.3f} | {same} of {len(requests)} |")
    if args.out:
        setup = {"n_r": args.n_r, "requests": len(requests), "threads": args.threads, "tokens_a_pair": tokens}
        args.out.write_text(
            json.dumps({"setup": setup, "openvino": ov.__version__, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
