#!/bin/bash
# Call 3: bench.py before the kernels at Qwen3-8B's shapes, then the rest of the GPU tests.
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
(cd .carry/old && timeout 330 python3 bench.py --shape qwen3-8b --skip dflash-ref,hf-eager,hf-static-compile \
  --profile --out $OUT/before-bench-qwen3-8b.json > $OUT/before-bench-qwen3-8b.log 2>&1; echo "before bench rc=$?")
grep -E "^(fast|  fast)|per layer|layer,|profile:" $OUT/before-bench-qwen3-8b.log | head -12
timeout 240 python3 -m pytest -q -m gpu -k "not heads_kernel and not attend_upto_kernel and not fastpath_on_cuda_with_graphs" \
  test_dflash.py > $OUT/gpu-tests-2.log 2>&1; echo "gpu tests rc=$?"; tail -4 $OUT/gpu-tests-2.log
