# Call 4: evaluate phase 9a on the H200 (fastpath, bf16, all 244 prompts); bring back the checkpoint in
# parts, its history, the eval and the logs.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for f in d9a/model.safetensors target-dir; do [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
DIR=$(cat $STASH/target-dir)
split -b 15000000 -d -a 1 $STASH/d9a/model.safetensors $OUT/model.safetensors.part
sha256sum $STASH/d9a/model.safetensors
cp $STASH/d9a/training.json $OUT/training.json; cp $STASH/d9a/config.json $STASH/
cd $STASH && tar czf $OUT/logs.tar.gz prompts-self.log distill-*.log train-9a.log config.json && cd - > /dev/null
timeout 400 python3 evaluation.py --target $DIR --draft $STASH/d9a --impl fastpath --out $STASH/eval9a 2>&1 \
  | tr '\r' '\n' | grep -v "Warn\|warn\|prompt/s" > $STASH/eval-9a.log
echo "eval rc ${PIPESTATUS[0]} at $(el)s"; tail -n 4 $STASH/eval-9a.log
cp $STASH/eval9a/eval.json $OUT/eval-h200.json; cp $STASH/eval9a/eval.png $OUT/eval-h200.png; cp $STASH/eval-9a.log $OUT/
echo "done at $(el)s"
