#!/bin/bash
# Call 2: bench.py before the kernels (the previous commit's files, carried in .carry/old) at SmolLM2-135M's
# shapes, then bench.py (new) at Qwen3-8B's.
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
(cd .carry/old && timeout 230 python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile \
  --profile --out $OUT/before-bench-smollm2-135m.json > $OUT/before-bench-smollm2-135m.log 2>&1; echo "before bench rc=$?")
grep -E "^(fast|  fast)|per layer|layer,|profile:" $OUT/before-bench-smollm2-135m.log | head -12
timeout 330 python3 bench.py --shape qwen3-8b --skip dflash-ref,hf-eager,hf-static-compile --profile \
  --out $OUT/bench-qwen3-8b.json > $OUT/bench-qwen3-8b.log 2>&1; echo "bench rc=$?"
grep -E "^(fast|  fast)|per layer|layer,|profile:|floors" $OUT/bench-qwen3-8b.log | head -12
