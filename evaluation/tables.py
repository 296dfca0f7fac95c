"""`coreply report`: several `coreply eval` JSONs merged into markdown results tables, with paired
significance. Reads JSON only (no torch), so a report is made in a moment."""

from __future__ import annotations

import re
from typing import Any

from evaluation.metrics import KS, paired_bootstrap, per_case


def _key(row: dict[str, Any]) -> str:
    """A table row's identity: its system, and its rerank depth if it has one."""
    return row["system"] + (f" n_r={row['n_r']}" if "n_r" in row else "")


def _role(row: dict[str, Any]) -> str:
    """What a row measures whichever recipe trained its models: its key without the models' training
    tags ("Bi-Enc (CORE) + guard" and "Bi-Enc + guard" are both "Bi-Enc + guard")."""
    return re.sub(r"(-Enc) \([^)]*\)", r"\1", _key(row))


def _is_core(system: str) -> bool:
    return "CORE" in system or "mutual" in system


# what render_markdown reads of each input: run_eval's meta and rows, and a training run's summary.json
_META_KEYS = (
    "name",
    "date",
    "machine",
    "test_pairs",
    "pool_size",
    "candidates_protocol_a",
    "valid_pairs_for_calibration",
)
_ROW_KEYS = {"system", "metrics", "ranks"}
_SUMMARY_KEYS = ("steps", "examples_seen", "train_seconds", "device")


def check_result(obj: Any) -> None:
    """Raise ValueError, saying what is missing, unless ``obj`` has the shape :func:`run_eval` returns
    (`coreply eval --out`), so that `coreply report` refuses another JSON in one line."""
    meta = obj.get("meta") if isinstance(obj, dict) else None
    if not isinstance(meta, dict):
        raise ValueError('no "meta" object: not the JSON `coreply eval --out` writes')
    missing = [k for k in _META_KEYS if k not in meta]
    if missing:
        raise ValueError(f"its meta lacks {', '.join(missing)}: not the JSON `coreply eval --out` writes")
    if not any(k in obj for k in ("A", "B")):
        raise ValueError('no protocol rows ("A" or "B"): not the JSON `coreply eval --out` writes')
    for protocol in ("A", "B"):
        rows = obj.get(protocol, [])
        if not isinstance(rows, list) or not all(isinstance(r, dict) and r.keys() >= _ROW_KEYS for r in rows):
            raise ValueError(f'its "{protocol}" is not a list of rows with system, metrics and ranks')


def check_summary(obj: Any) -> None:
    """Raise ValueError unless ``obj`` is a training run's summary.json as `coreply train` writes it."""
    missing = [k for k in _SUMMARY_KEYS if not isinstance(obj, dict) or k not in obj]
    if missing:
        raise ValueError(f"lacks {', '.join(missing)}: not the summary.json `coreply train` writes")


def render_markdown(
    results: list[dict[str, Any]],
    runs: dict[str, dict[str, Any]] | None = None,
    scale: str = "",
    metric_for_p: str = "hits@1",
    against: str | None = None,
) -> str:
    """Training table, then one table per protocol. p = paired bootstrap of each cooperative row against
    the best non-cooperative row, or with ``against`` (an eval run's name) of every other run's row
    against that run's row of the same role (:func:`_role`) on the same cases."""
    lines = [f"## Results{f' ({scale} scale)' if scale else ''}", ""]
    metas = [r["meta"] for r in results if "meta" in r]
    # protocol B with or without each case's conversation: only runs with B rows say which
    kinds = {r["meta"].get("excluded_per_case") is not None for r in results if r.get("B") and "meta" in r}
    if len(kinds) > 1:
        raise ValueError(
            "some runs excluded each case's conversation from protocol B's pool (--exclude-conversation) "
            "and some did not: they measure different things, report them apart"
        )
    apart = kinds == {True}
    if metas:
        m = metas[0]
        lines += [
            f"Evaluated {m['date']} on {m['machine']}; {m['test_pairs']} test pairs, pool of "
            f"{m['pool_size']:,} responses, protocol A lists of {m['candidates_protocol_a']}, "
            f"{m['valid_pairs_for_calibration']} validation pairs to choose the z-score weight.",
            "",
        ]
    gold = next((r["restatement"] for r in results if "gold" in r.get("restatement", {})), None)
    if gold:
        lines += [
            f"restates %: share of top-1 answers whose cosine with the context's last turn, under "
            f"{gold['judge']}, is at least {gold['threshold']} (evaluation/restatement.py); the human (gold) "
            f"replies do so in {gold['gold']:.1f} % of these cases.",
            "",
        ]
    guards = [
        (r["meta"]["name"], r["restatement"]["guard"]) for r in results if "guard" in r.get("restatement", {})
    ]
    if guards:
        thresholds = "; ".join(
            f"{n}: last turn {g['last_turn']}, earlier turns {g['earlier_turns']} "
            f"(quantile {g['quantile']}), "
            f"words {g.get('words_last_turn', 'unchecked')} (quantile {g.get('words_quantile', '-')}); "
            f"{g['calibrated_on']}, {100 * g['human_replies_dropped']:.2f} % of them dropped"
            for n, g in guards
        )
        lines += [
            "+ guard: protocol B recall without the candidates as close to the context's last turn, or to "
            "an earlier turn, as that quantile of held-out human replies are, under the row's own retriever, "
            "or sharing as many of the last turn's words (F1 of distinct words) as the words quantile of "
            "them "
            f"(coreply/restatement.py): {thresholds}. Every rerank row of such a run reranks the guarded "
            "recall.",
            "",
        ]
    priors = [(r["meta"]["name"], r["prior"]) for r in results if "prior" in r]
    if priors:
        weights = "; ".join(
            f"{n}: alpha {p['alpha']:g} (hits@1 by alpha, "
            + ", ".join(f"{a}: {h}" for a, h in p["hits@1"].items())
            + f", on {p['chosen_on'].split(',')[0]})"
            for n, p in priors
        )
        lines += [
            "+ prior: recall rescored by the response prior a bundle serves (score less alpha times each "
            f"response's mean score against its {priors[0][1]['k']} closest reference contexts, "
            f"coreply/prior.py): {weights}. Every rerank row of such a run reranks that recall.",
            "",
        ]
    if runs:
        lines += [
            "| run | steps | examples seen | train time (s) | best valid hits@1 | device |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in sorted(runs.items()):
            rows = r.get("selected_by", {})  # the validation row each best was measured on, where it says
            best = ", ".join(f"{rows.get(k, k)} {v:.1f}" for k, v in r.get("best_valid_hits@1", {}).items())
            steps = str(r["steps"])
            if r.get("max_minutes"):  # a time budget planned the steps: of how many it could have taken
                steps += f" of {r['planned_steps']} ({r['max_minutes']:g} min)"
            lines.append(
                f"| {name} | {steps} | {r['examples_seen']} | {r['train_seconds']} | {best} | {r['device']} |"
            )
        lines.append("")
    size = metas[0]["candidates_protocol_a"] if metas else 100
    for protocol, title in (
        ("A", f"Protocol A (1 gold + {size - 1} negatives)"),
        (
            "B",
            "Protocol B (full pool, less each case's other conversation lines)"
            if apart
            else "Protocol B (full pool)",
        ),
    ):
        rows = [(res.get("meta", {}).get("name", ""), r) for res in results for r in res.get(protocol, [])]
        if not rows:
            continue
        # One row per system; the same system from two runs that rank differently (two recipes with
        # one label) keeps both, named by their eval run.
        unique: dict[str, dict[str, Any]] = {}
        reference = {_role(r): r for run, r in rows if run == against}  # --against: that run's rows
        for run, r in rows:
            paired = reference.get(_role(r)) if run != against else None
            if _key(r) in unique and unique[_key(r)]["ranks"] != r["ranks"]:
                r = {**r, "system": f"{r['system']} [{run}]"}
            unique.setdefault(_key(r), {**r, "against": paired} if paired else r)
        sizes = {len(r["ranks"]) for r in unique.values()}
        baselines = [(k, r) for k, r in unique.items() if not _is_core(r["system"])]
        best_key, best = max(
            baselines,
            key=lambda kr: (kr[1]["metrics"][metric_for_p], kr[1]["metrics"]["mrr"]),
            default=(None, None),
        )
        if against:
            of = f"the row of **{against}** that measures the same thing (its models' recipe aside)"
        else:
            of = f"the best non-cooperative row (**{best_key}**)" if best_key else "no baseline (none given)"
        lines += [
            f"### {title}",
            "",
            f"Cases: {', '.join(str(s) for s in sorted(sizes))}. p: one-sided paired bootstrap "
            f"(10,000 resamples) on {metric_for_p} against {of}.",
            "",
        ]
        cols = [f"hits@{k}" for k in KS] + ["mrr"]
        extra = ["n_r", "ms/case"] if protocol == "B" else []
        if gold:
            extra.append("restates %")
        lines.append("| system | " + " | ".join(cols + extra) + " | p |")
        lines.append("|" + "---|" * (len(cols) + len(extra) + 2))
        for r in unique.values():
            m = r["metrics"]
            p = ""
            other = r.get("against") if against else best if _is_core(r["system"]) else None
            if other is not None and len(r["ranks"]) == len(other["ranks"]):
                ours, theirs = per_case(r["ranks"], metric_for_p), per_case(other["ranks"], metric_for_p)
                p = f"{paired_bootstrap(ours, theirs):.3f}"
            cells = [f"{m[c]:.1f}" for c in cols]
            if protocol == "B":
                cells += [str(r.get("n_r", "–")), f"{r.get('ms_per_case', float('nan')):.1f}"]
            if gold:
                cells.append(f"{r['restates']:.1f}" if "restates" in r else "–")
            lines.append(f"| {r['system']} | " + " | ".join(cells) + f" | {p} |")
        lines.append("")
    return "\n".join(lines)


def merge_sweeps(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for res in results for s in res.get("sweep", [])]
