#!/bin/bash
# Call 2 (after MAX_SPANS = 4 from call 1's sweep): fastpath's graphed GPU tests, then bench.py at Qwen3-8B's
# shapes with the kernels, then at SmolLM2-135M's in the time left.
T0=$(date +%s); left() { echo $(( ${END:-430} - $(date +%s) + T0 )); }
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu -k "fastpath_on_cuda_with_graphs or batch_decoder_on_cuda or step_loss" test_dflash.py \
  > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc=$? at $(( $(date +%s) - T0 ))s"; tail -4 $OUT/gpu-tests.log
timeout 250 python3 bench.py --shape qwen3-8b --skip dflash-ref,hf-eager,hf-static-compile --profile \
  --out $OUT/bench-qwen3-8b.json > $OUT/bench-qwen3-8b.log 2>&1; echo "bench rc=$? at $(( $(date +%s) - T0 ))s"
grep -E "^(fast|  fast)|layer,|profile:|floors" $OUT/bench-qwen3-8b.log
timeout $(( $(left) )) python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile,layers \
  --out $OUT/bench-smollm2-135m.json > $OUT/bench-smollm2-135m.log 2>&1; echo "bench rc=$? at $(( $(date +%s) - T0 ))s"
grep -E "^(fast|  fast)" $OUT/bench-smollm2-135m.log
