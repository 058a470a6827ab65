# Call 4: evaluate phase 10a on the H200 (fastpath, bf16, all 244 prompts); bring back the checkpoint in
# parts, its history, the eval and the logs; then the GPU tests of the compiled head loss and training.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for f in d10a/model.safetensors target-dir; do [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
DIR=$(cat $STASH/target-dir)
split -b 15000000 -d -a 1 $STASH/d10a/model.safetensors $OUT/model.safetensors.part
sha256sum $STASH/d10a/model.safetensors
cp $STASH/d10a/training.json $OUT/training.json; cp $STASH/d10a/config.json $STASH/
timeout ${EVAL_BUDGET:-400} python3 evaluation.py --target $DIR --draft $STASH/d10a --impl fastpath --out $STASH/eval10a 2>&1 \
  | tr '\r' '\n' | grep -v "Warn\|warn\|prompt/s" > $STASH/eval-10a.log
echo "eval rc ${PIPESTATUS[0]} at $(el)s"; tail -n 4 $STASH/eval-10a.log
cp $STASH/eval10a/eval.json $OUT/eval-h200.json; cp $STASH/eval10a/eval.png $OUT/eval-h200.png
TL=$(( ${C4_END:-470} - $(el) )); [ $TL -ge 20 ] && timeout $TL python3 -m pytest -q -p no:logging -m gpu -x \
  -k "compiled_head_chunk or compiled_training_follows" test_dflash.py 2>&1 | tail -n 5 > $STASH/gpu-tests.log
cat $STASH/gpu-tests.log
cd $STASH && tar czf $OUT/logs.tar.gz prompts-self.log distill-*.log train-10a.log eval-10a.log gpu-tests.log config.json && cd - > /dev/null
echo "done at $(el)s"
