# Call 1: stash GGUF parts 00 and 01; bench_train: attention groups 1/8/16, eager vs compiled.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash; mkdir -p $STASH
cp .carry/g4/part00 .carry/g4/part01 $STASH/ && echo "stashed at $(el)s"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 300 python3 bench_train.py --skip distill --steps 6 --out $OUT/bench-train.json 2>&1 | grep -v "Warn\|warn" > $OUT/bench-train.log
echo "bench rc ${PIPESTATUS[0]} at $(el)s"; tail -n 16 $OUT/bench-train.log
cp $OUT/bench-train.log $STASH/
echo "done at $(el)s"
