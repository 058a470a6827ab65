# Call 4: evaluate phase 8a on the H200 (fastpath, bf16, all 244 prompts); if .carry/d6c came along, phase 6c
# on MT-Bench at this fastpath (is the drop in same-text counts the drafter's or the code's?); bring back the
# checkpoint in parts, its history, the eval and the logs.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for f in d8a/model.safetensors target-dir; do [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
DIR=$(cat $STASH/target-dir)
split -b 15000000 -d -a 1 $STASH/d8a/model.safetensors $OUT/model.safetensors.part
sha256sum $STASH/d8a/model.safetensors
timeout 330 python3 evaluation.py --target $DIR --draft $STASH/d8a --impl fastpath --out $STASH/eval8a 2>&1 \
  | tr '\r' '\n' | grep -v "Warn\|warn\|prompt/s" > $STASH/eval-8a.log
echo "eval rc ${PIPESTATUS[0]} at $(el)s"; tail -n 4 $STASH/eval-8a.log
cp $STASH/eval8a/eval.json $OUT/eval-h200.json; cp $STASH/eval8a/eval.png $OUT/eval-h200.png
cp $STASH/d8a/training.json $OUT/training.json; cp $STASH/d8a/config.json $STASH/
cd $STASH && tar czf $OUT/logs.tar.gz distill-code.log distill-chat.log train-8a.log eval-8a.log config.json && cd - > /dev/null
if [ -e .carry/d6c/model.safetensors ]; then
  timeout $(( 560 - $(el) )) python3 evaluation.py --target $DIR --draft .carry/d6c --impl fastpath --datasets mtbench \
    --out $STASH/eval6c 2>&1 | tr '\r' '\n' | grep -v "Warn\|warn\|prompt/s" > $STASH/eval-6c.log
  echo "eval 6c rc ${PIPESTATUS[0]} at $(el)s"; tail -n 3 $STASH/eval-6c.log; cp $STASH/eval6c/eval.json $OUT/eval-6c-mtbench.json; cp $STASH/eval-6c.log $OUT/
fi
echo "done at $(el)s"
