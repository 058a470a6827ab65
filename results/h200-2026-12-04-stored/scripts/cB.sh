#!/bin/bash
# Call B (carries .carry/a, after stage.sh a): stash GGUF part g0 and the shipped drafter for call C (which
# must follow within 30 s); the graphed GPU tests again (the draft part's positions now stored too), then
# bench.py at Qwen3-8B's size with the step profiles, then at SmolLM2's in the time left.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash; mkdir -p $STASH
cp .carry/a/g0 $STASH/ && cp -r drafter/SmolLM2-135M-Instruct-DFlash-b16 $STASH/drafter || exit 5
ls -la $STASH $STASH/drafter; echo "stashed at $(el)s"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rA -s -k "graphed_step or fastpath_on_cuda_with_graphs" \
  test_dflash.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests: rc $? at $(el)s"; grep -E "passed|failed|^FAILED|^ERROR|row (draft|verify)" $OUT/gpu-tests.log | cut -c1-400 | tail -n 14
timeout 300 python3 bench.py --shape qwen3-8b --skip dflash-ref,hf-eager,hf-static-compile,layers --profile \
  --out $OUT/bench-qwen3-8b.json > $OUT/bench-qwen3-8b.log 2>&1
echo "bench qwen3-8b: rc $? at $(el)s"; grep -E "^(fast|  fast)|profile:|floors" $OUT/bench-qwen3-8b.log
timeout $(( ${END_S:-570} - $(el) )) python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile,layers \
  --profile --out $OUT/bench-smollm2-135m.json > $OUT/bench-smollm2-135m.log 2>&1
echo "bench smollm2: rc $? at $(el)s"; grep -E "^(fast|  fast)|profile:|floors" $OUT/bench-smollm2-135m.log
