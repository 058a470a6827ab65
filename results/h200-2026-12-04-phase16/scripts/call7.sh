#!/bin/bash
# Phase 16's last call, on a fresh machine: 8d397be's train.py first (the first run on a machine is the
# clean one, calls 5 and 6), then what runs on the host afterwards, then this checkout's.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
ROOT=$PWD; SWEEP=$ROOT/results/h200-2026-12-04-stored/scripts/batch_sweep.py; OLD=$ROOT/results/h200-2026-12-04-phase16/scripts/old
top() { echo "load $(cut -d' ' -f1-3 /proc/loadavg); busiest:"; ps -eo pcpu,etimes,comm,args --sort=-pcpu | head -n 6 | cut -c1-150; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; }
for run in old-first new-second; do
  top
  dir=$([ ${run%-*} = old ] && echo $OLD || echo $ROOT)
  (cd $dir && PYTHONPATH=$ROOT timeout 120 python3 $SWEEP $OUT/pace-$run.json 32 2>&1 | grep -v "^W1204\|^\s*$" | grep -iv "warn\|online softmax\|split the reduction\|important use case\|softmax\.$" > $OUT/pace-$run.log)
  echo "pace ($run): at $(el)s"; tail -n 1 $OUT/pace-$run.log
done
top
