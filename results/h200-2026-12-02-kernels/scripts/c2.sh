#!/bin/bash
# Call 2: the fused linear's block sweep alone (the first try of call 1 lacked PYTHONPATH).
export TORCHINDUCTOR_CACHE_DIR=/root/stash/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p /root/stash $OUT/logs
timeout 500 env PYTHONPATH=. python3 results/h200-2026-12-02-kernels/scripts/linear_sweep.py $OUT/linear-sweep.json 2>&1 | grep -v Warn | tee $OUT/logs/linear-sweep.log
