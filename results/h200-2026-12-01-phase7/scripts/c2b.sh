# Call 2b (run inline right after call 2, whose chat distill had no --num-prompts and so answered only the
# first 2,000 turns): every ShareGPT turn, greedy then T 0.8, resumed into the same file.
S=/root/stash; export PYTHONPATH=$S/site DFLASH_CACHE=$S/cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$S/inductor; D=$(cat $S/target-dir)
timeout 480 python3 train.py distill --target $D --max-new-tokens 512 --batch-size 2048 --time-budget 400 --prompts $S/prompts.json.xz \
  --out $S/chat.pt --resume --num-prompts 49918 --temperatures 0 0.8 --seed 22 --batches-per-save 8 2>&1 | tr '\r' '\n' | grep -v "^ *$" > $S/distill-chat2.log
echo rc $?; grep -v "answer/s\]$" $S/distill-chat2.log | tail -n 4; grep "answer/s\]$" $S/distill-chat2.log | tail -n 2; ls -la $S/*.pt
