"""Paired comparison of rows from ``coreply eval`` JSONs, across files: the p-values that docs/results.md
quotes between runs of different leases (CORE against independent training, a run against its start).

A row is ``FILE#PI``: protocol P (A or B) and the row's index I in that protocol's list, as ``--list``
prints them (protocol B repeats a system's rows once per n_r, so names alone are ambiguous). The first
row is compared with each of the others on the same test cases (the files must hold the same number of
cases, in the same order: the same --limit and split): hits@1 of each, the cases it wins and loses on
hits@1, and the one-sided paired bootstrap p-value (10,000 resamples) that it is not better.

    python bench/compare_evals.py --list docs/lease-2026-11-26b/eval-residual-core-r32.json.gz
    python bench/compare_evals.py docs/lease-2026-11-26b/eval-residual-core-r32.json.gz#B7 \\
        docs/eval-default-bi-core-r32-testB.json.gz#B2 docs/eval-default-bi-core-r32-testB.json.gz#B4
"""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path
from typing import Any

import numpy as np

from coreply.artifacts import read_json
from evaluation.metrics import paired_bootstrap, per_case


@functools.cache  # a file named in several rows is read once
def load(path: str) -> dict[str, Any]:
    try:
        result = read_json(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"compare_evals.py: {path}: cannot read an evaluation JSON ({e})") from None
    if not isinstance(result, dict) or not any(isinstance(result.get(p), list) for p in "AB"):
        raise SystemExit(f"compare_evals.py: {path}: not a `coreply eval` JSON (no protocol A or B rows)")
    return result


def row(spec: str) -> tuple[str, np.ndarray]:
    """``FILE#PI`` -> (a label, the row's per-case hits@1 [cases])."""
    match = re.fullmatch(r"(.+)#([AB])(\d+)", spec)
    if match is None:
        raise SystemExit(f"compare_evals.py: {spec!r}: name a row as FILE#A3 or FILE#B12 (see --list)")
    path, protocol, index = match[1], match[2], int(match[3])
    rows = load(path).get(protocol) or []
    if index >= len(rows):
        raise SystemExit(f"compare_evals.py: {spec}: protocol {protocol} has {len(rows)} rows (see --list)")
    if not {"system", "ranks"} <= set(rows[index]):
        raise SystemExit(f"compare_evals.py: {spec}: the row has no system name or per-case ranks")
    return f"{Path(path).stem}#{protocol}{index} {rows[index]['system']}", per_case(
        rows[index]["ranks"], "hits@1"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="*", help="FILE#PI: the row to test, then the rows it is tested against")
    ap.add_argument("--list", metavar="FILE", help="print FILE's rows with their FILE#PI names and stop")
    args = ap.parse_args()
    if args.list:
        result = load(args.list)
        for protocol in "AB":
            for i, r in enumerate(result.get(protocol) or []):
                print(f"{args.list}#{protocol}{i}\t{r['metrics']['hits@1']:.2f}\t{r['system']}")
        return
    if len(args.rows) < 2:
        ap.error("name a row and at least one row to compare it with (FILE#PI), or --list FILE")
    label, hits = row(args.rows[0])
    print(f"{100 * hits.mean():6.2f}  {label}")
    for spec in args.rows[1:]:
        other_label, other = row(spec)
        if other.shape != hits.shape:
            raise SystemExit(f"compare_evals.py: {spec}: {other.size} cases, the first row has {hits.size}")
        wins, losses = int(np.sum(hits > other)), int(np.sum(hits < other))
        p = paired_bootstrap(hits, other)
        print(f"{100 * other.mean():6.2f}  {other_label}: wins {wins}, losses {losses}, p {p:.3g}")


if __name__ == "__main__":
    main()
