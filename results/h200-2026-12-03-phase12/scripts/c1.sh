#!/bin/bash
# Call 1: stash GGUF part g0, the phase-11a drafter and the prompt files for the next calls; then bench.py
# at SmolLM2-135M's shapes on the quiet GPU (fastpath rows, layer profiles, the step's profile); BENCH_S=0: no bench.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash; mkdir -p $STASH
cp .carry/a/g0 .carry/a/*.json.xz $STASH/ && cp -r drafter/SmolLM2-135M-Instruct-DFlash-b16 $STASH/d11a || exit 5
ls -la $STASH $STASH/d11a; echo "stashed at $(el)s"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
[ "${BENCH_S:-200}" -gt 0 ] || exit 0
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-bench PYTHONUNBUFFERED=1
timeout ${BENCH_S:-200} python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile --profile \
  --out $OUT/bench-smollm2-135m.json > $OUT/bench-smollm2-135m.log 2>&1; echo "bench rc=$? at $(el)s"
grep -E "^(fast|  fast)|layer|profile:|floors|compile" $OUT/bench-smollm2-135m.log | grep -v Warn
