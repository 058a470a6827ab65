# Call 4: evaluate phase 7a on the H200 (fastpath, bf16, all 244 prompts); the GPU tests of what changed;
# bring back the checkpoint in parts, its history, the eval and the logs.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for f in d7a/model.safetensors target-dir; do [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
DIR=$(cat $STASH/target-dir)
split -b 15000000 -d -a 1 $STASH/d7a/model.safetensors $OUT/model.safetensors.part
sha256sum $STASH/d7a/model.safetensors
timeout 330 python3 evaluation.py --target $DIR --draft $STASH/d7a --impl fastpath --out $STASH/eval7a 2>&1 \
  | grep -v "Warn\|warn" > $STASH/eval-7a.log
echo "eval rc ${PIPESTATUS[0]} at $(el)s"; tail -n 4 $STASH/eval-7a.log
cp $STASH/eval7a/eval.json $OUT/eval-h200.json; cp $STASH/eval7a/eval.png $OUT/eval-h200.png
cp $STASH/d7a/training.json $OUT/training.json
timeout $(( 540 - $(el) )) python3 -m pytest -q -p no:logging -m gpu -k "batch_decoder or compiled_training or attend_upto" test_dflash.py 2>&1 \
  | grep -v "DEBUG\|Warning\|warn" | tail -c 3000 > $STASH/gpu-tests.log
echo "tests rc ${PIPESTATUS[0]} at $(el)s"; tail -n 4 $STASH/gpu-tests.log
cp $STASH/d7a/config.json $STASH/
tar czf $OUT/logs.tar.gz -C $STASH distill-code.log distill-chat.log train-7a.log eval-7a.log gpu-tests.log flag config.json
echo "done at $(el)s"
