# Call B: the BatchDecoder GPU tests after the capture fix (no isin in the graph); distill bench at 2048;
# the fastpath A/B of attend_upto's kernel against its plain-torch twin, batch 1.
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
export PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -p no:logging -m gpu -k "batch_decoder_on_cuda" test_dflash.py 2>&1 | grep -v "DEBUG\|Warning\|warn" | tail -c 3000 | tee $OUT/gpu-tests-decoder.log
echo "tests rc ${PIPESTATUS[0]} at $(el)s"
timeout 120 python3 bench_train.py --skip train,hf --distill-batch 2048 --out $OUT/bench-distill-2048.json 2>&1 | grep -v Warning | tail -n 5 | tee $OUT/bench-distill-2048.log
echo "bench 2048 rc ${PIPESTATUS[0]} at $(el)s"
timeout $(( 560 - $(el) )) python3 results/h200-2026-12-01-continuous/ab_attention.py --out $OUT/ab-attention.json 2>&1 | grep -v "Warning\|warn" | tail -n 12 | tee $OUT/ab-attention.log
echo "ab rc ${PIPESTATUS[0]} at $(el)s"
