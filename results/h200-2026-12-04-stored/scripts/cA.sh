#!/bin/bash
# Call A (no GGUF): the GPU tests, then bench.py at SmolLM2's size with the step profiles.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout ${TESTS_S:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -rA -s test_dflash.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests: rc $? at $(el)s"; grep -E "passed|failed|^FAILED|^ERROR|RoPE tables|row verify" $OUT/gpu-tests.log | tail -n 24
timeout ${BENCH_S:-240} python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile --profile \
  --out $OUT/bench-smollm2-135m.json > $OUT/bench-smollm2-135m.log 2>&1
echo "bench smollm2: rc $? at $(el)s"; grep -v "^\s*$" $OUT/bench-smollm2-135m.log | grep -iv warn | head -n 60
