#!/bin/bash
# The next session's first call, nothing carried, from a checkout staged with
#   KEEP="results/h200-2026-12-04-phase13 results/h200-2026-12-04-phase16 results/h200-2026-12-04-stored" \
#     HOLD=/work/hold bash results/h200-2026-12-04-phase13/scripts/stage.sh b
# First the GPU tests (the flex path, compiled on first use since 62e0574, and the loss kernel); then settle phase 16's slowdown (later processes 3-4x slower) and measure --pad-positions 128 (the block rows
# on flex attention's tile boundaries: 32% fewer partly seen tiles at phase 13's shapes, by count on CPU).
# Each run is train.train's loop (batch_sweep.py, 32 sequences, median of steps 9-48), with the GPU's SM
# clock, power and temperature sampled every 500 ms and its throttle reasons read before and after.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
# first the GPU tests of the flex path (compiled on first use since 62e0574, unrun on the H200) and the loss kernel
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rA -k \
  "flex_attention_on_cuda or head_kernel_on_cuda or compiled_head_chunk_on_cuda or compiled_training_follows_eager_on_cuda" \
  test_dflash.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests: rc $? at $(el)s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/gpu-tests.log | cut -c1-300 | tail -n 8
SWEEP=results/h200-2026-12-04-stored/scripts/batch_sweep.py
reasons() { nvidia-smi -q -d PERFORMANCE | grep -E "Active|Slowdown|Throttle|Cap|Clocks Event" | grep -v "Not Active" | tr -s ' ' | tr '\n' ';'; echo; }
run() {   # name, env and arguments after the batch
  local name=$1; shift
  echo "[$name] before: $(reasons)"
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu --format=csv,noheader \
    -lms 500 > $OUT/clocks-$name.csv 2>&1 & local sampler=$!
  env "$@" > /dev/null
  kill $sampler 2>/dev/null
  echo "[$name] after: $(reasons)"
  echo "[$name] at $(el)s: $(tail -n 1 $OUT/pace-$name.log)"
  awk -F', ' '{print $2}' $OUT/clocks-$name.csv | sort | uniq -c | sort -rn | head -n 3 | tr '\n' ' '; echo "(SM clock: samples)"
}
pace() {   # name, extra arguments
  local name=$1; shift
  timeout 120 python3 $SWEEP $OUT/pace-$name.json 32 "$@" 2>&1 | grep -v "^W1204\|^\s*$" \
    | grep -iv "warn\|online softmax\|split the reduction\|important use case\|softmax\.$" > $OUT/pace-$name.log
}
export -f pace; export OUT SWEEP
run 1-default bash -c "pace 1-default"
run 2-pad128 bash -c "pace 2-pad128 --pad-positions 128"
run 3-default bash -c "pace 3-default"
run 4-pad128 bash -c "pace 4-pad128 --pad-positions 128"
run 5-no-cache TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0 bash -c "pace 5-no-cache"
nvidia-smi -q -d PERFORMANCE,CLOCK,POWER,TEMPERATURE > $OUT/nvidia-smi-end.txt
