# One device call: old vs new BatchDecoder (bench_train.py through timed_bench.py), the GPU test, 1024 rows if time is left.
export PYTHONUNBUFFERED=1
ROOT=$PWD; W=$ROOT/results/h200-2026-12-01-distill/scripts/timed_bench.py; T0=$SECONDS
LOG=$OUT/run.log
bench() {   # dir, batch, out name, timeout
  cd $ROOT/.carry/$1 || return
  echo "== $1 batch $2 -> $3.json, start at $((SECONDS-T0))s" | tee -a $LOG
  timeout $4 python3 -c "exec(open('$W').read())" --skip train,hf --distill-batch $2 --max-new 512 --out $OUT/$3.json >>$LOG 2>&1
  echo "== $1 batch $2 rc $? at $((SECONDS-T0))s" | tee -a $LOG
  grep -E "^(BatchDecoder|generate|replay)" $LOG | tail -n 12
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.used,memory.total --format=csv | tee $LOG
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee -a $LOG
bench code 2048 old 100
cd $ROOT/.carry/code2 && echo "== gpu tests at $((SECONDS-T0))s" | tee -a $LOG
timeout 130 python3 -m pytest -q -m gpu -k batch_decoder test_dflash.py > $OUT/gpu-tests.log 2>&1
echo "== gpu tests rc $? at $((SECONDS-T0))s" | tee -a $LOG; tail -n 4 $OUT/gpu-tests.log
bench code2 2048 new 160
if [ $((SECONDS-T0)) -lt 240 ]; then
  bench code 1024 old1024 60
  [ $((SECONDS-T0)) -lt 300 ] && bench code2 1024 new1024 80
fi
echo "== done at $((SECONDS-T0))s" | tee -a $LOG
ls -la $OUT
