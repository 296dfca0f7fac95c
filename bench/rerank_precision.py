"""Does int8 cost the reranker what it learned? A bundle's reranker in fp32 and in each int8 variant of
ONNX Runtime's dynamic quantisation (coreply.inference.INT8_VARIANTS), on the same candidates: the
bundle's first stage as served (guard on, its own lexical stage and prior) recalls 10 per context once,
every variant scores those same pairs, and each fusion orders them. ``torch`` and ``torch-bf16`` are
the checkpoint itself in PyTorch, fp32 or cast to bf16 (``coreply serve --backend torch-bf16``);
``torch-int8`` is PyTorch's own dynamic int8 quantisation of its linear layers (not served:
docs/performance.md §18).
``--keep-fp32 REGEX ...`` adds, per pattern, the served variant with the matrix products whose ONNX node
name matches left in fp32 (e.g. ``layer\\.5/`` the last layer, ``/output/dense`` the feed-forward
outputs): which ones lose most. ``--smooth ALPHA ...`` adds, per alpha, that variant of a copy whose
products' inputs are smoothed first on pairs of the bundle's pool (coreply.smoothing; what an int8
bundle serves since recipe 13, at its ALPHA: docs/results.md §53). The variants named in ``--variants``
are quantised without smoothing.

Per variant: how close its scores are to fp32's (Pearson r over all pairs; % of lists whose reranked
top-1 is fp32's), the milliseconds to score one context's 10 pairs (each pair run alone, as served), and
hits@1 of the gold under each fusion (``rerank``: the reranker's order; ``sum``; ``zscore`` at each
``--weights``; the bundle's own behind its rerank gate, where it has one), with wins, losses and a
one-sided paired bootstrap p against the first stage's order. The first stage's own hits@1 is the
``retrieval`` row.

    python bench/rerank_precision.py --bundle artifacts/cand-hard-nolex --split test --limit 2000 \\
        --out docs/rerank-precision-hard-nolex-test.json
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch

from bench import (  # bench/bench.py: this script's directory is on sys.path
    add_pairs_args,
    chosen_pairs,
    onnx_reranker,
    provenance,
)
from coreply.artifacts import write_json_atomic
from coreply.checkpoint import load_checkpoint
from coreply.gate import confident
from coreply.inference import (
    INT8,
    INT8_VARIANTS,
    TorchBackend,
    export_reranker,
    quantize_graph,
)
from coreply.smoothing import calibration_pairs, smoothed
from coreply.text import normalize
from evaluation.metrics import paired_bootstrap
from evaluation.protocols import Retrieved, ranks_for, rerank, retrieve_and_rerank

N_R = 10
TORCH = ("torch", "torch-bf16", "torch-int8")
VARIANTS = ("fp32", *INT8_VARIANTS, *TORCH)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle", help="a bundle with a reranker")
    add_pairs_args(p, "test", 0, 2000)
    p.add_argument("--variants", nargs="+", default=["fp32", INT8], help="ONNX fp32, int8 variants, torch*")
    p.add_argument("--keep-fp32", nargs="+", default=[], metavar="REGEX", help="the served int8, these fp32")
    p.add_argument(
        "--smooth",
        type=float,
        nargs="+",
        default=[],
        metavar="ALPHA",
        help="the served int8, smoothed at ALPHA",
    )
    p.add_argument("--weights", type=float, nargs="+", default=[0.3, 0.4, 0.5, 0.6], help="z-score weights")
    args = p.parse_args()
    if bad := [v for v in args.variants if v not in VARIANTS]:
        raise SystemExit(f"--variants: each one of {', '.join(VARIANTS)}, got {' '.join(bad)}")
    if bad_w := [w for w in args.weights if not 0 <= w <= 1]:
        raise SystemExit(f"--weights: each between 0 and 1, got {bad_w}")
    if bad_a := [a for a in args.smooth if not 0 <= a <= 1]:
        raise SystemExit(f"--smooth: each between 0 and 1, got {bad_a}")
    try:
        keep = [re.compile(k) for k in args.keep_fp32]
    except re.error as exc:
        raise SystemExit(f"--keep-fp32: not a regular expression ({exc})") from None
    pairs = chosen_pairs(args)
    bot = onnx_reranker(args.bundle)
    backend, ranking = bot.backend, bot.pipeline

    in_pool = set(ranking.keys)
    gold_in_pool = float(np.mean([normalize(p.response) in in_pool for p in pairs]))

    def hits_at_1(got: Retrieved, fusion: str, w: float = 0.0, gate: float | None = None) -> np.ndarray:
        """[N] 1.0 where the gold is the first answer under ``fusion`` of the first N_R (gated)."""
        return (np.array(ranks_for(pairs, ranking.keys, got, fusion, N_R, w, gate)) == 1).astype(float)

    reranked: dict[str, Retrieved] = {}
    scores: dict[str, np.ndarray] = {}  # variant -> [N, N_R] rerank scores, NaN past a short list
    with tempfile.TemporaryDirectory() as tmp:
        bi = load_checkpoint(bot.bundle.model_dir("bi"), "cpu", expect="bi")
        cross = load_checkpoint(bot.bundle.model_dir("cross"), "cpu", expect="cross")
        fp32 = Path(tmp) / "cross.onnx"
        export_reranker(cross, fp32, "fp32")  # type: ignore[arg-type]
        products = [n.name for n in onnx.load(fp32).graph.node if n.op_type in ("MatMul", "Gemm")]
        # variant -> None (fp32 or PyTorch) or (the fp32 graph, the int8 variant, nodes left fp32)
        variants = {v: None if v in ("fp32", *TORCH) else (fp32, v, []) for v in args.variants}
        for k in keep:
            if not (nodes := [n for n in products if k.search(n)]):
                raise SystemExit(f"--keep-fp32 {k.pattern}: matches no matrix product in the reranker")
            variants[f"{INT8}, fp32: {k.pattern}"] = (fp32, INT8, nodes)
        calibration = calibration_pairs(ranking.texts)
        for alpha in args.smooth:  # its own fp32 graph, from the smoothed copy
            out = Path(tmp) / f"smoothed-{alpha}.onnx"
            export_reranker(smoothed(cross, *calibration, alpha), out, "fp32")  # type: ignore[arg-type]
            variants[f"{INT8}, smoothed {alpha}"] = (out, INT8, [])

        recalled = retrieve_and_rerank(pairs, ranking, N_R, 0)
        print(f"{len(pairs)} contexts recalled", flush=True)
        for variant, how in variants.items():
            if variant in TORCH:  # a fresh copy: bf16 casts the model in place
                model = load_checkpoint(bot.bundle.model_dir("cross"), "cpu", expect="cross")
                if variant == "torch-int8":  # PyTorch's own dynamic int8 (the quantised engine's kernels)
                    model = torch.ao.quantization.quantize_dynamic(
                        model, {torch.nn.Linear}, dtype=torch.qint8
                    )
                torch_backend = TorchBackend(bi, model, bf16=variant == "torch-bf16")  # type: ignore[arg-type]
                ranking.score_pairs = torch_backend.score_pairs
            else:
                path = fp32 if how is None else Path(tmp) / f"variant-{len(scores)}.onnx"
                if how is not None:
                    source, int8, nodes = how
                    quantize_graph(source, path, int8, nodes)
                backend.cross = backend.cross_session(path)
                ranking.score_pairs = backend.score_pairs
            got = reranked[variant] = rerank(pairs, recalled, ranking, N_R)
            scores[variant] = np.full((len(pairs), N_R), np.nan)
            for i, c in enumerate(got.candidates):
                scores[variant][i, : len(c.rerank)] = c.rerank  # type: ignore[arg-type]
            print(f"{variant}: {1000 * got.rerank_s / len(pairs):.0f} ms a context", flush=True)

    base = hits_at_1(recalled, "retrieval")
    rows: dict[str, dict] = {
        "retrieval": {
            "hits@1": round(100 * float(base.mean()), 2),
            "top1_cases": np.flatnonzero(base).tolist(),
        }
    }
    weights = sorted({*args.weights, ranking.weight})  # and the bundle's calibrated one
    fusions = [("rerank", 0.0, None), ("sum", 0.0, None), *[("zscore", w, None) for w in weights]]
    if ranking.gate is not None:  # the bundle's default fusion behind its rerank gate, as served
        fusions.append((bot.default_fusion, ranking.weight, ranking.gate))
    ref = scores.get("fp32")
    for variant, got in reranked.items():
        row: dict = {"ms_per_context": round(1000 * got.rerank_s / len(pairs), 1)}
        if ref is not None:  # how close to fp32
            mine = scores[variant]
            ok = ~np.isnan(mine) & ~np.isnan(ref)
            lists = [(a, b) for a, b in zip(mine, ref, strict=True) if not np.isnan(a).all()]  # not empty
            same = [np.nanargmax(a) == np.nanargmax(b) for a, b in lists]
            row["pearson_with_fp32"] = round(float(np.corrcoef(mine[ok], ref[ok])[0, 1]), 4)
            row["top1_as_fp32_%"] = round(100 * float(np.mean(same)), 2)
        for fusion, w, gate in fusions:
            hit = hits_at_1(got, fusion, w, gate)
            name = fusion if fusion != "zscore" else f"zscore {w}"
            name += "" if gate is None else ", gated"
            row[name] = {
                "hits@1": round(100 * float(hit.mean()), 2),
                "wins": int(((hit == 1) & (base == 0)).sum()),
                "losses": int(((hit == 0) & (base == 1)).sum()),
                "p_gains": round(paired_bootstrap(hit, base), 4),
                "top1_cases": np.flatnonzero(hit).tolist(),  # to pair with other runs
            }
        rows[variant] = row
        line = [f"{k} {v['hits@1']} (+{v['wins']} -{v['losses']})" for k, v in row.items() if type(v) is dict]
        print(variant, f"retrieval {rows['retrieval']['hits@1']}", *line, sep="; ", flush=True)
    result = provenance() | {
        "bundle": args.bundle,
        "pairs": f"{args.split}[{args.start}:{args.start + len(pairs)}]",
        "first_stage": {"lexical": bot.bundle.manifest.get("lexical"), "guard": "on"},
        "served_weight": ranking.weight,
        "gate": {
            "margin": ranking.gate,
            "skipped_%": round(
                100 * float(np.mean([confident(c, ranking.gate) for c in recalled.candidates])), 2
            ),
        },
        "gold_in_pool_%": round(100 * gold_in_pool, 2),
        "rows": rows,
    }
    if args.out:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
