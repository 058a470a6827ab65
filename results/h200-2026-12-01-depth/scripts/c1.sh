# Call 1 (depth batch): stash GGUF part 0; profile decode + train steps; all GPU tests.
set -x
T0=$(date +%s)
mkdir -p /root/stash && cp .carry/g4/part00 /root/stash/ && ls -la /root/stash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
cd .carry/code || exit 2
timeout 150 python3 ../profile_pipeline.py $OUT > $OUT/profile-run.log 2>&1; echo "profile rc $? at $(( $(date +%s) - T0 ))s"
tail -c 1500 $OUT/profile-run.log
timeout 240 python3 -m pytest -q -m gpu test_dflash.py 2>&1 | tee $OUT/gpu-tests.log | tail -c 7000
echo "tests rc ${PIPESTATUS[0]} done at $(( $(date +%s) - T0 ))s"
ls -la $OUT /root/stash
