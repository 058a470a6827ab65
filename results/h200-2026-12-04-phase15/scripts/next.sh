#!/bin/bash
# One call, no GGUF, for the next session (nothing carried), from the checkout's root after
#   KEEP="results/h200-2026-12-04-phase13 results/h200-2026-12-04-phase15" HOLD=/work/hold \
#     bash results/h200-2026-12-04-phase13/scripts/stage.sh b
# (stage.sh restore after): the packed forward's flex attention tests on CUDA, sliding windows included
# (the window became a 0-dim tensor after phase 15's last call; unrun on the H200), compiled training;
# then the training step with its host parts timed (step_profile.py), to say where the GPU's ~19 ms a
# step of waiting goes; then the BlockMask built eagerly (today) against torch.compile(create_block_mask)
# (mask_probe.py: host ms, built ms, peak memory, same tiles).
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
HERE=results/h200-2026-12-04-phase15/scripts
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rA \
  -k "flex_attention_on_cuda or compiled_training_follows_eager_on_cuda" test_dflash.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests: rc $? at $(el)s"; grep -E "passed|failed|^FAILED|^ERROR|Error" $OUT/gpu-tests.log | cut -c1-300 | tail -n 12
timeout 150 python3 $HERE/step_profile.py $OUT/step-profile-flex.json > $OUT/step-profile-flex.log 2>&1
echo "step profile (flex): rc $? at $(el)s"; grep -v "^\s*$" $OUT/step-profile-flex.log | grep -iv warn | tail -n 20 | cut -c1-200
timeout 120 python3 $HERE/mask_probe.py $OUT/mask-probe.json > $OUT/mask-probe.log 2>&1
echo "mask probe: rc $? at $(el)s"; grep -v "^\s*$" $OUT/mask-probe.log | grep -iv warn | tail -n 4 | cut -c1-200
