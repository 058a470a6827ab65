#!/bin/bash
# Call 2: bench.py at Qwen3-8B's shapes with the kernels, then fastpath's graphed GPU tests in the time left.
T0=$(date +%s); left() { echo $(( ${END:-585} - $(date +%s) + T0 )); }
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
timeout 330 python3 bench.py --shape qwen3-8b --skip dflash-ref,hf-eager,hf-static-compile --profile \
  --out $OUT/bench-qwen3-8b.json > $OUT/bench-qwen3-8b.log 2>&1; echo "bench rc=$? at $(( $(date +%s) - T0 ))s"
grep -E "^(fast|  fast)|layer,|profile:|floors" $OUT/bench-qwen3-8b.log
timeout $(( $(left) - 5 )) python3 -m pytest -q -m gpu -k "not heads_kernel and not attend_upto_kernel" test_dflash.py \
  > $OUT/gpu-tests.log 2>&1; echo "gpu tests rc=$? at $(( $(date +%s) - T0 ))s"; tail -6 $OUT/gpu-tests.log
