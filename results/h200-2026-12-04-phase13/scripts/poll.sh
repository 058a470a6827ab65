#!/bin/bash
# Follow pipeline.sh for up to $1 seconds: print its progress as it grows; once it is done, copy its
# outputs to $OUT (the calls after c2.sh run this alone: bash poll.sh SECONDS); while it runs, bring back
# every run's training.json and the snapshot of the latest run (train saves one at each held-out estimate).
# NEW: the runs' prefix, as pipeline.sh was given it (default d13).
STASH=${STASH:-/root/stash}; T0=$(date +%s); seen=0
[ -e $STASH/end ] || { echo "STASH LOST: no pipeline here"; ls -la $STASH; exit 5; }
while :; do
  n=$(wc -l < $STASH/progress 2>/dev/null || echo 0)
  [ "$n" -gt "$seen" ] && { sed -n "$((seen + 1)),${n}p" $STASH/progress; seen=$n; }
  if [ -e $STASH/done ]; then cp $STASH/out/* $OUT/ 2>/dev/null; ls -la $OUT; echo "pipeline done"; exit 0; fi
  [ $(( $(date +%s) - T0 )) -ge "$1" ] && break
  sleep 5
done
L=$(ls -t $STASH/logs/train-*.log 2>/dev/null | head -n 1); [ -n "$L" ] && tail -n 2 $L
echo "pipeline running; $(( $(cat $STASH/end) - $(date +%s) ))s to its end"
for R in $STASH/${NEW:-d13}?; do [ -e $R/training.json ] && cp $R/training.json $OUT/training-$(basename $R).json; done   # every run's line
D=$(ls -td $STASH/${NEW:-d13}? 2>/dev/null | head -n 1)
if [ -n "$D" ] && [ -e $D/model.safetensors ]; then
  cp $D/training.json $OUT/training-$(basename $D).json && cp $D/config.json $OUT/config-$(basename $D).json
  split -b 15000000 -d -a 1 $D/model.safetensors $OUT/snapshot-$(basename $D).safetensors.part
  python3 -c "import json; h=json.load(open('$D/training.json'))['history']; print('$D snapshot at step', len(h), h[-1].get('heldout_tau'))"
fi
