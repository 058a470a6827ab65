# Call 1: stash GGUF parts 00 and 01 (the drafter stays behind: parts and drafter exceed one call's travel).
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
STASH=/root/stash; mkdir -p $STASH
cp .carry/g4/part00 .carry/g4/part01 $STASH/ && echo "stashed at $(el)s"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
echo "done at $(el)s"
