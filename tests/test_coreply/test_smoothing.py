"""Activation smoothing for the reranker's int8 graph: the same function in fp32, a closer int8 graph
where a channel runs large, and the checkpoint left alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import toy_pool

from coreply.checkpoint import load_checkpoint
from coreply.smoothing import calibration_pairs, smoothed


def test_calibration_pairs_spread_over_the_pool():
    texts = [f"t{i}" for i in range(10)]
    contexts, responses = calibration_pairs(texts, n=4)
    assert contexts == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"], ["t7", "t8"]]
    assert responses == ["t2", "t4", "t6", "t9"]
    assert calibration_pairs(texts)[1] == [f"t{i}" for i in range(2, 10)]  # n past the pool: every start
    assert calibration_pairs(["a", "b"]) == ([], [])


def test_smoothed_copy_scores_as_the_model_and_leaves_it(tiny_core, toy_pairs):
    cross = load_checkpoint(tiny_core / "cross")
    before = {k: v.clone() for k, v in cross.state_dict().items()}
    contexts, responses = [p.context for p in toy_pairs[:8]], [p.response for p in toy_pairs[:8]]
    copy = smoothed(cross, *calibration_pairs(toy_pool()), alpha=0.75)
    assert copy is not cross
    np.testing.assert_allclose(
        copy.score_pairs(contexts, responses), cross.score_pairs(contexts, responses), atol=1e-4
    )
    assert all(torch.equal(before[k], v) for k, v in cross.state_dict().items())
    assert smoothed(cross, [], []) is cross  # nothing to calibrate on: as it is
    with pytest.raises(ValueError, match="alpha"):
        smoothed(cross, *calibration_pairs(toy_pool()), alpha=1.5)


def _spread(model, contexts, responses) -> list[float]:
    """Per transformer layer: the largest input channel's range over the median channel's, at the input
    of the feed-forward product (what one int8 scale per call has to cover)."""
    ranges = []
    record = lambda _module, x: ranges.append(x[0].abs().amax((0, 1)))  # noqa: E731  [N, L, C] -> [C]
    feed_forward = [
        getattr(layer.intermediate, "inner", layer.intermediate) for layer in model.backbone.encoder.layer
    ]
    hooks = [f.dense.register_forward_pre_hook(record) for f in feed_forward]
    with torch.inference_mode():
        model(model.tokenizer.pairs(contexts, responses))
    for h in hooks:
        h.remove()
    return [float(r.max() / r.median()) for r in ranges]


def test_smoothing_flattens_a_channel_that_runs_large(tiny_core, toy_pairs):
    """One channel of every feed-forward input made 30 times larger (as MiniLM's run, docs/results.md §53):
    after smoothing the products read inputs whose channels span a far smaller range, the weights carry
    the rest, and the scores are the same."""
    cross = load_checkpoint(tiny_core / "cross")
    with torch.no_grad():
        for layer in cross.backbone.encoder.layer:
            layer.attention.output.LayerNorm.weight[3] *= 30
    contexts, responses = [p.context for p in toy_pairs[:12]], [p.response for p in toy_pairs[:12]]
    copy = smoothed(cross, *calibration_pairs(toy_pool()), alpha=0.75)
    before, after = _spread(cross, contexts, responses), _spread(copy, contexts, responses)
    assert min(before) > 10 and max(after) < min(before) / 3, (before, after)
    np.testing.assert_allclose(
        copy.score_pairs(contexts, responses), cross.score_pairs(contexts, responses), atol=1e-4
    )


def test_int8_export_smooths_the_reranker_only_with_a_pool(tmp_path, tiny_core):
    """The int8 reranker graph divides the products' inputs (a Mul before them) when given a pool to
    calibrate on; fp32 graphs and an int8 export without a pool do not."""
    import onnx

    from coreply.inference import ONNX_FILES, export_onnx

    bi, cross = load_checkpoint(tiny_core / "bi"), load_checkpoint(tiny_core / "cross")
    muls = {}
    for name, precision, pool in (
        ("int8", "int8", toy_pool()),
        ("bare", "int8", ()),
        ("fp32", "fp32", toy_pool()),
    ):
        export_onnx(bi, cross, tmp_path / name, precision, calibration=pool)  # type: ignore[arg-type]
        graph = onnx.load(str(tmp_path / name / ONNX_FILES["cross"])).graph
        muls[name] = sum(node.op_type == "Mul" and "inv_s" in "".join(node.input) for node in graph.node)
    layers = len(cross.backbone.encoder.layer)
    assert muls == {"int8": 4 * layers, "bare": 0, "fp32": 0}, muls
