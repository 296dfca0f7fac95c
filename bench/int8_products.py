"""How fast ONNX Runtime runs the reranker's linear layers on this CPU, one thread, per way of
quantising them: fp32; the served dynamic int8 (``coreply.inference.quantize_graph``: per-row activation
scale, per-channel 7-bit weights); and ONNX Runtime's ``MatMulNBits`` with 8- and 4-bit block weights at
``accuracy_level`` 4 (int8 arithmetic where MLAS has a kernel for it). Each at M = one pair's tokens (a
request's pairs run one at a time, as served) and M = every pair of a request packed into one matrix.

The question it answers (docs/performance.md §29): would packing a request's pairs, or ONNX Runtime's
block-quantised products, make the CPU reranker faster?

    python bench/int8_products.py --tokens 104 --pairs 10 --rounds 200
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from coreply.inference import _session, quantize_graph


def linear_graph(
    node: onnx.NodeProto, k: int, n: int, weights: list[np.ndarray], domains=("",)
) -> onnx.ModelProto:
    """A graph of ``node`` alone, from x [M, k] to y [M, n], its weights initializers named as its inputs."""
    graph = helper.make_graph(
        [node],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
        [numpy_helper.from_array(w, name) for w, name in zip(weights, node.input[1:], strict=True)],
    )
    opsets = [helper.make_opsetid(domain, 17 if domain == "" else 1) for domain in domains]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9)


def matmul_graph(w: np.ndarray) -> onnx.ModelProto:
    """y = x @ w, for x of [M, K]."""
    return linear_graph(helper.make_node("MatMul", ["x", "w"], ["y"]), *w.shape, [w])


def nbits_graph(w: np.ndarray, bits: int, block: int) -> onnx.ModelProto:
    """y = x @ w through ``com.microsoft.MatMulNBits``: w symmetric in blocks of ``block`` along K."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    k, n = w.shape
    blocks = -(-k // block)
    packed = np.zeros((n, blocks, block * bits // 8), dtype=np.uint8)
    scales = np.zeros((n, blocks), dtype=np.float32)
    zero_points = np.zeros((n, -(-blocks * bits // 8)), dtype=np.uint8)  # unused: symmetric
    quantize = quantize_matmul_8bits if bits == 8 else quantize_matmul_4bits
    quantize(packed, np.ascontiguousarray(w), scales, zero_points, block, n, k, True)
    node = helper.make_node(
        "MatMulNBits", ["x", "w_q", "w_scales"], ["y"], domain="com.microsoft",
        K=k, N=n, bits=bits, block_size=block, accuracy_level=4,
    )  # fmt: skip
    return linear_graph(node, k, n, [packed, scales.ravel()], domains=("", "com.microsoft"))


def median_ms(session, x: np.ndarray, rounds: int) -> float:
    session.run(None, {"x": x})
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=384, help="the model's width (MiniLM-L6: 384)")
    p.add_argument("--ffn", type=int, default=1536, help="the feed-forward width (MiniLM-L6: 1536)")
    p.add_argument("--tokens", type=int, default=104, help="tokens a pair (the default's test pairs: 104)")
    p.add_argument("--pairs", type=int, default=10, help="pairs a request reranks (n_r)")
    p.add_argument("--rounds", type=int, default=200, help="timed runs per product (median kept)")
    args = p.parse_args()
    for flag in ("hidden", "ffn", "tokens", "pairs", "rounds"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be >= 1")
    if args.hidden % 32:
        raise SystemExit("--hidden must be a multiple of 32 (MatMulNBits' block)")

    rng = np.random.default_rng(0)
    shapes = [(args.hidden, args.hidden), (args.hidden, args.ffn), (args.ffn, args.hidden)]
    ways = ("fp32", "int8 served", "nbits 8-bit", "nbits 4-bit")
    print(f"one thread; a request: {args.pairs} pairs of {args.tokens} tokens")
    print(f"{'K x N':>11} {'M':>6}" + "".join(f"{w:>24}" for w in ways))
    with tempfile.TemporaryDirectory() as tmp:
        for k, n in shapes:
            w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
            fp32 = Path(tmp) / "fp32.onnx"
            onnx.save(matmul_graph(w), fp32)
            quantize_graph(fp32, Path(tmp) / "int8.onnx")
            for bits in (8, 4):
                onnx.save(nbits_graph(w, bits, 32), Path(tmp) / f"nbits{bits}.onnx")
            files = ("fp32", "int8", "nbits8", "nbits4")
            sessions = [_session(Path(tmp) / f"{name}.onnx", 1, cuda=False) for name in files]
            for m in (args.tokens, args.tokens * args.pairs):
                x = rng.standard_normal((m, k)).astype(np.float32)
                exact = x @ w
                cells = []
                for session in sessions:
                    ms = median_ms(session, x, args.rounds)
                    err = np.abs(session.run(None, {"x": x})[0] - exact).max() / np.abs(exact).max()
                    cells.append(f"{ms:7.3f} ms {m * k * n / ms / 1e6:4.0f} GMAC/s {err:.3f}")
                print(f"{k:>5} x {n:<5} {m:>6}" + "".join(f"{c:>24}" for c in cells))
    print("each cell: median time, multiply-adds a second, the largest error relative to the largest output")


if __name__ == "__main__":
    main()
