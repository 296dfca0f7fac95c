import json
import struct
import warnings

from evaluation.plots import plot_runs, plot_training_curves


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR: width, height


def _metrics(path, pool: bool) -> None:
    valid = {key: {"hits@1": 10.0} for key in ("bi", "cross", "sum")}
    if pool:
        valid |= {f"{key}_pool": {"hits@1": 1.0} for key in ("bi", "cross", "sum")}
    rows = [{"step": step, "valid": valid} for step in (0, 2)] + [{"step": 1, "cross_loss": 2.0}]
    path.write_text("\n".join(json.dumps(r) for r in rows))


def test_the_validation_pool_gets_a_panel_of_its_own(tmp_path):
    """Hits@1 over --valid-pool's responses is ten times smaller than on 1-of-N lists: drawn on the same
    axes it would lie flat along the bottom, so a run that has it gets another panel (a taller figure)."""
    heights = {}
    for pool in (False, True):
        metrics = tmp_path / f"{pool}.jsonl"
        _metrics(metrics, pool)
        plot_training_curves(metrics, tmp_path / f"curves-{pool}.png")
        plot_runs({"run": metrics}, tmp_path / f"runs-{pool}.png")
        heights[pool] = [_png_size(tmp_path / f"{kind}-{pool}.png")[1] for kind in ("curves", "runs")]
    assert heights[True][0] > heights[False][0] and heights[True][1] > heights[False][1]


def test_a_run_without_validation_plots_its_losses_without_a_warning(tmp_path):
    metrics = tmp_path / "metrics.jsonl"  # --valid-size 0: losses only
    metrics.write_text(json.dumps({"step": 1, "bi_loss": 1.5, "cross_loss": 2.0}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warned of a legend with nothing in it
        plot_training_curves(metrics, tmp_path / "curves.png")
        plot_runs({"run": metrics}, tmp_path / "runs.png")
    assert _png_size(tmp_path / "curves.png")[0] > 0 and _png_size(tmp_path / "runs.png")[0] > 0
