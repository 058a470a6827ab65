#!/bin/bash
# Phase 16's calls 3 and 4 (nothing carried; stage b with KEEP = phase 13, 15 and 16). PARTS picks what
# runs, in this order (call 3: all; call 4: PARTS="tests profiles"):
#   tests     the GPU tests of the head's loss kernel, of the packed forward through flex attention (which
#             builds the BlockMask) and of compiled training
#   head      the head loss chunk timed (head_probe.py)
#   profiles  the training step profiled with this checkout's train.py and with 8d397be's (scripts/old/:
#             eager BlockMask, inductor's head loss), one after the other
#   flex      the packed attention's variants (flex_probe.py)
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
HERE=results/h200-2026-12-04-phase16/scripts; P15=results/h200-2026-12-04-phase15/scripts
PARTS=" ${PARTS:-tests head profiles flex} "
if [[ $PARTS == *" tests "* ]]; then
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rA -k \
    "head_kernel_on_cuda or compiled_head_chunk_on_cuda or flex_attention_on_cuda or compiled_training_follows_eager_on_cuda" \
    test_dflash.py > $OUT/gpu-tests.log 2>&1
  echo "gpu tests: rc $? at $(el)s"; grep -E "passed|failed|^FAILED|^ERROR|Error" $OUT/gpu-tests.log | cut -c1-300 | tail -n 12
fi
if [[ $PARTS == *" head "* ]]; then
  timeout 90 python3 $HERE/head_probe.py $OUT/head-probe.json > $OUT/head-probe.log 2>&1
  echo "head probe: rc $? at $(el)s"; grep -v "^\s*$" $OUT/head-probe.log | grep -iv warn | tail -n 16 | cut -c1-200
fi
if [[ $PARTS == *" profiles "* ]]; then
  for code in new old; do
    extra=$([ $code = old ] && echo "--code $HERE/old")
    timeout 110 python3 $P15/step_profile.py $OUT/step-profile-$code.json $extra 2>&1 | grep -v "^W1204\|^\s*$" | grep -iv warn > $OUT/step-profile-$code.log
    echo "step profile ($code): at $(el)s"; sed -n '1,14p' $OUT/step-profile-$code.log | cut -c1-200
  done
fi
if [[ $PARTS == *" flex "* ]]; then
  timeout $(( 570 - $(el) )) python3 $HERE/flex_probe.py $OUT/flex-probe.json > $OUT/flex-probe.log 2>&1
  echo "flex probe: rc $? at $(el)s"; grep -v "^\s*$" $OUT/flex-probe.log | grep -iv warn | tail -n 7 | cut -c1-250
fi
