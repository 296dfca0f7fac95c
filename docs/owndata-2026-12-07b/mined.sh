#!/usr/bin/env bash
# docs/results.md §70: §68's CORE run (two epochs) with 4 of each list's 31 negatives mined by the current
# retriever among its top 50 of the training replies, re-mined every 28 steps (the shipped reranker's
# recipe, §39: --hard-negatives 4), since §70's longer run showed a reranker that learns random lists
# while ranking the retriever's candidates worse. Run after §68's run.sh (the same $WORK), from the
# repository root. About 30 minutes on a 2-vCPU AMD EPYC Zen 4 VM.
set -euo pipefail
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
D=docs/owndata-2026-12-07b W=${WORK:-/tmp/oc} PY=.venv/bin/python COREPLY=.venv/bin/coreply

$COREPLY train --mode core --data "$W/train.jsonl" --valid-data "$W/valid.jsonl" -o "$W/runs/core-mined" --overwrite \
  --init-bi builtin --init-cross builtin --lora-rank 8 --cross-lora-rank 32 --lr 5e-4 \
  --num-negatives 31 --hard-negatives 4 --hard-top 50 --hard-refresh 28 --batch-size 8 --epochs 2 \
  --eval-every 28 --patience 3 --valid-size 138 --valid-candidates 100 --valid-pool 600 --log-every 5
cp "$W/runs/core-mined/metrics.jsonl" "$D/metrics-core-mined.jsonl"
cp "$W/runs/core-mined/summary.json" "$D/summary-core-mined.json"

EVAL=(--data "$W/measure.jsonl" --pool "$W/replies.jsonl" --valid-data "$W/valid.jsonl" --limit 0 --valid-limit 0
  --protocol A B --n-r 10 --restatement-quantile off --prior-pairs none)
$COREPLY eval --bi "$W/runs/core-mined/bi" --cross "$W/runs/core-mined/cross" "${EVAL[@]}" --out $D/eval-core-mined.json
O=docs/owndata-2026-12-07
for row in A0 A1 A2 B0 B1 B2; do $PY bench/compare_evals.py $D/eval-core-mined.json#$row $O/eval-core-fixed.json#$row; done
for row in A B; do $PY bench/compare_evals.py $D/eval-core-mined.json#${row}1 $D/eval-core-mined.json#${row}0; done
$PY bench/compare_evals.py $D/eval-core-mined.json#B2 $D/eval-core-mined.json#B0
