#!/bin/bash
# Call B (carries .carry/b, the tree staged with stage.sh b; right after call A, which stashed GGUF part g0
# and the shipped drafter): join and check the GGUF, install gguf and the evaluation sets, convert the
# target, evaluate the shipped drafter on all 244 prompts with the tree's fastpath.py (the draft part's
# positions stored, `stored` taking a fresh value).
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash
for f in g0 drafter/model.safetensors drafter/config.json; do
  [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
STASH=$STASH bash results/h200-2026-12-05-stored-fresh/scripts/site.sh || exit $?
export PYTHONPATH=$STASH/site DFLASH_CACHE=$STASH/cache PYTHONUNBUFFERED=1
DIR=$(python3 train.py prepare-target 2> $OUT/prepare.log) || { tail -n 3 $OUT/prepare.log; exit 4; }
echo "target converted at $(el)s: $DIR"
timeout ${EVAL_S:-400} python3 evaluation.py --target $DIR --draft $STASH/drafter --impl fastpath --out $OUT/eval \
  2>&1 | tr '\r' '\n' | grep -v "Warn\|warn\|prompt/s" > $OUT/eval.log
echo "eval: rc ${PIPESTATUS[0]} at $(el)s"; tail -n 8 $OUT/eval.log
