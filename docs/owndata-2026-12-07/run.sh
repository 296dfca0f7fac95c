#!/usr/bin/env bash
# docs/results.md §68: a team's own pairs, trained on from the built-in models on a CPU, over ChatterBot's
# English conversations. From the repository root, after `make install` and
# `.venv/bin/pip install --no-deps chatterbot-corpus==1.3.3` (BSD-3, not a dependency of coreply).
# About 70 minutes on a 2-vCPU AMD EPYC Zen 4 VM: each training run 21-22, each eval about 5.
set -euo pipefail
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
D=docs/owndata-2026-12-07 W=${WORK:-/tmp/oc}
PY=.venv/bin/python COREPLY=.venv/bin/coreply
mkdir -p "$W/eval" "$W/bundles"

# §68's pairs and pool (§67): 600 pairs to measure on, 138 to validate, 440 to train
bash docs/owndata-2026-12-07/pairs.sh "$W"

# Two runs from the built-in pair, one recipe: the README's adapters, the paper's lists (1 gold + 31),
# two epochs (110 steps of 8 contexts), a validation every half epoch, each model's best kept
for mode in independent core; do
  $COREPLY train --mode $mode --data "$W/train.jsonl" --valid-data "$W/valid.jsonl" -o "$W/runs/$mode" --overwrite \
    --init-bi builtin --init-cross builtin --lora-rank 8 --cross-lora-rank 32 --lr 5e-4 \
    --num-negatives 31 --batch-size 8 --epochs 2 --eval-every 28 --patience 3 \
    --valid-size 138 --valid-candidates 100 --valid-pool 600 --log-every 5
  cp "$W/runs/$mode/metrics.jsonl" "$D/metrics-$mode.jsonl"
  cp "$W/runs/$mode/summary.json" "$D/summary-$mode.json"
done

# Protocols A (1 of 100) and B (the whole pool, n_r = 10) on the 600 measured pairs, no stage
EVAL=(--data "$W/measure.jsonl" --pool "$W/replies.jsonl" --valid-data "$W/valid.jsonl" --limit 0 --valid-limit 0
  --protocol A B --n-r 10 --restatement-quantile off --prior-pairs none)
$COREPLY eval --bi builtin --cross builtin "${EVAL[@]}" --out $D/eval-builtin.json
for mode in independent core; do
  $COREPLY eval --bi "$W/runs/$mode/bi" --cross "$W/runs/$mode/cross" "${EVAL[@]}" --out $D/eval-$mode.json
done
for row in A0 A1 A2 B0 B2 B3; do
  $PY bench/compare_evals.py $D/eval-core.json#$row $D/eval-independent.json#$row $D/eval-builtin.json#$row
done

# As served: bundles over the pool. Each model alone with no stage (no pairs given to the build); the
# built-in pair as a team with no pairs gets it (§67); each pair with its stages chosen on the 138
# validation pairs (the prior measured against the 440 training contexts); zero-shot
B=$W/bundles
for m in builtin independent core; do
  if [ $m = builtin ]; then bi=builtin cross=builtin; else bi=$W/runs/$m/bi cross=$W/runs/$m/cross; fi
  $COREPLY index build --pool "$W/replies.jsonl" -o $B/$m-bi --bi $bi --prior-pairs none
  $COREPLY index build --pool "$W/replies.jsonl" -o $B/$m-q --bi $bi --cross $cross --queries "$W/valid.jsonl" \
    --prior-pairs "$W/train.jsonl"
done
$COREPLY index build --pool "$W/replies.jsonl" -o $B/nopairs --bi builtin --cross builtin
$COREPLY index build --pool "$W/replies.jsonl" -o $B/zero-shot --bi zero-shot
$PY bench/as_served.py --pairs "$W/measure.jsonl" --out $D/as-served.json.gz --bundles $B/core-bi \
  $B/independent-bi $B/builtin-bi $B/zero-shot $B/nopairs $B/builtin-q $B/independent-q $B/core-q

# What the stages chosen on the validation pairs did: each such pair again without its lexical stage and
# without its restatement guard
for m in independent core; do
  Q=(--bi "$W/runs/$m/bi" --cross "$W/runs/$m/cross" --queries "$W/valid.jsonl" --prior-pairs "$W/train.jsonl")
  $COREPLY index build --pool "$W/replies.jsonl" -o "$B/$m-q-nolex" "${Q[@]}" --lexical off
  $COREPLY index build --pool "$W/replies.jsonl" -o "$B/$m-q-noguard" "${Q[@]}" --restatement-quantile off
done
$PY bench/as_served.py --pairs "$W/measure.jsonl" --out $D/as-served-stages.json.gz --bundles $B/independent-q \
  $B/independent-q-nolex $B/independent-q-noguard $B/core-q $B/core-q-nolex $B/core-q-noguard
