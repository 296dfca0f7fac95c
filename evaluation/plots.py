"""PNG plots: training curves (like the CORE paper's Fig. 3) and quality/latency against n_r (Fig. 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training_curves(metrics_jsonl: str | Path, out_png: str | Path) -> None:
    """Validation hits@1 of each model and the training losses against the optimizer step."""
    records = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for model in ("bi", "cross", "sum"):
        points = [(r["step"], r["valid"][model]["hits@1"]) for r in records if model in r.get("valid", {})]
        if points:
            top.plot(*zip(*points, strict=True), marker="o", label=f"{model} valid hits@1")
    top.set_ylabel("hits@1 (%)")
    top.legend()
    for key in ("bi_loss", "cross_loss"):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            bottom.plot(*zip(*points, strict=True), label=key)
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("training loss")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def plot_runs(metrics_by_run: dict[str, str | Path], out_png: str | Path) -> None:
    """Validation hits@1 of each run's bi- and cross-encoder against the step (the CORE paper's Fig. 3)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, path in sorted(metrics_by_run.items()):
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        for model, style in (("bi", "-"), ("cross", "--")):
            points = [
                (r["step"], r["valid"][model]["hits@1"]) for r in records if model in r.get("valid", {})
            ]
            if points:
                ax.plot(*zip(*points, strict=True), style, marker="o", label=f"{run} {model}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("valid hits@1 (%)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


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
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
