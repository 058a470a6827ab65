# Call 1: stash GGUF part 0; fastpath's GPU tests on the merged code (dense_layer refactor, Ctrl-C wrapper).
T0=$(date +%s)
mkdir -p /root/stash && cp .carry/g4/part00 /root/stash/ && ls -la /root/stash
export PYTHONUNBUFFERED=1
cd .carry/code || exit 2
timeout 230 python3 -m pytest -q -m gpu -k "fastpath" test_dflash.py 2>&1 | tee $OUT/gpu-tests-fastpath.log | tail -c 4000
echo "tests rc ${PIPESTATUS[0]} done at $(( $(date +%s) - T0 ))s"
