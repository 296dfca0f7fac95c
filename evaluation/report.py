"""`coreply eval` (score one retriever/reranker combination on protocols A and B, write JSON) and
`coreply report` (merge several eval JSONs into a markdown results table with significance)."""

from __future__ import annotations

import logging
import platform
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from typing import Any

import torch

from coreply import prior, restatement
from coreply.checkpoint import load_bi, load_checkpoint, read_meta
from coreply.config import ZERO_SHOT
from coreply.corpus import Pair
from coreply.models import PolyEncoder
from coreply.ranking import ZSCORE_WEIGHT, Pipeline
from coreply.text import normalize
from evaluation.metrics import KS, paired_bootstrap, per_case, summarize
from evaluation.protocols import (
    BM25Retriever,
    DenseRetriever,
    Retrieved,
    choose_zscore_weight,
    evaluate_lists,
    protocol_a_lists,
    ranked_ids,
    ranks_for,
    rerank,
    retrieve_and_rerank,
)
from evaluation.restatement import RestatementJudge

log = logging.getLogger(__name__)


@dataclass
class EvalSpec:
    name: str
    bi: str | None
    cross: str | None
    test: list[Pair]
    valid: list[Pair]
    pool: list[str]
    negatives: list[str]  # protocol A draws negatives from these: the responses of the *whole* split
    protocols: tuple[str, ...] = ("A", "B")
    retrievers: tuple[str, ...] = ("bi",)
    n_r: tuple[int, ...] = (10, 50, 100, 200)
    candidates: int = 100
    seed: int = 0
    device: str = "cpu"
    judge: str | None = ZERO_SHOT  # bi-encoder judging restatements (evaluation/restatement.py); None: skip
    guard_pairs: list[Pair] = field(default_factory=list)  # held-out pairs calibrating the guard
    guard_quantile: float | None = restatement.DEFAULT_QUANTILE  # None: protocol B without the guard
    prior_pairs: list[Pair] = field(default_factory=list)  # the response prior's reference; none: no prior
    # per test pair, texts protocol B may not answer (protocols.conversation_others: a pool without the
    # conversation being served); None: the pool as it is
    exclude: list[tuple[str, ...]] | None = None


def _row(name: str, ranks: list[float], **extra: Any) -> dict[str, Any]:
    return {"system": name, "metrics": summarize(ranks), "ranks": ranks, **extra}


def run_eval(spec: EvalSpec) -> dict[str, Any]:
    """Evaluate and return {'meta', 'A': [rows], 'B': [rows], 'sweep': [...]}; rows keep per-case ranks."""
    bi = load_bi(spec.bi, spec.device) if spec.bi else None
    cross = load_checkpoint(spec.cross, spec.device, expect="cross") if spec.cross else None
    residual_to = read_meta(spec.cross, verify=False)["extra"].get("residual_to") if spec.cross else None
    if residual_to and residual_to != getattr(bi, "content_hash", None):
        log.warning(
            "%s corrects retriever %s, not %s: its sum rows mean little",
            spec.cross,
            residual_to[:12],
            spec.bi,
        )
    bi_name = _label(spec.bi, "Bi")
    cross_name = _label(spec.cross, "Cross")
    poly_name = _label(spec.bi, "Poly")  # a Poly-encoder's code scores (its pooled vector is bi_name)
    result: dict[str, Any] = {"A": [], "B": [], "sweep": []}
    recall_test = partial(retrieve_and_rerank, spec.test, n_r=0, exclude=spec.exclude)  # (ranking, depth)
    contexts = [p.context for p in spec.test]
    judge = RestatementJudge(load_bi(spec.judge, spec.device)) if spec.judge else None

    def restates(answers: list[str | None]) -> dict[str, float]:
        return {"restates": round(judge.rate(contexts, answers), 2)} if judge else {}

    def retrieval_row(label: str, got: Retrieved) -> dict[str, Any]:
        return _row(
            label,
            ranks_for(spec.test, keys, got, "retrieval", depth),
            ms_per_case=round(1000 * got.retrieve_s / len(spec.test), 2),
            **restates(top_answers(spec.pool, got, "retrieval", depth)),
        )

    if judge:
        result["restatement"] = {
            "judge": spec.judge,
            "threshold": judge.threshold,
            "gold": restates([p.response for p in spec.test])["restates"],
        }
    candidates = 0
    if "A" in spec.protocols:
        lists = protocol_a_lists(spec.test, spec.negatives, spec.candidates, spec.seed)
        candidates = max(len(c) for c in lists)
        scored = evaluate_lists(spec.test, lists, bi, cross)  # type: ignore[arg-type]
        names = {"bi": bi_name, "poly": poly_name, "cross": cross_name}
        names["sum"] = f"{bi_name} + {cross_name} (sum)"
        result["A"] = [
            _row(names[k], v["ranks"], **restates([c[t] for c, t in zip(lists, v["top"], strict=True)]))
            for k, v in scored.items()
        ]
    if "B" in spec.protocols:
        keys = [normalize(t) for t in spec.pool]
        depth = max(max(KS), *spec.n_r)
        for retriever_name in spec.retrievers:
            if retriever_name == "bm25":
                retrieve, label = BM25Retriever(spec.pool), "BM25"
            else:
                if bi is None:
                    raise ValueError("retriever 'bi' needs --bi")
                retrieve, label = DenseRetriever(bi, spec.pool), bi_name  # type: ignore[assignment]
            t0 = time.perf_counter()
            recall = Pipeline(retrieve, spec.pool, keys)
            got = recall_test(recall, depth)
            # a bundle's recall, one addition at a time: each row, then the next; every rerank stage
            # reads the last (as served)
            if spec.guard_quantile is not None and spec.guard_pairs and retriever_name == "bi":
                result["B"].append(retrieval_row(label, got))
                guard = restatement.calibrate(
                    retrieve.encode_responses, spec.guard_pairs, spec.guard_quantile
                )
                recall = Pipeline(retrieve, spec.pool, keys, guard=restatement.Guard.of(guard))
                got = recall_test(recall, depth)
                label = f"{label} + guard"
                result.setdefault("restatement", {})["guard"] = guard
            if spec.prior_pairs and spec.guard_pairs and isinstance(retrieve, DenseRetriever):
                result["B"].append(retrieval_row(label, got))
                retrieve.prior, result["prior"] = prior.fit(
                    retrieve.encode_contexts,
                    retrieve.search,
                    retrieve.index.vectors.float().cpu().numpy(),
                    keys,
                    spec.prior_pairs,
                    spec.guard_pairs,
                )
                got = recall_test(recall, depth)
                label = f"{label} + prior"
            per_case_ms = 1000 * got.retrieve_s / len(spec.test)
            result["B"].append(retrieval_row(label, got))
            stages = []  # (name, pipeline) per rerank stage this retriever can feed
            if cross is not None:
                score = lambda c, r: cross.score_pairs(c, r).numpy()  # noqa: E731
                stages.append((cross_name, Pipeline(retrieve, spec.pool, keys, score)))
            if isinstance(retrieve, DenseRetriever) and isinstance(bi, PolyEncoder):
                stages.append((poly_name, Pipeline(retrieve, spec.pool, keys, poly=True)))
            valid_got = retrieve_and_rerank(spec.valid, recall, depth, 0) if spec.valid and stages else None
            for stage_name, stage in stages:
                reranked = rerank(spec.test, got, stage, max(spec.n_r))
                valid_reranked = rerank(spec.valid, valid_got, stage, max(spec.n_r)) if valid_got else None
                for n_r in spec.n_r:
                    # Rerank time scales with n_r: charge each n_r its share of the measured rerank time.
                    ms = per_case_ms + 1000 * reranked.rerank_s / len(spec.test) * n_r / max(spec.n_r)
                    weight = (
                        choose_zscore_weight(spec.valid, keys, valid_reranked, n_r)[0]
                        if valid_reranked
                        else ZSCORE_WEIGHT
                    )
                    for fusion, title in (
                        ("rerank", "rerank"),
                        ("sum", "sum"),
                        ("zscore", f"z-score w={weight:.1f}"),
                    ):
                        ranks = ranks_for(spec.test, keys, reranked, fusion, n_r, weight)
                        result["B"].append(
                            _row(
                                f"{label} → {stage_name} [{title}]",
                                ranks,
                                n_r=n_r,
                                fusion=fusion,
                                ms_per_case=round(ms, 2),
                                **restates(top_answers(spec.pool, reranked, fusion, n_r, weight)),
                            )
                        )
                        result["sweep"].append(
                            {
                                "system": f"{label} → {stage_name} [{fusion}]",
                                "n_r": n_r,
                                "hits@1": summarize(ranks)["hits@1"],
                                "ms_per_case": ms,
                            }
                        )
            print(f"  {label}: B done in {time.perf_counter() - t0:.0f}s", flush=True)
    result["meta"] = {
        "name": spec.name,
        "bi": spec.bi,
        "cross": spec.cross,
        "bi_hash": getattr(bi, "content_hash", None),
        "cross_hash": getattr(cross, "content_hash", None),
        "test_pairs": len(spec.test),
        "valid_pairs_for_calibration": len(spec.valid),
        "pool_size": len(spec.pool),
        "excluded_per_case": (
            None
            if spec.exclude is None
            else round(sum(map(len, spec.exclude)) / max(1, len(spec.exclude)), 2)
        ),
        "candidates_protocol_a": candidates or spec.candidates,
        "protocol_a_negative_pool": len(spec.negatives),
        "n_r": list(spec.n_r),
        "seed": spec.seed,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, device {spec.device}",
    }
    return result


def top_answers(
    pool: list[str], got: Retrieved, fusion: str, n_r: int, weight: float = ZSCORE_WEIGHT
) -> list[str | None]:
    """Each query's answer under a fusion: its best-ranked response (None if nothing was retrieved)."""
    return [pool[r[0]] if len(r) else None for r in ranked_ids(got, fusion, n_r, weight)]


def _label(path: str | None, kind: str) -> str:
    if path is None:
        return kind
    if path == ZERO_SHOT:
        return "zero-shot MiniLM"
    train_config = read_meta(path, verify=False).get("extra", {}).get("train_config", {})
    parts = [{"core": "CORE", "mutual": "mutual", "distill": "distill"}.get(train_config.get("mode", ""), "")]
    if train_config.get("hard_negatives"):
        parts.append("hard")
    if train_config.get("cross_residual"):
        parts.append("residual")  # its scores correct its retriever's: the 'sum' rows are the reranker
    if train_config.get("own_turn_negatives") or train_config.get("paraphrase_negatives"):
        parts.append("restate")  # restatement negatives (training/sampling.py)
    suffix = "+".join(p for p in parts if p)
    return f"{kind}-Enc ({suffix})" if suffix else f"{kind}-Enc"


# ----------------------------------------------------------------------------------------- report


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
