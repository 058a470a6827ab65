#!/bin/bash
# Call 1: stash GGUF part g0, the phase-11a drafter and the prompt files that make the held-out sets and
# the code stubs, for call 2 (which must follow within 30 s, or the machine and its stash are gone).
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash; mkdir -p $STASH
INIT=${INIT:-d11a}   # the name the shipped drafter is stashed under: the run's start
cp .carry/a/g0 .carry/a/*.json.xz $STASH/ && cp -r drafter/SmolLM2-135M-Instruct-DFlash-b16 $STASH/$INIT || exit 5
ls -la $STASH $STASH/$INIT; echo "stashed at $(el)s"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
