# Call 5: phase 6b, continued from 6a on the same data; both checkpoints come back in parts.
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
[ -f $STASH/d6a/model.safetensors ] || { echo "STASH LOST: $STASH/d6a missing"; ls -la $STASH; exit 5; }
split -b 15000000 -d $STASH/d6a/model.safetensors $OUT/d6a.safetensors.part
export PYTHONPATH=/tmp/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
DIR=$STASH/cache/SmolLM2-135M-Instruct
cd .carry/code || exit 2
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -s INT 520 python3 train.py train --target $DIR \
  --data $STASH/chat.pt $STASH/code.pt --out $STASH/d6b --init $STASH/d6a \
  --batch-size 32 --anchors 128 --heldout 64 --epochs 100 --eval-every 250 --time-budget ${TB:-330} --cache-tokens 13000000 \
  2>&1 | tr '\r' '\n' | awk 'NR % 40 == 0 || !/it\/s|s\/it|step\/s/' > $STASH/train-6b.log
echo "train rc ${PIPESTATUS[0]}"; grep -v "step/s" $STASH/train-6b.log | tail -n 6; tail -n 2 $STASH/train-6b.log
split -b 15000000 -d $STASH/d6b/model.safetensors $OUT/d6b.safetensors.part
mkdir -p /tmp/pack5 && cp $STASH/*.log /tmp/pack5/ && cp $STASH/d6a/training.json /tmp/pack5/training-6a.json && cp $STASH/d6a/config.json /tmp/pack5/config-6a.json && cp $STASH/d6b/training.json /tmp/pack5/training-6b.json
tar czf $OUT/call5.tar.gz -C /tmp/pack5 . ; ls -la $OUT
echo "done at $(el)s"
