"""Which int8 quantisation of the retriever's ONNX graphs keeps its ranking: each variant against the
fp32 graphs, on the same contexts and the same sub-pool, through ``OnnxBackend`` as the service runs it.

A sub-pool (every gold of the first ``--limit`` pairs plus a random sample of the rest of the full pool,
``--pool`` in all) keeps one variant to a few minutes of encoding on one core; the winner is then
measured over the full pool as served (``bench/restatement_guard.py``). Per variant: hits@1 / hits@10
of the gold (echoes of a context's turns dropped, as served), how often its top answer is fp32's, the
mean cosine of its vectors with fp32's (contexts, responses), file sizes, the milliseconds to encode
one context, and a one-sided paired bootstrap p that fp32 ranks better.

    python bench/quantisation.py --bi coreply/weights/default-bi --split test --limit 2000 --pool 20000 \\
        --out docs/quantisation-default-bi.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import refuse_below  # bench/bench.py: this script's directory is on sys.path
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_bi
from coreply.corpus import build_pool, load_chitchat, responses_of
from coreply.inference import INT8_VARIANTS, ONNX_FILES, OnnxBackend, export_onnx, quantize_graph
from coreply.ranking import Query
from coreply.text import normalize
from evaluation.metrics import paired_bootstrap


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bi", default="coreply/weights/default-bi", help="retriever checkpoint")
    p.add_argument("--split", default="test", choices=["valid", "test"])
    p.add_argument("--limit", type=int, default=2000, help="first N pairs of the split")
    p.add_argument("--pool", type=int, default=20_000, help="sub-pool size (golds + a random sample)")
    p.add_argument("--variants", nargs="+", default=list(INT8_VARIANTS), choices=list(INT8_VARIANTS))
    p.add_argument("--single", type=int, default=200, help="contexts timed one at a time")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = p.parse_args()
    refuse_below(args, limit=1, single=1)

    splits = load_chitchat()
    pairs = splits[args.split][: args.limit]
    full = build_pool(responses_of(splits))
    golds = build_pool(p.response for p in pairs)
    gold_keys = {normalize(t) for t in golds}
    rest = [t for t in full if normalize(t) not in gold_keys]
    if args.pool <= len(golds) or args.pool > len(golds) + len(rest):
        raise SystemExit(f"--pool: give a size between {len(golds) + 1} and {len(golds) + len(rest)}")
    rng = np.random.default_rng(0)
    pool = golds + [rest[i] for i in rng.choice(len(rest), args.pool - len(golds), replace=False)]
    keys = [normalize(t) for t in pool]
    position = {key: i for i, key in enumerate(keys)}  # the pool is de-duplicated by normalised text
    gold = np.array([position[normalize(p.response)] for p in pairs])
    contexts = [p.context for p in pairs]
    queries = [Query(tuple(c)) for c in contexts]  # to drop echoes of a context's turns, as served

    bi = load_bi(args.bi)
    result: dict = {"variants": {}}
    reference: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        fp32_dir = Path(tmp) / "fp32"
        export_onnx(bi, None, fp32_dir, "fp32")
        for name in ["fp32", *args.variants]:
            onnx_dir = fp32_dir
            if name != "fp32":
                onnx_dir = Path(tmp) / name
                onnx_dir.mkdir()
                for graph in ("context", "response"):
                    quantize_graph(fp32_dir / ONNX_FILES[graph], onnx_dir / ONNX_FILES[graph], name)
            backend = OnnxBackend(onnx_dir, bi.tokenizer, None, bi.dim)
            ctx, resp = backend.encode_contexts(contexts), backend.encode_responses(pool)
            one = []
            for c in contexts[: args.single]:
                start = time.perf_counter()
                backend.encode_contexts([c])
                one.append(1000 * (time.perf_counter() - start))
            top = np.array(
                [
                    ids[query.keep(ids, keys)][:10]
                    for ids, query in zip(_best(ctx @ resp.T, 20), queries, strict=True)
                ]
            )  # [N, 10]
            top1 = (top[:, 0] == gold).astype(float)
            if name == "fp32":
                reference = {"ctx": ctx, "resp": resp, "top": top[:, 0], "top1": top1}
            row = {
                "hits@1": round(100 * float(top1.mean()), 2),
                "hits@10": round(100 * float((top == gold[:, None]).any(axis=1).mean()), 2),
                "top1_as_fp32": round(100 * float((top[:, 0] == reference["top"]).mean()), 2),
                "cosine_contexts": round(float(_cosines(ctx, reference["ctx"]).mean()), 5),
                "cosine_responses": round(float(_cosines(resp, reference["resp"]).mean()), 5),
                "p_fp32_ranks_better": round(paired_bootstrap(reference["top1"], top1), 4),
                "ms_one_context_p50": round(float(np.median(one)), 2),
                "megabytes": round(sum(f.stat().st_size for f in onnx_dir.glob("*.onnx")) / 2**20, 1),
            }
            result["variants"][name] = row
            print(name, row, flush=True)
    result["meta"] = {
        "bi": args.bi,
        "bi_hash": bi.content_hash,
        "split": args.split,
        "pairs": len(pairs),
        "pool": len(pool),
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.system()}",
    }
    if args.out:
        write_json_atomic(Path(args.out), result, sort_keys=False)


def _best(scores: np.ndarray, k: int) -> np.ndarray:
    """[N, P] -> [N, k] column ids of each row's k highest scores, best first"""
    top = np.argpartition(-scores, k, axis=1)[:, :k]
    return np.take_along_axis(top, np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1), axis=1)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[N, D] x2 -> [N] row-wise cosine"""
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)


if __name__ == "__main__":
    main()
