#!/bin/bash
# Phase 16's first full call (nothing carried; stage b with KEEP = phase 13, 15 and 16): the GPU tests of
# the head's loss kernel and of the compiled BlockMask (the flex attention tests build it now); the head
# loss chunk timed (head_probe.py); the training step profiled with this checkout's train.py and with
# 8d397be's (scripts/old/: eager BlockMask, inductor's head loss), one after the other; then the packed
# attention's variants (flex_probe.py).
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
HERE=results/h200-2026-12-04-phase16/scripts; P15=results/h200-2026-12-04-phase15/scripts
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rA -k \
  "head_kernel_on_cuda or compiled_head_chunk_on_cuda or flex_attention_on_cuda or compiled_training_follows_eager_on_cuda" \
  test_dflash.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests: rc $? at $(el)s"; grep -E "passed|failed|^FAILED|^ERROR|Error" $OUT/gpu-tests.log | cut -c1-300 | tail -n 12
timeout 90 python3 $HERE/head_probe.py $OUT/head-probe.json > $OUT/head-probe.log 2>&1
echo "head probe: rc $? at $(el)s"; grep -v "^\s*$" $OUT/head-probe.log | grep -iv warn | tail -n 16 | cut -c1-200
for code in new old; do
  extra=$([ $code = old ] && echo "--code $HERE/old")
  timeout 110 python3 $P15/step_profile.py $OUT/step-profile-$code.json $extra > $OUT/step-profile-$code.log 2>&1
  echo "step profile ($code): rc $? at $(el)s"; grep -v "^\s*$" $OUT/step-profile-$code.log | grep -iv warn | sed -n '1,12p' | cut -c1-200
done
timeout $(( 570 - $(el) )) python3 $HERE/flex_probe.py $OUT/flex-probe.json > $OUT/flex-probe.log 2>&1
echo "flex probe: rc $? at $(el)s"; grep -v "^\s*$" $OUT/flex-probe.log | grep -iv warn | tail -n 7 | cut -c1-250
