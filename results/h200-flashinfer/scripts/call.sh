#!/bin/bash
# One call, from a checkout staged here with (the tree's bulk held aside so that the wheels fit):
#   KEEP="results/h200-2026-12-04-phase13 results/h200-flashinfer" HOLD=/work/hold \
#     bash results/h200-2026-12-04-phase13/scripts/stage.sh b
# carrying .carry/fi: flashinfer-python 0.5.3 (py3-none-any) and, for the image's Python 3.12,
# apache-tvm-ffi 0.1.15.post2 and nvidia-cudnn-frontend 1.32.0; the image has its other dependencies
# (ninja, nvcc, click, einops, numpy, nvidia-ml-py, requests, tabulate, tqdm). sha256 in ../README.md.
# Installed with --no-deps into a scratch dir; FlashInfer's JIT builds its kernels for sm_90 only.
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
SITE=/tmp/fi-site; W=$OUT/fi; mkdir -p $SITE $W
sha256sum .carry/fi/*.whl > $W/wheels.sha256
python3 -m pip install -q --no-deps --no-index --target $SITE .carry/fi/*.whl > $W/pip.log 2>&1; echo "pip: rc $?"
export PYTHONPATH=$SITE FLASHINFER_CUDA_ARCH_LIST="9.0" MAX_JOBS=16 FLASHINFER_WORKSPACE_BASE=/tmp/fi-ws
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
nvcc --version | tail -n 1
timeout ${PROBE_S:-480} python3 results/h200-flashinfer/scripts/flashinfer_probe.py $W/probe.json > $W/probe.log 2>&1
echo "probe: rc $? at $(el)s"; grep -v "^W[0-9]\{4\} " $W/probe.log | tail -n 30
