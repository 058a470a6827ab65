# Call 1: stash GGUF part 0; the sampled fastpath GPU test (unverified since the dense_layer refactor).
T0=$(date +%s)
mkdir -p /root/stash && cp .carry/g4/part00 /root/stash/ && ls -la /root/stash
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
export PYTHONUNBUFFERED=1
cd .carry/code || exit 2
timeout 120 python3 -m pytest -q -m gpu -k "fastpath_sampling" test_dflash.py 2>&1 | tee $OUT/gpu-test-sampled.log | tail -c 3000
echo "tests rc ${PIPESTATUS[0]} done at $(( $(date +%s) - T0 ))s"
