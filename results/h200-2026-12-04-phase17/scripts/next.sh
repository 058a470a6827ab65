#!/bin/bash
# The next session's first two calls, one right after the other (nothing carried): `bash next.sh a`, then
# `bash next.sh b` (within the 30 s the machine stays warm, so that b's loop runs as a later process on the
# same machine), from a checkout staged with
#   KEEP="results/h200-2026-12-04-phase13 results/h200-2026-12-04-phase16 results/h200-2026-12-04-phase17 \
#     results/h200-2026-12-04-stored" HOLD=/work/hold bash results/h200-2026-12-04-phase13/scripts/stage.sh b
# and 1ab4896's train.py and dflash.py put in scripts/old/ (from this folder, not kept in the tree):
#   mkdir -p old && for f in train.py dflash.py; do git show 1ab4896:$f > old/$f; done
# a1. GPU tests: the packed attention in two parts (dflash.attend_packed: flex attention over the context,
#     dense products within each block, joined by log-sum-exps; forward and gradients against the CPU's
#     float64, eager and compiled), compiled training, the loss kernel, fastpath's parts compiled against
#     eager on CUDA.
# a2. attention_probe.py: one layer's attention, one flex call against two parts, static and dynamic shapes.
# a3. train.train's loop (batch_sweep.py, 32 sequences): this code; then 1ab4896's (one flex call over
#     context and rows, RoPE tables inside the compiled graph) with the FX graph cache off.
# b1. step_profile.py (phase 15's: the step's kernels by group, and each part's host time), this code.
# b2. the loop with this code again (a later process: inductor's cache no longer slows it), and with
#     inductor's C++ wrapper (TORCHINDUCTOR_CPP_WRAPPER=1: kernels launched from C++, less host time).
# b3. with CACHE_PROBE=1: cache_probe.py with 1ab4896's code twice (a cache miss, then a hit), the kernels of
#     both profiled (phase 18 left it out: the cache is off in training, and device time was short).
# Each part packs what it made into one tar as it goes (a call returns at most 8 files); b's steps are
# skipped as the 600 s a call may run come near.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
D=results/h200-2026-12-04-phase17/scripts; SWEEP=results/h200-2026-12-04-stored/scripts/batch_sweep.py
W=$OUT/work; mkdir -p $W
quiet() { grep -Ev "^W[0-9]{4} |^\s*$" | grep -iv "warn\|online softmax\|split the reduction\|important use case\|softmax\.$"; }
sweep() {   # name, env..., then -- and batch_sweep's extra arguments
  local name=$1; shift; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout 110 python3 $SWEEP $W/$name.json 32 "$@" 2>&1 | quiet > $W/$name.log
  echo "[$name at $(el)s] $(tail -n 1 $W/$name.log)"
}
pack() { tar -C $OUT -cf $OUT/work-$PART.tar work; }   # after each step: what is done comes back if time runs out
PART=${1:?usage: next.sh a|b}
if [ $PART = a ]; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rA -k "flex_attention_on_cuda or compiled_training_follows_eager_on_cuda \
    or compiled_head_chunk_on_cuda or head_kernel_on_cuda or compiled_by_inductor_follow_eager_on_cuda" test_dflash.py > $OUT/gpu-tests.log 2>&1
  echo "gpu tests: rc $? at $(el)s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/gpu-tests.log | cut -c1-300 | tail -n 8
  timeout 150 python3 $D/attention_probe.py $W/attention-probe.json 2>&1 | quiet > $W/attention-probe.log
  echo "attention probe at $(el)s:"; tail -n 5 $W/attention-probe.log
  pack; sweep new-1 X=1 --
  pack; [ $(el) -lt 490 ] && sweep old-nocache PROBE_PATH=$D/old TORCHINDUCTOR_FX_GRAPH_CACHE=0 --
else
  timeout 150 python3 results/h200-2026-12-04-phase15/scripts/step_profile.py $W/step-profile.json 2>&1 | quiet > $W/step-profile.log
  echo "step profile at $(el)s:"; grep -A9 "^group" $W/step-profile.log; grep "^host\|^step" $W/step-profile.log | cut -c1-200
  pack; sweep new-2 X=1 --
  pack; sweep new-cpp-wrapper TORCHINDUCTOR_CPP_WRAPPER=1 --
  for run in $([ "$CACHE_PROBE" = 1 ] && echo 1-miss 2-hit); do
    pack; [ $(el) -lt 480 ] || break
    PROBE_PATH=$D/old timeout 90 python3 $D/cache_probe.py $W/old-$run 2>&1 | quiet > $W/old-$run.log
    echo "[old $run at $(el)s] $(tail -n 1 $W/old-$run.log)"
  done
fi
pack && rm -rf $W
