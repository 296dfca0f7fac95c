#!/usr/bin/env bash
# Train every mode at an equal budget on the built-in corpus, evaluate every model and two-stage
# combination on protocols A and B, and write docs/results-$SCALE.md (+ JSON, plots).
# Resumable: a finished step (its summary.json / eval JSON exists) is skipped on re-run.
#
#   SCALE=cpu  (default) a reduced run that fits a 2-vCPU machine in about an hour; labelled as such.
#   SCALE=gpu  the paper-scale run (delta_r=32, full test split, full pool) for a GPU machine.
set -euo pipefail
SCALE=${SCALE:-cpu}
RUNS=${RUNS:-runs/results-$SCALE}
OUT=${OUT:-docs}
mkdir -p "$RUNS" "$OUT"

if [ "$SCALE" = gpu ]; then
  TRAIN=(--num-negatives 32 --batch-size 8 --epochs 1 --eval-every 2000 --valid-size 1000 --valid-candidates 100 --patience 3)
  EVAL=(--limit 0 --valid-limit 500 --n-r 10 50 100 200)
  MAE=(--max-steps "${MAE_STEPS:-2000}" --batch-size 128)
else
  # shellcheck disable=SC2206  # STEPS, LIMIT, POOL: numbers from the environment
  TRAIN=(--num-negatives 7 --batch-size 8 --max-steps ${STEPS:-80} --eval-every 20 --valid-size 100 --valid-candidates 20 --device cpu)
  # shellcheck disable=SC2206
  EVAL=(--limit ${LIMIT:-200} --valid-limit 100 --n-r 10 50 --pool-limit ${POOL:-10000} --device cpu)
  MAE=(--max-steps "${MAE_STEPS:-400}" --batch-size 16 --device cpu)
fi

train() {  # name, extra args...
  local name=$1; shift
  if [ -f "$RUNS/$name/summary.json" ]; then echo "== $name: trained"; return; fi
  echo "== train $name"; coreply train -o "$RUNS/$name" "${TRAIN[@]}" "$@"
}
evaluate() {  # name, extra args...
  local name=$1; shift
  if [ -f "$RUNS/eval-$name.json" ]; then echo "== eval $name: done"; return; fi
  echo "== eval $name"; coreply eval --out "$RUNS/eval-$name.json" "${EVAL[@]}" "$@"
}

train independent --mode independent
train distill --mode distill --teacher "$RUNS/independent/cross"
train core --mode core
train mutual --mode mutual
evaluate zero-shot --bi zero-shot --retriever bm25 bi
evaluate independent --bi "$RUNS/independent/bi" --cross "$RUNS/independent/cross" --retriever bm25 bi
evaluate distill --bi "$RUNS/distill/bi" --protocol A B
evaluate core --bi "$RUNS/core/bi" --cross "$RUNS/core/cross"
evaluate mutual --bi "$RUNS/mutual/bi" --cross "$RUNS/mutual/cross"
# Beyond the paper: CORE with retriever-mined hard negatives for the candidate lists.
train core-hard --mode core --hard-negatives ${HARD:-3} --hard-pool ${HARD_POOL:-5000} --hard-refresh ${HARD_REFRESH:-40}
evaluate core-hard --bi "$RUNS/core-hard/bi" --cross "$RUNS/core-hard/cross"

# Dial-MAE (issue #16): post-train the encoder, then the same retriever fine-tuning from it and from the
# base model, at equal budget.
if [ ! -f "$RUNS/dial-mae/summary.json" ]; then
  echo "== pretrain dial-mae"; rm -rf "$RUNS/dial-mae"; coreply pretrain -o "$RUNS/dial-mae" "${MAE[@]}"
fi
train bi-base --mode independent --models bi
train bi-dial-mae --mode independent --models bi --init-bi "$RUNS/dial-mae/bi"
evaluate bi-base --bi "$RUNS/bi-base/bi"
evaluate bi-dial-mae --bi "$RUNS/bi-dial-mae/bi"

coreply report "$RUNS"/eval-*.json --runs "$RUNS"/*/summary.json --scale "$SCALE" \
  --out "$OUT/results-$SCALE.md" --plot "$OUT/nr-sweep-$SCALE.png" --curves "$OUT/curves-$SCALE.png"
