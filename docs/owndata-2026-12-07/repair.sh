#!/usr/bin/env bash
# docs/results.md §69: §68's rerankers measured again as they were trained. Run after run.sh (same $WORK),
# on a checkout from before 2d58ce9, whose saved rerankers lack the built-in reranker's position and
# token-type tables; from 2d58ce9 on, run.sh's own checkpoints are already whole and the repair is a no-op.
# The tables stayed frozen at the built-in reranker's values in training, so putting them back gives the
# trained model exactly (each repaired reranker reproduces its recorded validation to the last digit).
# About 15 minutes on a 2-vCPU AMD EPYC Zen 4 VM.
set -euo pipefail
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
D=docs/owndata-2026-12-07 W=${WORK:-/tmp/oc} B=${WORK:-/tmp/oc}/bundles
PY=.venv/bin/python COREPLY=.venv/bin/coreply

$PY - "$W" <<'PY'
import json, sys
from pathlib import Path
from coreply.adapters import trainable_state
from coreply.checkpoint import ADAPTER, load_checkpoint, load_weights, save_checkpoint
for mode in ("core", "independent"):
    saved = Path(sys.argv[1]) / "runs" / mode / "cross"
    model = load_checkpoint("coreply/weights/default-cross", expect="cross", merge=False)  # its tables
    load_weights(model, saved / ADAPTER, trainable_state(model))  # the run's adapters, biases, norms, head
    extra = json.loads((saved / "checkpoint.json").read_text())["extra"]
    save_checkpoint(model, saved.with_name("cross-repaired"), extra)
PY

EVAL=(--data "$W/measure.jsonl" --pool "$W/replies.jsonl" --valid-data "$W/valid.jsonl" --limit 0 --valid-limit 0
  --protocol A B --n-r 10 --restatement-quantile off --prior-pairs none)
for mode in core independent; do
  $COREPLY eval --bi "$W/runs/$mode/bi" --cross "$W/runs/$mode/cross-repaired" "${EVAL[@]}" --out $D/eval-$mode-fixed.json
done
for row in A1 A2 B2; do
  $PY bench/compare_evals.py $D/eval-core-fixed.json#$row $D/eval-independent-fixed.json#$row $D/eval-core.json#$row
done
for m in core independent; do
  for row in A B; do $PY bench/compare_evals.py $D/eval-$m-fixed.json#${row}2 $D/eval-$m-fixed.json#${row}0; done
done

for m in independent core; do
  Q=(--bi "$W/runs/$m/bi" --cross "$W/runs/$m/cross-repaired" --queries "$W/valid.jsonl" --prior-pairs "$W/train.jsonl")
  $COREPLY index build --pool "$W/replies.jsonl" -o "$B/$m-q-fixed" "${Q[@]}"
  $COREPLY index build --pool "$W/replies.jsonl" -o "$B/$m-q-noguard-fixed" "${Q[@]}" --restatement-quantile off
done
$PY bench/as_served.py --pairs "$W/measure.jsonl" --out $D/as-served-fixed.json.gz --bundles "$B/core-bi" \
  "$B/independent-bi" "$B/independent-q-fixed" "$B/independent-q-noguard-fixed" "$B/core-q-fixed" \
  "$B/core-q-noguard-fixed"
