#!/bin/bash
# Phase 16's second call (nothing carried; stage b as for call3.sh): the GPU tests again, now that the
# packed forward's BlockMask is built from each row's intervals (packed_block_mask); then the training
# step profiled with this checkout's train.py and with 8d397be's (scripts/old/), one after the other.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
HERE=results/h200-2026-12-04-phase16/scripts; P15=results/h200-2026-12-04-phase15/scripts
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rA -k \
  "head_kernel_on_cuda or compiled_head_chunk_on_cuda or flex_attention_on_cuda or compiled_training_follows_eager_on_cuda" \
  test_dflash.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests: rc $? at $(el)s"; grep -E "passed|failed|^FAILED|^ERROR|Error" $OUT/gpu-tests.log | cut -c1-300 | tail -n 12
for code in new old; do
  extra=$([ $code = old ] && echo "--code $HERE/old")
  timeout 110 python3 $P15/step_profile.py $OUT/step-profile-$code.json $extra 2>&1 | grep -v "^W1204\|^\s*$" | grep -iv warn > $OUT/step-profile-$code.log
  echo "step profile ($code): at $(el)s"; sed -n '1,14p' $OUT/step-profile-$code.log | cut -c1-200
done
