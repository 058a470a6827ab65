# Call 3: train phase 9a from the shipped drafter (8a) on phase 9's data, compiled; held out: the last 64
# ShareGPT turns, 32 stubs and 64 of SmolLM2's own turns, each greedy.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for f in chat.pt code.pt self.pt target-dir; do [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
DIR=$(cat $STASH/target-dir)
cp -r drafter/SmolLM2-135M-Instruct-DFlash-b16 $STASH/d8a
TB=$(( ${C3_END:-520} - $(el) - 45 ))
echo "phase 9a: --time-budget $TB"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -s INT $(( ${C3_END:-520} + 20 - $(el) )) python3 train.py train --target $DIR \
  --data $STASH/chat.pt $STASH/code.pt $STASH/self.pt --out $STASH/d9a --init $STASH/d8a --compile \
  --batch-size 32 --anchors 128 --heldout 64 32 64 --epochs 100 --eval-every 250 --time-budget $TB --cache-tokens 13000000 \
  2>&1 | tr '\r' '\n' | awk 'NR % 40 == 0 || !/it\/s|s\/it|step\/s/' > $STASH/train-9a.log
echo "train rc ${PIPESTATUS[0]} at $(el)s"; grep -v "step/s" $STASH/train-9a.log | tail -n 14; tail -n 2 $STASH/train-9a.log
ls $STASH/d9a
echo "done at $(el)s"
