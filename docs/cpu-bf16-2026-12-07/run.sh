#!/usr/bin/env bash
# docs/results.md §71: a team's own pairs trained on on a CPU (§68's CORE run, its recipe unchanged), in
# fp32 and under bf16 autocast (`--cpu-bf16`), one after the other on the same host, then both pairs
# measured on the 600 held-out pairs. From the repository root, after `make install` and
# `.venv/bin/pip install --no-deps chatterbot-corpus==1.3.3` (BSD-3, not a dependency of coreply).
# About 50 minutes on a 2-vCPU Intel Xeon VM with AMX: the two runs 14 minutes each, the evaluations
# about 5 each (on 2026-12-07 they were stopped unrun, results.md §71).
set -euo pipefail
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
D=docs/cpu-bf16-2026-12-07 W=${WORK:-/tmp/oc}
PY=.venv/bin/python COREPLY=.venv/bin/coreply

# §68's pairs and pool (§67): 600 pairs to measure on, 138 to validate, 440 to train
bash docs/owndata-2026-12-07/pairs.sh "$W"

# §68's CORE run, once in fp32 and once under bf16 autocast
for precision in fp32 bf16; do
  flag=(); [ $precision = bf16 ] && flag=(--cpu-bf16)
  $COREPLY train --mode core --data "$W/train.jsonl" --valid-data "$W/valid.jsonl" -o "$W/runs/$precision" \
    --overwrite --init-bi builtin --init-cross builtin --lora-rank 8 --cross-lora-rank 32 --lr 5e-4 \
    --num-negatives 31 --batch-size 8 --epochs 2 --eval-every 28 --patience 3 \
    --valid-size 138 --valid-candidates 100 --valid-pool 600 --log-every 5 "${flag[@]}"
  cp "$W/runs/$precision/metrics.jsonl" "$D/metrics-$precision.jsonl"
  cp "$W/runs/$precision/summary.json" "$D/summary-$precision.json"
done

# Protocols A (1 of 100) and B (the whole pool, n_r = 10) on the 600 measured pairs, no stage, as §68
EVAL=(--data "$W/measure.jsonl" --pool "$W/replies.jsonl" --valid-data "$W/valid.jsonl" --limit 0 --valid-limit 0
  --protocol A B --n-r 10 --restatement-quantile off --prior-pairs none)
for precision in fp32 bf16; do
  $COREPLY eval --bi "$W/runs/$precision/bi" --cross "$W/runs/$precision/cross" "${EVAL[@]}" \
    --out $D/eval-$precision.json
done
for row in A0 A1 A2 B0 B2 B3; do
  $PY bench/compare_evals.py $D/eval-bf16.json#$row $D/eval-fp32.json#$row
done
