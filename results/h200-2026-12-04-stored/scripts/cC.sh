#!/bin/bash
# Call C (carries .carry/b, after stage.sh b): join and check the GGUF, install gguf and the evaluation
# sets, convert the target, evaluate the shipped drafter on all 244 prompts, then (GPU_TEST) the GPU tests
# that -k selects and (unless NO_SWEEP) batch_sweep.py.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash; HERE=results/h200-2026-12-04-stored
for f in g0 drafter/model.safetensors drafter/config.json; do
  [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
STASH=$STASH bash results/h200-2026-12-04-phase13/scripts/site.sh || exit $?
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1
DIR=$(python3 train.py prepare-target 2> $OUT/prepare.log) || { tail -n 3 $OUT/prepare.log; exit 4; }
echo "target converted at $(el)s: $DIR"
timeout ${EVAL_S:-300} python3 evaluation.py --target $DIR --draft $STASH/drafter --impl fastpath --out $OUT/eval \
  2>&1 | tr '\r' '\n' | grep -v "Warn\|warn\|prompt/s" > $OUT/eval.log
echo "eval: rc ${PIPESTATUS[0]} at $(el)s"; tail -n 5 $OUT/eval.log
[ -n "$GPU_TEST" ] && { timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rA -s -k "$GPU_TEST" test_dflash.py > $OUT/gpu-tests.log 2>&1;
  echo "gpu tests: rc $? at $(el)s"; grep -E "passed|failed|row verify" $OUT/gpu-tests.log | cut -c1-300 | tail -n 6; }
[ -n "$NO_SWEEP" ] || { timeout $(( ${END_S:-580} - $(el) )) python3 $HERE/scripts/batch_sweep.py $OUT/batch-sweep.json ${BATCHES:-32 64 128} > $OUT/batch-sweep.log 2>&1
  echo "batch sweep: rc $? at $(el)s"; grep -iv warn $OUT/batch-sweep.log | tail -n 12; }
