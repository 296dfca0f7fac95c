#!/usr/bin/env bash
# docs/results.md §67: the built-in models over a pool with no pairs to choose on, over ChatterBot's
# English conversations and over chitchat's own pool given as a file.
# From the repository root, after `make install` and `.venv/bin/pip install --no-deps chatterbot-corpus==1.3.3`.
set -euo pipefail
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
D=docs/othercorpus-2026-12-07 W=${WORK:-/tmp/othercorpus} C=${CHITCHAT:-/tmp/cc}
PY=.venv/bin/python
mkdir -p "$W" "$C"

# ChatterBot: its pairs (each distinct one once) and replies, 13 variants and zero-shot, as served
$PY bench/other_corpus.py --out "$W"
.venv/bin/coreply index build --pool "$W/replies.jsonl" -o "$W/zero-shot" --bi zero-shot
$PY $D/variants.py "$W/replies.jsonl" "$W" bi-bare bi-prior bi-guard bi-judge bi-words bi-lexical bi-pins \
    bi-pins-prior two-bare two-prior-zscore two-prior-sum two-pins two-pins-prior
$PY bench/as_served.py --pairs "$W/pairs.jsonl" --out $D/chatterbot.json.gz --bundles "$W/bi-bare" \
    "$W/zero-shot" "$W/bi-prior" "$W/bi-guard" "$W/bi-judge" "$W/bi-words" "$W/bi-lexical" "$W/bi-pins" \
    "$W/bi-pins-prior" "$W/two-bare" "$W/two-prior-zscore" "$W/two-prior-sum" "$W/two-pins" "$W/two-pins-prior"

# chitchat's pool as a file (no pairs), the first 2,000 test pairs
$PY -c "import json, sys; from coreply.corpus import load_chitchat, responses_of; \
    sys.stdout.writelines(json.dumps({'text': t}) + '\n' for t in responses_of(load_chitchat()))" > "$C/pool.jsonl"
$PY $D/variants.py "$C/pool.jsonl" "$C" two-bare bi-bare bi-prior two-prior-zscore two-prior-sum two-pins
$PY bench/as_served.py --bundles "$C/two-bare" "$C/bi-bare" "$C/bi-prior" "$C/two-prior-zscore" \
    "$C/two-prior-sum" "$C/two-pins" --measure test:0:2000 --out $D/chitchat.json.gz

# ChatterBot with pairs: its conversations alternately to choose on (--queries) and to measure on
$PY -c "import json, sys; lines = open(sys.argv[1]).read().splitlines(); \
    ids = sorted({json.loads(l)['conversation_id'] for l in lines}); half = set(ids[::2]); \
    open(sys.argv[2], 'w').writelines(l + '\n' for l in lines if json.loads(l)['conversation_id'] in half); \
    open(sys.argv[3], 'w').writelines(l + '\n' for l in lines if json.loads(l)['conversation_id'] not in half)" \
    "$W/pairs.jsonl" "$W/choose.jsonl" "$W/measure.jsonl"
.venv/bin/coreply index build --pool "$W/replies.jsonl" -o "$W/no-pairs" --bi builtin --cross builtin
.venv/bin/coreply index build --pool "$W/replies.jsonl" -o "$W/queries-bi" --bi builtin --queries "$W/choose.jsonl"
.venv/bin/coreply index build --pool "$W/replies.jsonl" -o "$W/queries-two" --bi builtin --cross builtin \
    --queries "$W/choose.jsonl"
$PY bench/as_served.py --pairs "$W/measure.jsonl" --out $D/chatterbot-queries.json.gz --bundles "$W/bi-bare" \
    "$W/bi-prior" "$W/no-pairs" "$W/queries-bi" "$W/queries-two"
