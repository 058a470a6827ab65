# Call 6: evaluate phase 6b on all 244 prompts (fastpath, bf16, K = 15).
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
[ -f $STASH/d6b/model.safetensors ] || { echo "STASH LOST: $STASH/d6b missing"; ls -la $STASH; exit 5; }
cp -r .carry/site/* /tmp/site/
export PYTHONPATH=/tmp/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
DIR=$STASH/cache/SmolLM2-135M-Instruct
cd .carry/code || exit 2
timeout 400 python3 evaluation.py --target $DIR --draft $STASH/d6b --impl fastpath --out $STASH/eval 2>&1 | tr '\r' '\n' | grep -v "prompt/s\]$" > $STASH/eval.log
tail -n 6 $STASH/eval.log
mkdir -p /tmp/pack6 && cp $STASH/eval.log $STASH/train-6b.log /tmp/pack6/ && cp $STASH/d6b/training.json /tmp/pack6/training-6b.json && cp $STASH/d6b/config.json /tmp/pack6/config-6b.json && cp $STASH/eval/eval.json /tmp/pack6/eval-h200.json
cp $STASH/eval/eval.png $OUT/eval-h200.png
tar czf $OUT/call6.tar.gz -C /tmp/pack6 . ; ls -la $OUT
echo "done at $(el)s"
