# Call A: stash GGUF part 0; the failing BatchDecoder GPU test in full; the fastpath SmolLM2 rows with time to compile.
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
mkdir -p /root/stash && cp .carry/g4/part00 /root/stash/
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/stash/inductor
timeout 150 python3 -m pytest -q -p no:logging -m gpu -k "batch_decoder_on_cuda or attend_upto_kernel_on_cuda" test_dflash.py -s 2>&1 | grep -v "DEBUG\|Warning\|warn" | tail -c 5000 | tee $OUT/gpu-tests-decoder.log
echo "tests rc ${PIPESTATUS[0]} at $(el)s"
timeout 300 python3 bench.py --shape smollm2-135m --skip dflash-ref,hf-eager,hf-static-compile --out $OUT/bench-smollm2.json 2>&1 | grep -v "Warning\|warn" | tail -n 12 | tee $OUT/bench-smollm2.log
echo "bench smollm2 rc ${PIPESTATUS[0]} at $(el)s"
