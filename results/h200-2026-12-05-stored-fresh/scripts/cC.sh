#!/bin/bash
# Call C (carries .carry/fi; the tree staged with stage.sh b, keeping this folder and ../h200-flashinfer):
# the CUDA test that the compiled draft and verify parts draft as the eager ones, with the draft part's
# positions and visible ranges stored through `as_strided` (`variant.py range`, commit 48a07ed's
# draft part, whose drafts fell on the H200): expected to fail on torch 2.11. Then FlashInfer's probe.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
HERE=results/h200-2026-12-05-stored-fresh
cp fastpath.py /tmp/fastpath_main.py && python3 $HERE/scripts/variant.py range
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider -rA -k test_fastpath_parts_compiled_by_inductor_follow_eager_on_cuda \
  test_dflash.py > $OUT/gpu-tests-range.log 2>&1
echo "range: rc $? at $(el)s"; grep -E "passed|failed|^E .*(assert|Error)" $OUT/gpu-tests-range.log | cut -c1-300 | tail -n 8
cp /tmp/fastpath_main.py fastpath.py
PROBE_S=$(( 580 - $(el) - 25 )) bash results/h200-flashinfer/scripts/call.sh
