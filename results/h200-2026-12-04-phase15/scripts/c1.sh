#!/bin/bash
# Phase 15, call 1 (carries .carry/a), from the checkout's root after
#   KEEP="results/h200-2026-12-04-phase13 results/h200-2026-12-04-phase15" HOLD=/work/hold \
#     bash results/h200-2026-12-04-phase13/scripts/stage.sh b
# Stash GGUF part 1, 14a's weights (as d14a) and the prompt files for phase 13's c2.sh, which must follow
# at once; the GPU tests of the packed forward through flex attention and of compiled training; then a
# training step profiled (step_profile.py) with the packed forward through flex attention and as it was
# (old/: train.py and dflash.py before it), one after the other.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
HERE=results/h200-2026-12-04-phase15/scripts
mkdir -p /root/stash && cp .carry/a/g0 .carry/a/*.json.xz /root/stash/ && cp -r .carry/a/drafter /root/stash/d14a \
  && echo "stashed at $(el)s: $(ls /root/stash | tr '\n' ' ')"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rA \
  -k "flex_attention_on_cuda or compiled_training_follows_eager_on_cuda" test_dflash.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests: rc $? at $(el)s"; grep -E "passed|failed|^FAILED|^ERROR|Error" $OUT/gpu-tests.log | cut -c1-300 | tail -n 12
TORCH_LOGS=recompiles timeout 150 python3 $HERE/step_profile.py $OUT/step-profile-flex.json > $OUT/step-profile-flex.log 2>&1
echo "step profile (flex): rc $? at $(el)s; lines naming a recompile: $(grep -ci recompil $OUT/step-profile-flex.log)"
grep -v "^\s*$" $OUT/step-profile-flex.log | grep -iv "warn\|recompil" | tail -n 18 | cut -c1-160
timeout 120 python3 $HERE/step_profile.py $OUT/step-profile-groups.json --code $HERE/old > $OUT/step-profile-groups.log 2>&1
echo "step profile (groups, before): rc $? at $(el)s"; grep -v "^\s*$" $OUT/step-profile-groups.log | grep -iv warn | tail -n 16 | cut -c1-160
