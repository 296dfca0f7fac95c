"""The response prior's sweep (coreply/prior.py, docs/results.md section 20): retrieval hits@1 and
hits@10 over a bundle's whole pool, echoes removed, guard off, for each neighbourhood size k and weight
alpha, with each response's own conversations masked out of its neighbourhood and without the mask, on
the first N validation and test pairs; p: one-sided paired bootstrap against alpha = 0.

Without the mask a reference sample drawn from the training split penalises the training conversations'
responses and spares the held-out ones, gold replies included: the sweep shows how much of the gain
that would fake.

    python bench/response_prior.py --bundle artifacts/default-bundle --out docs/prior-sweep.json
"""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

import numpy as np

from bench import open_bundle, refuse_below  # bench/bench.py: this script's directory is on sys.path
from coreply.artifacts import write_json_atomic
from coreply.bundle import make_backend
from coreply.corpus import load_chitchat
from coreply.prior import DEPTH, REFERENCE, Prior, neighbourhood, own_conversations, reference_sample
from coreply.text import normalize
from evaluation.metrics import paired_bootstrap
from index_builder.build import encode_pool


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default="artifacts/default-bundle")
    p.add_argument("--limit", type=int, default=2000, help="first N pairs of each held-out split")
    p.add_argument("--ks", type=int, nargs="+", default=[10, 50])
    p.add_argument("--alphas", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    p.add_argument("--reference", type=int, default=REFERENCE, help="training contexts sampled")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    refuse_below(args, limit=1, reference=1)
    if min(args.ks) < 1:
        raise SystemExit(f"--ks: each at least 1, got {args.ks}")
    if not all(0 <= a < float("inf") for a in args.alphas):  # NaN too
        raise SystemExit(f"--alphas: each a number >= 0, got {args.alphas}")
    bundle = open_bundle(args.bundle)
    backend = make_backend(bundle, threads=2)
    vectors = bundle.index.reconstruct_n(0, bundle.index.ntotal)  # [N, D]
    splits = load_chitchat()
    reference = reference_sample(splits["train"], args.reference)
    contexts = encode_pool(backend, [q.context for q in reference], contexts=True)
    where = {key: i for i, key in enumerate(bundle.keys)}
    hits = {}  # split -> (scores [Q, n], ids [Q, n], gold [Q]), echoes removed
    for split in ("valid", "test"):
        pairs = splits[split][: args.limit]
        scores, ids = bundle.index.search(
            encode_pool(backend, [q.context for q in pairs], contexts=True), DEPTH + 5
        )
        for row, pair in enumerate(pairs):
            ids[row, np.isin(ids[row], [where.get(normalize(t), -1) for t in pair.context])] = -1
        hits[split] = (scores, ids, np.array([where.get(normalize(q.response), -2) for q in pairs]))

    def measure(values: np.ndarray, alpha: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        out = {}
        for split, (scores, ids, gold) in hits.items():
            _, top = Prior(alpha, values).rescore(scores, ids, 10)  # [Q, 10]
            out[split] = (top[:, 0] == gold).astype(float), (top == gold[:, None]).any(1).astype(float)
        return out

    base = measure(np.zeros(len(vectors), np.float32), 0.0)
    rows = [{"mask": None, "k": None, "alpha": 0.0, **_row(base, base)}]
    masked = own_conversations(bundle.keys, reference, splits["train"])
    for mask in (True, False):
        for k in args.ks:
            values = neighbourhood(vectors, contexts, k, masked if mask else None)
            for alpha in args.alphas:
                rows.append({"mask": mask, "k": k, "alpha": alpha, **_row(measure(values, alpha), base)})
                print(rows[-1], flush=True)
    result = {
        "rows": rows,
        "meta": {
            "bundle": args.bundle,
            "bundle_version": bundle.version,
            "pairs_per_split": args.limit,
            "reference_contexts": len(reference),
            "date": dt.date.today().isoformat(),
        },
    }
    if args.out:
        write_json_atomic(Path(args.out), result, sort_keys=False)


def _row(got: dict, base: dict) -> dict[str, float]:
    """hits@1 / hits@10 (%) per split, and p that hits@1 is not above alpha = 0's."""
    row = {}
    for split, (h1, h10) in got.items():
        row[f"{split}_hits@1"] = round(100 * h1.mean(), 2)
        row[f"{split}_hits@10"] = round(100 * h10.mean(), 2)
        row[f"{split}_p"] = round(paired_bootstrap(h1, base[split][0]), 4)
    return row


if __name__ == "__main__":
    main()
