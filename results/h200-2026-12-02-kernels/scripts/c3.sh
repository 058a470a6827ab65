#!/bin/bash
# Call 3: the GPU exactness tests of what the fused linear touches, then the SmolLM2-135M bench
# (fused and plain torch side by side, per-layer profiles, the step's profile).
export TORCHINDUCTOR_CACHE_DIR=/root/stash/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p /root/stash $OUT/logs
timeout 210 python3 -m pytest -p no:logging -m gpu test_dflash.py -rA -q \
  -k "linear_kernel_on_cuda or fastpath_on_cuda_with_graphs or batch_decoder_on_cuda" 2>&1 | tail -40 > $OUT/logs/gpu-tests.log
tail -15 $OUT/logs/gpu-tests.log
timeout 330 python3 bench.py --shape smollm2-135m --profile --skip dflash-ref,hf-eager,hf-static-compile \
  --out $OUT/bench-smollm2-135m.json > $OUT/logs/bench-smollm2-135m.log 2>&1
grep -v "^ \|^---\|Warn\|warn" $OUT/logs/bench-smollm2-135m.log | head -60
