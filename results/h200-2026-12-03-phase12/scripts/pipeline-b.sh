#!/bin/bash
# Phase 12b (the first machine was lost with phase 12's run in its middle): one distill run over
# mix12-prompts.json.xz (mix_prompts.py: 16,000 of phase 11's turns, the code stubs, 11a's held-out turns
# last), each answered greedily and at T 0.8 (seed 91). Then two runs from phase 11a on these data with
# the same time budget, seed, schedule and a peak lr of 2e-4: (a) its 3 layers, (b) grown to 5 (two new
# layers at zero output). No evaluation: the held-out τ lines are the comparison. Outputs packed into
# $STASH/out; everything ends by the time in $STASH/end.
STASH=${STASH:-/root/stash}; cd $STASH/code
END=$(cat $STASH/end); T0=$(date +%s)
mkdir -p $STASH/logs $STASH/out
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
PACK_S=${PACK_S:-20}; ARM_S=${ARM_S:-45}   # ARM_S: a run's seconds outside its budget
left() { echo $(( END - $(date +%s) )); }
say() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s, $(left)s left] $*" >> $STASH/progress; }
pack() {   # the better run's weights in parts; everything small in one archive
  local w=$(cat $STASH/winner 2>/dev/null)
  [ -n "$w" ] && split -b 15000000 -d -a 1 $STASH/$w/model.safetensors $STASH/out/$w.safetensors.part \
    && sha256sum $STASH/$w/model.safetensors > $STASH/logs/sha256-$w
  mkdir -p $STASH/small
  for r in d12a d12b; do [ -e $STASH/$r/training.json ] && cp $STASH/$r/training.json $STASH/small/training-$r.json \
    && cp $STASH/$r/config.json $STASH/small/config-$r.json; done
  say "packed: $(ls $STASH/out $STASH/small | tr '\n' ' ')"
  cp $STASH/progress $STASH/pipeline.log $STASH/logs/ 2>/dev/null
  cp -r $STASH/logs $STASH/small/ && tar czf $STASH/out/small.tar.gz -C $STASH small
  touch $STASH/done
}
DIR=$(python3 train.py prepare-target 2> $STASH/logs/prepare.log) || { say "prepare-target failed: $(tail -n 2 $STASH/logs/prepare.log)"; pack; exit 4; }
say "target converted: $DIR"
timeout 200 python3 train.py distill --target $DIR --max-new-tokens 512 --batch-size 2048 --time-budget ${MIX_BUDGET:-100} \
  --prompts $STASH/mix12-prompts.json.xz --out $STASH/mix12.pt --num-prompts 20855 --temperatures 0 0.8 --seed 91 \
  --batches-per-save 4 2>&1 | tr '\r' '\n' | grep -v "^ *$" > $STASH/logs/distill-mix12.log
say "distill mix12: rc ${PIPESTATUS[0]}; $(grep -v 'answer/s\]$' $STASH/logs/distill-mix12.log | grep -vi warn | tail -n 1)"
BUDGET=$(( ($(left) - PACK_S - 2 * ARM_S) / 2 ))
arm() {   # name, extra args: one run from phase 11a with the shared budget
  local name=$1; shift
  say "train $name: --time-budget $BUDGET $*"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -s INT $(( BUDGET + 60 )) python3 train.py train --target $DIR \
    --data $STASH/mix12.pt --heldout 64 --out $STASH/$name --init $STASH/d11a --compile --batch-size 32 --anchors 128 \
    --heldout-tokens 256 --epochs 100 --eval-every 250 --lr 2e-4 --time-budget $BUDGET --cache-tokens 20000000 "$@" 2>&1 \
    | tr '\r' '\n' | awk 'NR % 100 == 0 || !/it\/s|s\/it|step\/s/' > $STASH/logs/train-$name.log
  say "train $name: rc ${PIPESTATUS[0]}; $(grep -v 'step/s\|warn\|Warn' $STASH/logs/train-$name.log | grep -v '^ *$' | tail -n 2 | tr '\n' ' ')"
}
arm d12a
arm d12b --layers 5
python3 - $STASH > $STASH/winner 2>> $STASH/logs/winner.log <<'PY'
import json, sys
from pathlib import Path
final = {}
for name in ("d12a", "d12b"):
    path = Path(sys.argv[1]) / name / "training.json"
    if path.exists():
        final[name] = json.loads(path.read_text())["history"][-1].get("heldout_tau", 0.0)
print(max(final, key=final.get) if final else "", end="")
print(f"final held-out τ: {final}", file=sys.stderr)
PY
say "better: $(cat $STASH/winner) ($(tail -n 1 $STASH/logs/winner.log))"
pack
