# Call 1: train.train's loop before this change (.carry/old: the previous commit's train.py, dflash.py,
# fastpath.py, offline.py, bench.py) against after, then every GPU test.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/stash/inductor PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
mkdir -p /root/stash
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers, torch._inductor.config as c; print(torch.__version__, triton.__version__, transformers.__version__, 'enable_pdl' in dir(c.triton))"
AB=$PWD/results/h200-2026-12-02-step/ab_step.py
(cd .carry/old && timeout 230 python3 $AB before $OUT/ab-before.json) > $OUT/ab-before.log 2>&1
echo "before: rc $? at $(el)s"; grep '^{' $OUT/ab-before.log | cut -c 1-900
timeout 230 python3 $AB after $OUT/ab-after.json > $OUT/ab-after.log 2>&1
echo "after: rc $? at $(el)s"; grep '^{' $OUT/ab-after.log | cut -c 1-900
TL=$(( ${C1_END:-575} - $(el) )); [ $TL -ge 30 ] && timeout $TL python3 -m pytest -q -p no:cacheprovider -m gpu test_dflash.py > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc $? at $(el)s"; tail -n 12 $OUT/gpu-tests.log
