#!/bin/bash
# Phase 11 on the H200, in a session of its own (c2.sh starts it; calls 3 and 4 follow it with poll.sh):
# convert the target; 50,000 new turns that SmolLM2 writes itself (seed 71), answered greedily; every
# stub greedy and at T 0.8; the greedy answers to phase 10a's held-out turns; then one long training run
# from phase 10a (one cosine schedule, every feature cached once); the evaluation on all 244 prompts;
# the outputs packed into $STASH/out. Everything ends by the time in $STASH/end.
STASH=${STASH:-/root/stash}; cd $STASH/code
END=$(cat $STASH/end); T0=$(date +%s)
mkdir -p $STASH/logs $STASH/out
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
EVAL_S=${EVAL_S:-250}; PACK_S=${PACK_S:-30}
left() { echo $(( END - $(date +%s) )); }
say() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s, $(left)s left] $*" >> $STASH/progress; }
pack() {
  [ -e $STASH/d11a/model.safetensors ] && split -b 15000000 -d -a 1 $STASH/d11a/model.safetensors $STASH/out/model.safetensors.part \
    && sha256sum $STASH/d11a/model.safetensors > $STASH/logs/sha256 && cp $STASH/d11a/training.json $STASH/d11a/config.json $STASH/out/
  [ -e $STASH/eval11a/eval.json ] && cp $STASH/eval11a/eval.json $STASH/out/eval-h200.json && cp $STASH/eval11a/eval.png $STASH/out/eval-h200.png
  cp $STASH/self11-prompts.json.xz $STASH/out/ 2>/dev/null
  say "packed: $(ls $STASH/out | tr '\n' ' ')"
  cp $STASH/progress $STASH/pipeline.log $STASH/logs/ 2>/dev/null
  tar czf $STASH/out/logs.tar.gz -C $STASH logs
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
timeout 160 python3 train.py prompts --source self --target $DIR --out $STASH/self11-prompts.json.xz --num-prompts ${NSELF:-50000} \
  --batch-size 2048 --temperature 1.0 --seed 71 > $STASH/logs/prompts-self.log 2>&1
say "prompts self: rc $?; $(grep -vi warn $STASH/logs/prompts-self.log | tail -n 1)"
distill code 30 --prompts $STASH/code-prompts.json.xz --out $STASH/code11.pt --num-prompts ${NCODE:-4790} --temperatures 0 0.8 \
  --seed 72 --batches-per-save 2
distill self10h 20 --prompts $STASH/self10-prompts.json.xz --out $STASH/self10h.pt --skip-prompts 49935 --num-prompts 65 \
  --temperatures 0 --seed 73
distill self11 ${SELF_BUDGET:-110} --prompts $STASH/self11-prompts.json.xz --out $STASH/self11.pt --num-prompts ${NSELF:-50000} \
  --temperatures 0 --seed 74 --batches-per-save 8
train() {   # cache tokens; the schedule fits what is left after the evaluation and the packing
  local tb=$(( $(left) - EVAL_S - PACK_S - 45 ))
  say "train: --time-budget $tb --cache-tokens $1"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -s INT $(( tb + 40 )) python3 train.py train --target $DIR \
    --data $STASH/self11.pt $STASH/code11.pt $STASH/self10h.pt --out $STASH/d11a --init $STASH/d10a ${COMPILE---compile} \
    --batch-size 32 --anchors 128 --heldout 64 32 64 --heldout-tokens 256 --epochs 100 --eval-every 500 \
    --time-budget $tb --cache-tokens $1 2>&1 | tr '\r' '\n' | awk 'NR % 100 == 0 || !/it\/s|s\/it|step\/s/' > $STASH/logs/train.log
  say "train: rc ${PIPESTATUS[0]}; $(grep -v 'step/s\|warn\|Warn' $STASH/logs/train.log | grep -v '^ *$' | tail -n 2 | tr '\n' ' ')"
}
train ${CACHE_TOKENS:-20000000}
if [ ! -e $STASH/d11a/model.safetensors ] && [ $(left) -gt $(( EVAL_S + PACK_S + 240 )) ]; then
  train 9000000   # the fallback, should the one-shard cache not fit
fi
if [ -e $STASH/d11a/model.safetensors ]; then
  timeout $(( $(left) - PACK_S )) python3 evaluation.py --target $DIR --draft $STASH/d11a --impl fastpath ${EVAL_LIMIT:+--limit $EVAL_LIMIT} --out $STASH/eval11a \
    2>&1 | tr '\r' '\n' | grep -v "Warn\|warn\|prompt/s" > $STASH/logs/eval.log
  say "eval: rc ${PIPESTATUS[0]}; $(tail -n 4 $STASH/logs/eval.log | tr '\n' ' ')"
fi
pack
