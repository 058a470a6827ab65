# Call 3: train phase 7a from the shipped drafter (6c) on phase 7's data, --compile if call 1's bench says so.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for f in chat.pt code.pt target-dir bench-train.log; do [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
DIR=$(cat $STASH/target-dir)
cp -r drafter/SmolLM2-135M-Instruct-DFlash-b16 $STASH/d6c
FLAG=$(python3 .carry/s8/pick.py $STASH/bench-train.log); echo "train flag: '$FLAG'"; echo "$FLAG" > $STASH/flag
TB=$(( 555 - $(el) - 40 ))
echo "phase 7a: --time-budget $TB"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -s INT $(( 575 - $(el) )) python3 train.py train --target $DIR \
  --data $STASH/chat.pt $STASH/code.pt --out $STASH/d7a --init $STASH/d6c $FLAG \
  --batch-size 32 --anchors 128 --heldout 64 --epochs 100 --eval-every 250 --time-budget $TB --cache-tokens 13000000 \
  2>&1 | tr '\r' '\n' | awk 'NR % 40 == 0 || !/it\/s|s\/it|step\/s/' > $STASH/train-7a.log
echo "train rc ${PIPESTATUS[0]} at $(el)s"; grep -v "step/s" $STASH/train-7a.log | tail -n 8; tail -n 2 $STASH/train-7a.log
ls $STASH/d7a
echo "done at $(el)s"
