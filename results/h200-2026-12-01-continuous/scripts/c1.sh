# Call 1: stash GGUF part 0; the new decode-attention kernel and continuous-batching BatchDecoder on the GPU:
# benches first (distill at batch 1024 with HF side by side, then 2048; fastpath SmolLM2 rows), then the GPU tests.
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /root/stash && cp .carry/g4/part00 /root/stash/ && ls -la /root/stash
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/stash/inductor
timeout 150 python3 bench_train.py --skip train --distill-batch 1024 --out $OUT/bench-distill-1024.json 2>&1 | grep -v Warning | tail -n 12 | tee $OUT/bench-distill-1024.log
echo "bench 1024 rc ${PIPESTATUS[0]} at $(el)s"
timeout 120 python3 bench_train.py --skip train,hf --distill-batch 2048 --out $OUT/bench-distill-2048.json 2>&1 | grep -v Warning | tail -n 8 | tee $OUT/bench-distill-2048.log
echo "bench 2048 rc ${PIPESTATUS[0]} at $(el)s"
timeout 100 python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile --out $OUT/bench-smollm2.json 2>&1 | tail -n 14 | tee $OUT/bench-smollm2.log
echo "bench smollm2 rc ${PIPESTATUS[0]} at $(el)s"
timeout $(( 560 - $(el) )) python3 -m pytest -q -m gpu test_dflash.py -rs -x 2>&1 | tail -c 6000 > $OUT/gpu-tests.log
echo "tests rc ${PIPESTATUS[0]} at $(el)s"; tail -c 2500 $OUT/gpu-tests.log
