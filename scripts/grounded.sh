#!/usr/bin/env bash
# Knowledge-grounded ranking on the built-in corpus's persona split (issue #16): the ranker trained with
# no knowledge, with all of it, with a frozen retriever's top-m, and by reciprocal learning (RecKGC), at
# an equal budget; protocol A on the test split with per-case significance against the no-knowledge
# ranker, and the reciprocal ranker once more with its knowledge withheld. Resumable (finished steps
# are skipped).
#
#   SCALE=cpu  (default) a reduced run for a 2-vCPU machine: a 2-layer ranker, short pairs, 150 steps.
#   SCALE=gpu  the paper's sizes (m = 5, 15 negatives, the full 6-layer ranker) for a GPU machine.
set -euo pipefail
SCALE=${SCALE:-cpu}
RUNS=${RUNS:-runs/grounded-$SCALE}
OUT=${OUT:-docs}
COREPLY=${COREPLY:-coreply}
mkdir -p "$RUNS" "$OUT"
if [ "$SCALE" = gpu ]; then
  TRAIN=(--top-m 5 --num-negatives 15 --batch-size 16 --max-steps "${STEPS:-3000}" --eval-every 500
    --valid-size 500 --valid-candidates 100 --max-knowledge-tokens 128 --device "${DEVICE:-cuda}")
  EVAL=(--limit 0 --candidates 100 --device "${DEVICE:-cuda}")
else
  TRAIN=(--num-layers 2 --max-context-tokens 64 --max-knowledge-tokens 48 --top-m 3 --num-negatives 3
    --batch-size 8 --max-steps "${STEPS:-150}" --eval-every 50 --valid-size 100 --valid-candidates 10
    --lr 1e-4 --device cpu)
  EVAL=(--limit "${LIMIT:-500}" --candidates 20 --device cpu)
fi

for knowledge in none all frozen reciprocal; do
  run=$RUNS/$knowledge
  [ -f "$run/summary.json" ] && { echo "== $knowledge: trained"; continue; }
  echo "== train $knowledge"; rm -rf "$run"
  "$COREPLY" ground train -o "$run" --knowledge "$knowledge" "${TRAIN[@]}"
done

evaluate() {  # name, extra args...
  local name=$1; shift
  [ -f "$RUNS/eval-$name.json" ] && { echo "== eval $name: done"; return; }
  echo "== eval $name"
  "$COREPLY" ground eval --out "$RUNS/eval-$name.json" --name "$name" "${EVAL[@]}" "$@"
}
evaluate none --cross "$RUNS/none/cross"
against=(--against "$RUNS/eval-none.json")
evaluate all --cross "$RUNS/all/cross" "${against[@]}"
evaluate frozen --cross "$RUNS/frozen/cross" --knowledge-retriever "$RUNS/frozen/knowledge" "${against[@]}"
evaluate reciprocal --cross "$RUNS/reciprocal/cross" --knowledge-retriever "$RUNS/reciprocal/knowledge" \
  "${against[@]}" "$RUNS/eval-all.json" "$RUNS/eval-frozen.json"
evaluate reciprocal-withheld --cross "$RUNS/reciprocal/cross" --no-knowledge \
  --against "$RUNS/eval-reciprocal.json" "$RUNS/eval-none.json"
for f in "$RUNS"/eval-*.json; do n=$(basename "$f" .json); cp "$f" "$OUT/eval-grounded-${n#eval-}-$SCALE.json"; done
for f in "$RUNS"/eval-*.json; do
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); m=r['metrics']; print(r['meta']['name'], r['meta']['knowledge'], round(m['hits@1'],1), round(m['mrr'],1), r.get('against'))" "$f"
done
