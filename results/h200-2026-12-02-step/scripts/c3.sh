# Call 3: bench.py at Qwen3-8B's shapes: as committed (step profile, per-layer profiles, the reference and
# HF eager rows), then with TORCHINDUCTOR_ENABLE_PDL=1 (fastpath rows only); with PDL_TESTS=1 first the
# fastpath GPU tests under PDL.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/stash/inductor
if [ -n "$PDL_TESTS" ]; then
  TORCHINDUCTOR_ENABLE_PDL=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -k "fastpath" test_dflash.py > $OUT/gpu-tests-pdl.log 2>&1
  echo "pdl tests rc $? at $(el)s"; tail -n 5 $OUT/gpu-tests-pdl.log
fi
B="python3 bench.py --shape qwen3-8b"
timeout ${PLAIN_S:-320} $B --skip hf-static-compile --profile --out $OUT/bench-qwen3-8b.json > $OUT/bench-qwen3-8b.log 2>&1
echo "plain: rc $? at $(el)s"; grep -v "^ \|^-\|^Name\|Self CUDA\|Self CPU\|Warn\|warn" $OUT/bench-qwen3-8b.log | tail -n 20
TL=$(( ${C3_END:-578} - $(el) )); [ $TL -ge 90 ] && TORCHINDUCTOR_ENABLE_PDL=1 timeout $TL $B --skip hf-static-compile,hf-eager,dflash-ref,layers --profile \
  --out $OUT/bench-qwen3-8b-pdl.json > $OUT/bench-qwen3-8b-pdl.log 2>&1
echo "pdl: rc $? at $(el)s"; grep -v "^ \|^-\|^Name\|Self CUDA\|Self CPU\|Warn\|warn" $OUT/bench-qwen3-8b-pdl.log | tail -n 12
