#!/bin/bash
# One call, no GGUF, for the next session, from the checkout's root after
#   KEEP="results/h200-2026-12-04-phase13 results/h200-2026-12-04-phase14 results/h200-2026-12-04-stored" \
#     HOLD=/work/hold bash results/h200-2026-12-04-phase13/scripts/stage.sh a
# (a tree of about 55 MB; carry nothing; the same stage.sh restore after): where a training step's
# time goes (step_profile.py, argmax and --soft), the packed forward's attention against flex attention
# (attention_probe.py), then ../../h200-2026-12-04-stored/stored-fresh.patch applied here and put to
# the H200: its CUDA test, the graphed tests, bench.py at SmolLM2's size with the step profile.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
HERE=results/h200-2026-12-04-phase14/scripts
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
for kind in ${KINDS:-argmax soft}; do
  timeout 120 python3 results/h200-2026-12-04-phase15/scripts/step_profile.py $OUT/step-profile-$kind.json $([ $kind = soft ] && echo --soft) \
    > $OUT/step-profile-$kind.log 2>&1
  echo "step profile ($kind): rc $? at $(el)s"; grep -v "^\s*$" $OUT/step-profile-$kind.log | grep -iv warn | tail -n 16
done
timeout 90 python3 $HERE/attention_probe.py $OUT/attention-probe.json --device cuda > $OUT/attention-probe.log 2>&1
echo "attention probe: rc $? at $(el)s"; grep -v "^\s*$" $OUT/attention-probe.log | grep -iv warn | tail -n 4
patch -p1 < results/h200-2026-12-04-stored/stored-fresh.patch || { echo "patch did not apply"; exit 3; }
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rA -s \
  -k "compiled_by_inductor_follow_eager_on_cuda or graphed_verify or fastpath_on_cuda_with_graphs" test_dflash.py \
  > $OUT/gpu-tests.log 2>&1
echo "gpu tests (stored-fresh): rc $? at $(el)s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/gpu-tests.log | cut -c1-300 | tail -n 12
LEFT=$(( ${END_S:-575} - $(el) )); [ $LEFT -gt 30 ] || { echo "no time left for the bench"; exit 0; }
timeout $LEFT python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile,layers \
  --profile --out $OUT/bench-smollm2-135m.json > $OUT/bench-smollm2-135m.log 2>&1
echo "bench smollm2 (stored-fresh): rc $? at $(el)s"; grep -E "^(fast|  fast)|profile:|floors" $OUT/bench-smollm2-135m.log
