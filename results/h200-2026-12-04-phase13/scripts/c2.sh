#!/bin/bash
# Call 2: stash GGUF part g1, join and check it, install gguf and the evaluation sets' packages, copy the
# code to the stash, and start pipeline.sh in its own session (it outlives this call; it must end by
# now + END_IN seconds). Then this call follows the pipeline until POLL_S; the next calls run poll.sh alone.
# PRE_TEST: a pytest -k expression of GPU tests to run first (phase 14: the distillation loss chunk).
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash; HERE=results/h200-2026-12-04-phase13
for f in g0 ${INIT:-d11a}/model.safetensors self10-prompts.json.xz self11-prompts.json.xz code-prompts.json.xz; do
  [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
STASH=$STASH bash results/h200-2026-12-04-phase13/scripts/site.sh || exit $?
rm -rf $STASH/code && mkdir -p $STASH/code && cp -r *.py pyproject.toml $HERE $STASH/code/ || exit 7
if [ -n "$PRE_TEST" ]; then   # GPU tests (pytest -k PRE_TEST) before the pipeline has the GPU
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -k "$PRE_TEST" test_dflash.py 2>&1 | tail -n 3
  echo "pre-tests done at $(el)s"
fi
echo $(( T0 + ${END_IN:?} )) > $STASH/end
setsid nohup bash $STASH/code/$(basename $HERE)/scripts/pipeline.sh > $STASH/pipeline.log 2>&1 < /dev/null &
echo "pipeline started at $(el)s, to end by $(date -d @$(cat $STASH/end) +%T) ($END_IN s)"
bash $STASH/code/$(basename $HERE)/scripts/poll.sh $(( ${POLL_S:-585} - $(el) ))
