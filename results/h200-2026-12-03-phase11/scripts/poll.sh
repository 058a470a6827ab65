#!/bin/bash
# Follow pipeline.sh for up to $1 seconds: print its progress as it grows; once it is done, copy its
# outputs to $OUT (calls 3 and 4 run this alone: bash poll.sh SECONDS).
STASH=${STASH:-/root/stash}; T0=$(date +%s); seen=0
[ -e $STASH/end ] || { echo "STASH LOST: no pipeline here"; ls -la $STASH; exit 5; }
while :; do
  n=$(wc -l < $STASH/progress 2>/dev/null || echo 0)
  [ "$n" -gt "$seen" ] && { sed -n "$((seen + 1)),${n}p" $STASH/progress; seen=$n; }
  if [ -e $STASH/done ]; then cp $STASH/out/* $OUT/ 2>/dev/null; ls -la $OUT; echo "pipeline done"; exit 0; fi
  [ $(( $(date +%s) - T0 )) -ge "$1" ] && break
  sleep 5
done
tail -n 3 $STASH/logs/train.log 2>/dev/null | tr '\r' '\n' | tail -n 2
echo "pipeline running; $(( $(cat $STASH/end) - $(date +%s) ))s to its end"
