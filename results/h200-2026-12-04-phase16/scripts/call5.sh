#!/bin/bash
# Phase 16's third call (nothing carried; stage b with KEEP = phase 13, 15, 16 and h200-2026-12-04-stored):
# training's pace in train.train's own loop (../../h200-2026-12-04-stored/scripts/batch_sweep.py: 48 steps,
# median of steps 9-48, 32 sequences a step), this checkout's train.py, then 8d397be's (scripts/old/, put
# first on the path by running from there), then this checkout's again, and 8d397be's again; the host's load before each;
# then this checkout's under cProfile.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
ROOT=$PWD; SWEEP=$ROOT/results/h200-2026-12-04-stored/scripts/batch_sweep.py; OLD=$ROOT/results/h200-2026-12-04-phase16/scripts/old
nproc; for run in new-1 old-1 new-2 old-2; do
  dir=$([ ${run%-*} = old ] && echo $OLD || echo $ROOT); echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd $dir && PYTHONPATH=$ROOT timeout 150 python3 $SWEEP $OUT/pace-$run.json 32 2>&1 | grep -v "^W1204\|^\s*$" | grep -iv "warn\|online softmax\|split the reduction\|important use case\|softmax\.$" > $OUT/pace-$run.log)
  echo "pace ($run, $(cd $dir && PYTHONPATH=$ROOT python3 -c 'import train; print(train.__file__)')): at $(el)s"; tail -n 2 $OUT/pace-$run.log
done
# the same loop once more under cProfile (its pace is not comparable): where the host's time goes
load=$(cut -d' ' -f1-3 /proc/loadavg)
PYTHONPATH=$ROOT timeout 150 python3 -m cProfile -o $OUT/pace-new.prof $SWEEP $OUT/pace-new-profiled.json 32 > /dev/null 2>&1
echo "profiled at $(el)s (load before: $load)"
python3 -c "
import pstats; s = pstats.Stats('$OUT/pace-new.prof')
s.sort_stats('cumulative').print_stats(r'(train|dflash)\.py', 30); s.sort_stats('tottime').print_stats(25)" 2>&1 | cut -c1-170 > $OUT/pace-new-prof.txt
grep -E "train.py|dflash.py" $OUT/pace-new-prof.txt | head -n 22
