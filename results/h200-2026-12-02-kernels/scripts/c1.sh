#!/bin/bash
# Call 1: the fused linear's block sweep, then the SmolLM2-135M bench (fused and plain torch side by side).
set -x
export TORCHINDUCTOR_CACHE_DIR=/root/stash/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p /root/stash $OUT/logs
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/logs/gpu.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 420 env PYTHONPATH=. python3 results/h200-2026-12-02-kernels/scripts/linear_sweep.py $OUT/linear-sweep.json 2>&1 | tee $OUT/logs/linear-sweep.log | grep -v Warning
timeout 360 python3 bench.py --shape smollm2-135m --profile --skip dflash-ref,hf-eager,hf-static-compile \
  --out $OUT/bench-smollm2-135m.json 2>&1 | tee $OUT/logs/bench-smollm2-135m.log
echo rc $?
