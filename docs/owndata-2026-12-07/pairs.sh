#!/usr/bin/env bash
# §67-§68's pairs and pool in $1 (default /tmp/oc): ChatterBot's English conversations (bench/other_corpus.py),
# split alternately by conversation: 600 pairs to measure on (measure.jsonl); of the other 578, every fourth
# conversation validates (valid.jsonl, 138 pairs) and the rest train (train.jsonl, 440); replies.jsonl the
# pool. Needs `.venv/bin/pip install --no-deps chatterbot-corpus==1.3.3`. Used by §68's, §71's run.sh.
set -euo pipefail
W=${1:-/tmp/oc} PY=.venv/bin/python
mkdir -p "$W"
$PY bench/other_corpus.py --out "$W"
$PY - "$W" <<'PY'
import json, sys
w = sys.argv[1]
lines = open(f"{w}/pairs.jsonl").read().splitlines()
conv = [json.loads(line)["conversation_id"] for line in lines]
choose = set(sorted(set(conv))[::2])
valid = set(sorted(choose)[::4])
parts = {"measure": lambda c: c not in choose, "valid": lambda c: c in valid,
         "train": lambda c: c in choose and c not in valid}
for name, keep in parts.items():
    open(f"{w}/{name}.jsonl", "w").writelines(line + "\n" for line, c in zip(lines, conv) if keep(c))
PY
