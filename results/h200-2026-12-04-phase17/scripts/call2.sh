#!/bin/bash
# Phase 17, call 2 (a fresh machine, nothing carried, staged b): what an inductor cache hit does to
# train.train's loop. 1ab4896's train.py (scripts/old, the drafter compiled with inductor's caches on):
# cache_probe.py twice, so the second process finds the first's graphs. Then this commit's train.py
# (train.COMPILE: FX graph cache off) through batch_sweep.py twice, then with --pad-positions 128, and the
# compiled-training GPU tests. Stage b with KEEP phase 13, 16, 17 and h200-2026-12-04-stored; first put
# 1ab4896's train.py in scripts/old/ (mkdir -p old && git show 1ab4896:train.py > old/train.py, from scripts/).
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
D=results/h200-2026-12-04-phase17/scripts; SWEEP=results/h200-2026-12-04-stored/scripts/batch_sweep.py
quiet() { grep -Ev "^W[0-9]{4} |^\s*$" | grep -iv "warn\|online softmax\|split the reduction\|important use case\|softmax\.$"; }
for run in 1-miss 2-hit; do
  PROBE_PATH=$D/old timeout 150 python3 $D/cache_probe.py $OUT/old-$run 2>&1 | quiet | tail -n 2 | sed "s/^/[old $run at $(el)s] /"
done
for run in 1 2; do
  timeout 120 python3 $SWEEP $OUT/new-$run.json 32 2>&1 | quiet | tail -n 1 | sed "s/^/[new $run at $(el)s] /"
done
timeout 120 python3 $SWEEP $OUT/new-pad128.json 32 --pad-positions 128 2>&1 | quiet | tail -n 1 | sed "s/^/[new pad128 at $(el)s] /"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -k "compiled_training_follows_eager_on_cuda or compiled_head_chunk_on_cuda" \
  test_dflash.py > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc $? at $(el)s"; tail -n 1 $OUT/gpu-tests.log
