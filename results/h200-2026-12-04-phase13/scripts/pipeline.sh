#!/bin/bash
# Phase 13 on the H200, in a session of its own (c2.sh starts it; the calls after it follow it with poll.sh):
# convert the target; NSELF new turns that SmolLM2 writes itself (seed 91), each answered greedily and at
# T 0.8; the code stubs greedy and at T 0.8 (seed 92); the greedy answers to phase 11a's and 10a's held-out
# turns (the same held-out sets, so the lines continue). Then two runs from phase 11a on these data with
# the same time budget, seed and schedule (peak lr LR): (a) its 3 layers, (b) grown to 5 (two new layers at
# zero output). The one with the higher held-out τ on the everyday turns is evaluated on all 244 prompts,
# if it beats 11a's 3.057 there. The outputs are packed into $STASH/out. Everything ends by $STASH/end.
# Another phase sets (environment; the defaults are phase 13's): INIT (the stashed drafter it starts from),
# START_TAU (INIT's held-out τ on 11a's everyday turns), NEW (the runs' prefix: NEW a, NEW b), SELF_SEED,
# CODE_SEED, ANSWER_SEED, NSELF, LR, ARGS_B (run (b)'s extra arguments; none: no run (b)), and the
# seconds for the new turns and their answers, PROMPTS_S and SELF_BUDGET.
STASH=${STASH:-/root/stash}; cd $STASH/code
END=$(cat $STASH/end); T0=$(date +%s)
mkdir -p $STASH/logs $STASH/out
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
EVAL_S=${EVAL_S:-240}; PACK_S=${PACK_S:-20}; ARM_S=${ARM_S:-45}   # ARM_S: a run's seconds outside its budget
NSELF=${NSELF:-16000}; LR=${LR:-3e-4}; START_TAU=${START_TAU:-3.057}   # 11a on its held-out turns, read at init in phase 12
INIT=${INIT:-d11a}; NEW=${NEW:-d13}; ARGS_B=${ARGS_B:---layers 5}
SELF_SEED=${SELF_SEED:-91}; CODE_SEED=${CODE_SEED:-92}; ANSWER_SEED=${ANSWER_SEED:-94}
left() { echo $(( END - $(date +%s) )); }
say() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s, $(left)s left] $*" >> $STASH/progress; }
pack() {   # the winner's weights in parts; everything small in one archive (a call brings back 8 files)
  local w=$(cat $STASH/winner 2>/dev/null)
  [ -n "$w" ] && split -b 15000000 -d -a 1 $STASH/$w/model.safetensors $STASH/out/$w.safetensors.part \
    && sha256sum $STASH/$w/model.safetensors > $STASH/logs/sha256-$w
  mkdir -p $STASH/small
  for r in ${NEW}a ${NEW}b; do [ -e $STASH/$r/training.json ] && cp $STASH/$r/training.json $STASH/small/training-$r.json \
    && cp $STASH/$r/config.json $STASH/small/config-$r.json; done
  [ -e $STASH/eval${NEW#d}/eval.json ] && cp $STASH/eval${NEW#d}/eval.json $STASH/small/eval-h200.json && cp $STASH/eval${NEW#d}/eval.png $STASH/small/eval-h200.png
  cp $STASH/self${NEW#d}-prompts.json.xz $STASH/small/ 2>/dev/null
  say "packed: $(ls $STASH/out $STASH/small | tr '\n' ' ')"
  cp $STASH/progress $STASH/pipeline.log $STASH/logs/ 2>/dev/null
  cp -r $STASH/logs $STASH/small/ && tar czf $STASH/out/small.tar.gz -C $STASH small
  touch $STASH/done
}
DIR=$(python3 train.py prepare-target 2> $STASH/logs/prepare.log) || { say "prepare-target failed: $(tail -n 2 $STASH/logs/prepare.log)"; pack; exit 4; }
say "target converted: $DIR"
distill() {   # name, budget, args...
  local name=$1 budget=$2; shift 2
  timeout $(( budget + 90 )) python3 train.py distill --target $DIR --max-new-tokens 512 --batch-size 2048 \
    --time-budget $budget "$@" 2>&1 | tr '\r' '\n' | grep -v "^ *$" > $STASH/logs/distill-$name.log
  say "distill $name: rc ${PIPESTATUS[0]}; $(grep -v 'answer/s\]$' $STASH/logs/distill-$name.log | grep -vi warn | tail -n 1)"
}
timeout ${PROMPTS_S:-120} python3 train.py prompts --source self --target $DIR --out $STASH/self${NEW#d}-prompts.json.xz --num-prompts $NSELF \
  --batch-size 2048 --temperature 1.0 --seed $SELF_SEED > $STASH/logs/prompts-self.log 2>&1
say "prompts self: rc $?; $(grep -vi warn $STASH/logs/prompts-self.log | tail -n 1)"
distill code 40 --prompts $STASH/code-prompts.json.xz --out $STASH/code${NEW#d}.pt --num-prompts 4790 --temperatures 0 0.8 \
  --seed $CODE_SEED --batches-per-save 2
distill self11h 20 --prompts $STASH/self11-prompts.json.xz --out $STASH/self11h.pt --skip-prompts 49935 --num-prompts 65 \
  --temperatures 0 --seed 83
distill self10h 20 --prompts $STASH/self10-prompts.json.xz --out $STASH/self10h.pt --skip-prompts 49935 --num-prompts 65 \
  --temperatures 0 --seed 73
distill self${NEW#d} ${SELF_BUDGET:-110} --prompts $STASH/self${NEW#d}-prompts.json.xz --out $STASH/self${NEW#d}.pt --num-prompts $NSELF \
  --temperatures 0 0.8 --seed $ANSWER_SEED --batches-per-save 8
ARMS=$([ "$ARGS_B" = none ] && echo 1 || echo 2)   # ARGS_B=none: run (a) alone, with the whole budget
BUDGET=$(( ($(left) - EVAL_S - PACK_S - ARMS * ARM_S) / ARMS ))
say "data done; each run gets --time-budget $BUDGET"
arm() {   # name, extra args: one run from INIT with the shared budget
  local name=$1; shift
  say "train $name: --time-budget $BUDGET --lr $LR $*"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -s INT $(( BUDGET + 60 )) python3 train.py train --target $DIR \
    --data $STASH/self11h.pt $STASH/self${NEW#d}.pt $STASH/code${NEW#d}.pt $STASH/self10h.pt --heldout 64 0 32 64 --out $STASH/$name \
    --init $STASH/$INIT --compile --batch-size 32 --anchors 128 --heldout-tokens 256 --epochs 100 --eval-every 500 \
    --lr $LR --time-budget $BUDGET --cache-tokens ${CACHE_TOKENS:-20000000} "$@" 2>&1 | tr '\r' '\n' \
    | awk 'NR % 100 == 0 || !/it\/s|s\/it|step\/s/' > $STASH/logs/train-$name.log
  say "train $name: rc ${PIPESTATUS[0]}; $(grep -v 'step/s\|warn\|Warn' $STASH/logs/train-$name.log | grep -v '^ *$' | tail -n 2 | tr '\n' ' ')"
}
arm ${NEW}a
[ $ARMS = 2 ] && arm ${NEW}b $ARGS_B
python3 - $STASH $START_TAU $NEW > $STASH/winner 2>> $STASH/logs/winner.log <<'PY'
import json, sys
from pathlib import Path
final = {}
for name in (sys.argv[3] + "a", sys.argv[3] + "b"):
    path = Path(sys.argv[1]) / name / "training.json"
    if path.exists():
        final[name] = json.loads(path.read_text())["history"][-1].get("heldout_tau", 0.0)
best = max(final, key=final.get) if final else ""
print(best if best and final[best] > float(sys.argv[2]) else "", end="")
print(f"final held-out τ on the everyday turns: {final}; the start's: {sys.argv[2]}", file=sys.stderr)
PY
say "winner over $INIT: '$(cat $STASH/winner)' ($(tail -n 1 $STASH/logs/winner.log))"
W=$(cat $STASH/winner)
if [ -n "$W" ]; then
  timeout $(( $(left) - PACK_S )) python3 evaluation.py --target $DIR --draft $STASH/$W --impl fastpath --out $STASH/eval${NEW#d} \
    2>&1 | tr '\r' '\n' | grep -v "Warn\|warn\|prompt/s" > $STASH/logs/eval.log
  say "eval $W: rc ${PIPESTATUS[0]}; $(tail -n 4 $STASH/logs/eval.log | tr '\n' ' ')"
fi
pack
