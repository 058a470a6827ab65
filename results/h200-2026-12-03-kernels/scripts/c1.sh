#!/bin/bash
# Call 1: the kernels' GPU tests and fastpath's graphed tests, the sweep, then bench.py (new) at SmolLM2-135M's shapes.
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
R=results/h200-2026-12-03-kernels
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 200 python3 -m pytest -q -m gpu -s -k "heads_kernel or attend_upto_kernel or fastpath_on_cuda_with_graphs" \
  test_dflash.py > $OUT/gpu-tests-1.log 2>&1; echo "gpu tests rc=$?"; tail -4 $OUT/gpu-tests-1.log
timeout 150 python3 $R/sweep.py --out $OUT/sweep.json > $OUT/sweep.log 2>&1; echo "sweep rc=$?"; cat $OUT/sweep.log | grep -v Warning | tail -30
timeout 230 python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile --profile \
  --out $OUT/bench-smollm2-135m.json > $OUT/bench-smollm2-135m.log 2>&1; echo "bench rc=$?"
grep -v "^ *[-]" $OUT/bench-smollm2-135m.log | grep -E "row|fast|per layer|layer,|profile:|floors" | head -20
