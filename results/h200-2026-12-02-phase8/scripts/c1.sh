# Call 1: stash GGUF parts 00 and 01; the whole GPU test suite; the feature-capture A/B (cuDNN in or out).
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash; mkdir -p $STASH
cp .carry/g4/part00 .carry/g4/part01 $STASH/ && echo "stashed at $(el)s"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 150 python3 results/h200-2026-12-02-phase8/scripts/ab_capture.py 2>&1 | grep -v "Warn\|warn" > $OUT/ab-capture.log
echo "ab rc ${PIPESTATUS[0]} at $(el)s"; cat $OUT/ab-capture.log | tail -n 5
timeout $(( 560 - $(el) )) python3 -m pytest -q -p no:logging -m gpu test_dflash.py -rA 2>&1 | grep -v "DEBUG\|Warning\|warn" > $OUT/gpu-tests.log
echo "tests rc ${PIPESTATUS[0]} at $(el)s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/gpu-tests.log | tail -n 30
echo "done at $(el)s"
