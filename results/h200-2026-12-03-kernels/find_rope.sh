#!/bin/bash
# On the device: where the kernels `…arange_bmm_cat_cos_mul_sin…` come from (105 a SmolLM2 DFlash step,
# 126 at Qwen3-8B, 3 per target layer, none in a layer compiled alone). Compiles the SmolLM2 bench into a
# fresh inductor cache, then prints each generated module's calls of those kernels with the lines around
# them, and what each call's buffers feed. About 150 s.
C=/tmp/inductor-find; rm -rf $C; export TORCHINDUCTOR_CACHE_DIR=$C PYTHONUNBUFFERED=1
timeout ${BENCH_S:-200} python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile,layers \
  --out $OUT/find-bench.json > $OUT/find-bench.log 2>&1; echo "bench rc=$?"
for f in $(grep -rl "def call(" $C --include=*.py | xargs grep -l "bmm_cat_cos" | head -n 4); do
  echo "== $f"; cp $f $OUT/ 2>/dev/null
  grep -n "bmm_cat_cos.*\.run(\|_heads_into_place\|_attend_upto_split.*run\|_attend_upto_combine.*run" $f | head -n 40
done
