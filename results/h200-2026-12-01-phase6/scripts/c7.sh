# Call 7: phase 6c (continued from 6b, same data), its checkpoint back in parts, then its evaluation while time lasts.
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
[ -f $STASH/d6b/model.safetensors ] || { echo "STASH LOST: $STASH/d6b missing"; ls -la $STASH; exit 5; }
export PYTHONPATH=/tmp/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
DIR=$STASH/cache/SmolLM2-135M-Instruct
cd .carry/code || exit 2
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -s INT 330 python3 train.py train --target $DIR \
  --data $STASH/chat.pt $STASH/code.pt --out $STASH/d6c --init $STASH/d6b \
  --batch-size 32 --anchors 128 --heldout 64 --epochs 100 --eval-every 250 --time-budget 200 --cache-tokens 13000000 \
  2>&1 | tr '\r' '\n' | awk 'NR % 40 == 0 || !/it\/s|s\/it|step\/s/' > $STASH/train-6c.log
echo "train rc ${PIPESTATUS[0]} at $(el)s"; grep -v "step/s" $STASH/train-6c.log | tail -n 4
split -b 15000000 -d $STASH/d6c/model.safetensors $OUT/d6c.safetensors.part
cp $STASH/d6c/training.json $OUT/training-6c.json; cp $STASH/train-6c.log $OUT/
timeout $(( 560 - $(el) )) python3 evaluation.py --target $DIR --draft $STASH/d6c --impl fastpath --out $STASH/eval6c 2>&1 | tr '\r' '\n' | grep -v "prompt/s\]$" > $OUT/eval-6c.log
tail -n 3 $OUT/eval-6c.log; cp $STASH/eval6c/eval.json $OUT/eval-6c.json
echo "done at $(el)s"
