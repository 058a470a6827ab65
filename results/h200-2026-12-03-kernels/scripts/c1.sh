#!/bin/bash
# Call 1: the kernels' GPU tests, the sweep, bench.py at SmolLM2-135M's shapes with the kernels and before
# them (the previous commit's files, carried in .carry/old), then fastpath's graphed GPU tests in the time left.
T0=$(date +%s); left() { echo $(( ${END:-585} - $(date +%s) + T0 )); }
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
R=results/h200-2026-12-03-kernels
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 90 python3 -m pytest -q -m gpu -s -k "heads_kernel or attend_upto_kernel" test_dflash.py > $OUT/gpu-tests-kernels.log 2>&1
echo "kernel tests rc=$? at $(( $(date +%s) - T0 ))s"; tail -3 $OUT/gpu-tests-kernels.log
timeout 120 python3 $R/sweep.py --out $OUT/sweep.json > $OUT/sweep.log 2>&1; echo "sweep rc=$? at $(( $(date +%s) - T0 ))s"
grep -E "rows " $OUT/sweep.log
timeout $(( $(left) - 190 )) python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile --profile \
  --out $OUT/bench-smollm2-135m.json > $OUT/bench-smollm2-135m.log 2>&1; echo "bench rc=$? at $(( $(date +%s) - T0 ))s"
grep -E "^(fast|  fast)|layer,|profile:|floors" $OUT/bench-smollm2-135m.log
(cd .carry/old && timeout $(( $(left) - 5 )) python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile \
  --profile --out $OUT/before-bench-smollm2-135m.json > $OUT/before-bench-smollm2-135m.log 2>&1; echo "before bench rc=$? at $(( $(date +%s) - T0 ))s")
grep -E "^(fast|  fast)|layer,|profile:" $OUT/before-bench-smollm2-135m.log
