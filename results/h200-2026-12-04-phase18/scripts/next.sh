#!/bin/bash
# Phase 18's third call (nothing carried), from a checkout staged with
#   KEEP="results/h200-2026-12-04-phase13 results/h200-2026-12-04-phase15 results/h200-2026-12-04-phase18 \
#     results/h200-2026-12-04-stored" HOLD=/work/hold bash results/h200-2026-12-04-phase13/scripts/stage.sh b
# with phase 15's d15a/ (25 MB) moved to the hold too (phase 13 stays: stage.sh restore is there);
# and 82fcb78's train.py and dflash.py in scripts/head/ (from this folder, not kept in the tree):
#   mkdir -p head && for f in train.py dflash.py; do git show 82fcb78:$f > head/$f; done
# 1. train.train's loop (../../h200-2026-12-04-stored/scripts/batch_sweep.py, 32 sequences) with this code:
#    train.compile_drafter compiles the context's path (project_context, each layer's context_kv) too,
#    packed_forward makes one RoPE table per base for the context and the rows, FrozenHeadCrossEntropy
#    casts its rows once and joins the chunks' gradients once, and AdamW is fused (all since 49b43a7;
#    phase 15's step_profile.py in step 3 makes its own optimizer, foreach).
# 2. the same loop with 82fcb78's code (the drafter's forward compiled, the context's path eager).
# 3. phase 15's step_profile.py with this code: the step's kernels by group, host time by part. Its
#    groups now count the compiled own-row attention's logsumexp/logaddexp kernels under attention;
#    phase 18's table had them under the head's loss.
# 4. test_compiled_training_follows_eager_on_cuda (train --compile against eager, through compile_drafter)
#    and test_packed_forward_through_flex_attention_on_cuda (the packed forward against CPU float64).
# Each step packs what it made into work.tar as it goes; later steps are skipped as the time nears.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
D=results/h200-2026-12-04-phase18/scripts; SWEEP=results/h200-2026-12-04-stored/scripts/batch_sweep.py
W=$OUT/work; mkdir -p $W
quiet() { grep -Ev "^W[0-9]{4} |^\s*$" | grep -iv "warn\|online softmax\|split the reduction\|important use case\|softmax\.$"; }
pack() { tar -C $OUT -cf $OUT/work.tar work; }
sweep() {   # name, timeout, env..., then -- and batch_sweep's extra arguments
  local name=$1 limit=$2; shift 2; local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout $limit python3 $SWEEP $W/$name.json 32 "$@" 2>&1 | quiet > $W/$name.log
  echo "[$name at $(el)s] $(tail -n 1 $W/$name.log)"; pack
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
sweep context-compiled 220 X=1 --
[ $(el) -lt 270 ] && sweep context-eager 130 PROBE_PATH=$D/head --
if [ $(el) -lt 330 ]; then
  timeout 110 python3 results/h200-2026-12-04-phase15/scripts/step_profile.py $W/step-profile.json 2>&1 | quiet > $W/step-profile.log
  echo "step profile at $(el)s:"; grep -A9 "^group" $W/step-profile.log; grep "^host\|^step" $W/step-profile.log | cut -c1-250; pack
fi
if [ $(el) -lt 360 ]; then
  timeout $(( 420 - $(el) )) python3 -m pytest -q -m gpu -p no:cacheprovider -rA \
    -k "compiled_training_follows_eager_on_cuda or packed_forward_through_flex_attention_on_cuda" \
    test_dflash.py > $W/gpu-tests.log 2>&1
  echo "gpu test: rc $? at $(el)s"; grep -E "passed|failed|^FAILED|^ERROR" $W/gpu-tests.log | tail -n 3; pack
fi
