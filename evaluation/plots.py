"""PNG plots: training curves (like the CORE paper's Fig. 3) and quality/latency against n_r (Fig. 2)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from coreply.artifacts import write_atomic


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, out_png: str | Path) -> None:
    """The figure laid out and written as a PNG, atomically; then closed."""
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    write_atomic(Path(out_png), png.getvalue())


def _records(metrics_jsonl: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]


def _valid(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, validation hits@1) of one model's ranking, e.g. 'cross' or 'sum_pool'."""
    return [(r["step"], r["valid"][key]["hits@1"]) for r in records if key in r.get("valid", {})]


def _has_pool(records: list[dict[str, Any]]) -> bool:
    return any(key.endswith("_pool") for r in records for key in r.get("valid", {}))


LISTS, POOL = ("bi", "cross", "sum"), ("bi_pool", "cross_pool", "sum_pool")


def _legend(ax: Any, **kwargs: Any) -> None:
    """The panel's legend, or a note where it has no curve: validation panels of a run without validation
    (``--valid-size 0``, or one that ended before its first)."""
    if ax.lines:
        ax.legend(**kwargs)
    else:
        ax.text(0.5, 0.5, "no validation", ha="center", transform=ax.transAxes)


def plot_training_curves(metrics_jsonl: str | Path, out_png: str | Path) -> None:
    """Validation hits@1 of each model (on 1-of-N lists; over ``--valid-pool``'s responses in a panel of
    its own, a scale ten times smaller) and the training losses against the optimizer step."""
    records = _records(metrics_jsonl)
    plt = _pyplot()
    panels = [(LISTS, "hits@1, 1-of-N lists (%)")] + [(POOL, "hits@1, pool (%)")] * _has_pool(records)
    fig, axes = plt.subplots(len(panels) + 1, 1, figsize=(7, 3.5 * (len(panels) + 1)), sharex=True)
    for ax, (keys, label) in zip(axes, panels, strict=False):
        for key in keys:
            if points := _valid(records, key):
                ax.plot(*zip(*points, strict=True), marker="o", label=f"{key} valid")
        ax.set_ylabel(label)
        _legend(ax)
    bottom = axes[-1]
    for key in ("bi_loss", "cross_loss"):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            bottom.plot(*zip(*points, strict=True), label=key)
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("training loss")
    bottom.legend()
    _save(plt, fig, out_png)


def plot_runs(metrics_by_run: dict[str, str | Path], out_png: str | Path) -> None:
    """Validation hits@1 of each run's models against the step (the CORE paper's Fig. 3): on 1-of-N lists,
    and over the validation pool in a second panel where a run validated there."""
    plt = _pyplot()
    runs = {run: _records(path) for run, path in sorted(metrics_by_run.items())}
    pool = any(_has_pool(records) for records in runs.values())
    fig, axes = plt.subplots(2 if pool else 1, 1, figsize=(7, 9 if pool else 4.5), sharex=True, squeeze=False)
    for ax, keys in zip(axes[:, 0], (LISTS, POOL), strict=False):
        for run, records in runs.items():
            for key, style in zip(keys, ("-", "--", ":"), strict=True):
                if points := _valid(records, key):
                    ax.plot(*zip(*points, strict=True), style, marker="o", label=f"{run} {key}")
        ax.set_ylabel("valid hits@1, pool (%)" if keys is POOL else "valid hits@1 (%)")
        _legend(ax, fontsize=7)
    axes[-1, 0].set_xlabel("optimizer step")
    _save(plt, fig, out_png)


def plot_nr_sweep(sweep: list[dict[str, Any]], out_png: str | Path) -> None:
    """``sweep``: [{'system', 'n_r', 'hits@1', 'ms_per_case'}]; hits@1 and latency against n_r."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for system in sorted({s["system"] for s in sweep}):
        rows = sorted((s for s in sweep if s["system"] == system), key=lambda s: s["n_r"])
        xs = [r["n_r"] for r in rows]
        left.plot(xs, [r["hits@1"] for r in rows], marker="o", label=system)
        right.plot(xs, [r["ms_per_case"] for r in rows], marker="o", label=system)
    left.set_xlabel("n_r")
    left.set_ylabel("hits@1 (%)")
    right.set_xlabel("n_r")
    right.set_ylabel("ms per case")
    left.legend(fontsize=7)
    _save(plt, fig, out_png)
