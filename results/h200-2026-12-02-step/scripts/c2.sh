# Call 2: bench.py at SmolLM2-135M's shapes: as committed (with the step's profile and the per-layer
# profiles), then the same build with inductor's programmatic dependent launch (TORCHINDUCTOR_ENABLE_PDL=1),
# then with max-autotune and coordinate-descent tuning; the last two without the per-layer and eager rows.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/stash/inductor
B="python3 bench.py --shape smollm2-135m"
timeout 230 $B --skip hf-static-compile --profile --out $OUT/bench-smollm2-135m.json > $OUT/bench-smollm2-135m.log 2>&1
echo "plain: rc $? at $(el)s"; grep -v "^ \|^-\|^Name\|Self CUDA\|Self CPU\|Warn\|warn" $OUT/bench-smollm2-135m.log | tail -n 20
TORCHINDUCTOR_ENABLE_PDL=1 timeout 150 $B --skip hf-static-compile,hf-eager,dflash-ref,layers --profile \
  --out $OUT/bench-smollm2-135m-pdl.json > $OUT/bench-smollm2-135m-pdl.log 2>&1
echo "pdl: rc $? at $(el)s"; grep -v "^ \|^-\|^Name\|Self CUDA\|Self CPU\|Warn\|warn" $OUT/bench-smollm2-135m-pdl.log | tail -n 12
TL=$(( ${C2_END:-575} - $(el) )); [ $TL -ge 60 ] && TORCHINDUCTOR_MAX_AUTOTUNE=1 TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 timeout $TL \
  $B --skip hf-static-compile,hf-eager,dflash-ref,layers --out $OUT/bench-smollm2-135m-autotune.json > $OUT/bench-smollm2-135m-autotune.log 2>&1
echo "autotune: rc $? at $(el)s"; grep -v "^ \|^-\|^Name\|Self CUDA\|Self CPU\|Warn\|warn\|autotun\|AUTOTUNE\|triton_\|SingleProcess" $OUT/bench-smollm2-135m-autotune.log | tail -n 10
