# Call 3: train phase 10a from the shipped drafter (9a) on phase 10's data, compiled (the drafter's forward
# and the head's loss chunk); held out: the last 64 new self-written turns, the last 32 stubs (9a's) and
# the last 64 of phase 9's self-written turns (9a's), each greedy and walked over its first 256 tokens.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for f in self10.pt code.pt self9.pt target-dir; do [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
DIR=$(cat $STASH/target-dir)
if [ -n "$HEAD_EAGER" ]; then   # fallback, if call 2's A/B showed the compiled head loss failing or slower
  sed -i 's/chunk_grad = torch.compile(head_chunk_grad, dynamic=True) if cfg.compile else head_chunk_grad/chunk_grad = head_chunk_grad/' train.py
  grep -n "chunk_grad = " train.py
fi
cp -r drafter/SmolLM2-135M-Instruct-DFlash-b16 $STASH/d9a
TB=$(( ${C3_END:-570} - $(el) - 50 ))
echo "phase 10a: --time-budget $TB"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -s INT $(( ${C3_END:-570} + 15 - $(el) )) python3 train.py train --target $DIR \
  --data $STASH/self10.pt $STASH/code.pt $STASH/self9.pt --out $STASH/d10a --init $STASH/d9a --compile \
  --batch-size 32 --anchors 128 --heldout 64 32 64 --heldout-tokens 256 --epochs 100 --eval-every 250 \
  --time-budget $TB --cache-tokens 13000000 \
  2>&1 | tr '\r' '\n' | awk 'NR % 40 == 0 || !/it\/s|s\/it|step\/s/' > $STASH/train-10a.log
echo "train rc ${PIPESTATUS[0]} at $(el)s"; grep -v "step/s" $STASH/train-10a.log | grep -v "^ *warnings.warn\|UserWarning\|^$" | tail -n 16; tail -n 2 $STASH/train-10a.log
ls $STASH/d10a
echo "done at $(el)s"
