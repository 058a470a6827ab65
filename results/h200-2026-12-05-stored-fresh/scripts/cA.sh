#!/bin/bash
# Call A (carries .carry/s: GGUF part g0 and the shipped drafter; the tree staged with stage.sh b): stash
# them for call B, which must follow within 30 s. Then the CUDA test that the compiled draft and verify
# parts draft exactly as the eager ones, first with the draft part's positions stored through
# `as_strided` (`variant.py view`; meant as the failing case, it stores the positions only), then with the tree's
# fastpath.py (`stored` takes a fresh `t * 1`), with the verify's kernel-count test; then bench.py at
# SmolLM2's size with the tree's fastpath.py.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
HERE=results/h200-2026-12-05-stored-fresh; STASH=/root/stash; mkdir -p $STASH
cp .carry/s/g0 $STASH/ && cp -r .carry/s/drafter $STASH/drafter || exit 5
sha256sum $STASH/g0 $STASH/drafter/*; echo "stashed at $(el)s"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
TEST=test_fastpath_parts_compiled_by_inductor_follow_eager_on_cuda
cp fastpath.py /tmp/fastpath_fresh.py && python3 $HERE/scripts/variant.py view
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rA -k $TEST test_dflash.py > $OUT/gpu-tests-view.log 2>&1
echo "view: rc $? at $(el)s"; grep -E "passed|failed|^E .*(assert|Error)" $OUT/gpu-tests-view.log | cut -c1-300 | tail -n 8
cp /tmp/fastpath_fresh.py fastpath.py
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rA -s -k "$TEST or graphed_verify_builds" test_dflash.py \
  > $OUT/gpu-tests-fresh.log 2>&1
echo "fresh: rc $? at $(el)s"; grep -E "passed|failed|^E .*(assert|Error)|row verify" $OUT/gpu-tests-fresh.log | cut -c1-300 | tail -n 8
timeout $(( ${END_S:-575} - $(el) )) python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile,layers \
  --profile --out $OUT/bench-smollm2-135m.json > $OUT/bench-smollm2-135m.log 2>&1
echo "bench smollm2: rc $? at $(el)s"; grep -E "^(fast|  fast)|profile:|floors|kernels" $OUT/bench-smollm2-135m.log | head -n 20
