#!/usr/bin/env bash
# docs/results.md §70: §68's CORE run trained twice as long (four epochs, 220 steps of 8 contexts), to see
# whether the reranker, still rising at two epochs, reaches its retriever. Run after §68's run.sh (the same
# $WORK: its pairs split and pool), from the repository root, on a checkout from 2d58ce9 on (rerankers
# saved whole). About 50 minutes on a 2-vCPU AMD EPYC Zen 4 VM.
set -euo pipefail
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
D=docs/owndata-2026-12-07b W=${WORK:-/tmp/oc} PY=.venv/bin/python COREPLY=.venv/bin/coreply

$COREPLY train --mode core --data "$W/train.jsonl" --valid-data "$W/valid.jsonl" -o "$W/runs/core-4ep" --overwrite \
  --init-bi builtin --init-cross builtin --lora-rank 8 --cross-lora-rank 32 --lr 5e-4 \
  --num-negatives 31 --batch-size 8 --epochs 4 --eval-every 28 --patience 3 \
  --valid-size 138 --valid-candidates 100 --valid-pool 600 --log-every 5
cp "$W/runs/core-4ep/metrics.jsonl" "$D/metrics-core-4ep.jsonl"
cp "$W/runs/core-4ep/summary.json" "$D/summary-core-4ep.json"

# Protocols A and B on §68's 600 measured pairs, as §69 measured the two-epoch run (eval-core-fixed.json)
EVAL=(--data "$W/measure.jsonl" --pool "$W/replies.jsonl" --valid-data "$W/valid.jsonl" --limit 0 --valid-limit 0
  --protocol A B --n-r 10 --restatement-quantile off --prior-pairs none)
$COREPLY eval --bi "$W/runs/core-4ep/bi" --cross "$W/runs/core-4ep/cross" "${EVAL[@]}" --out $D/eval-core-4ep.json
O=docs/owndata-2026-12-07
for row in A0 A1 A2 B0 B2; do $PY bench/compare_evals.py $D/eval-core-4ep.json#$row $O/eval-core-fixed.json#$row; done
for row in A B; do $PY bench/compare_evals.py $D/eval-core-4ep.json#${row}1 $D/eval-core-4ep.json#${row}0; done
