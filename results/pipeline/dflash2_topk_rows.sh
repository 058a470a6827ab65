# bench_train's rows one by one (JSON after each) in tree $1: shape $2, output $3, drafter kinds $4 (comma-separated), compiled $5 (0/1)
cd "$1" && PYTHONPATH=.:benchmarks python3 - "$2" "$3" "$4" "$5" <<'PY'
import functools, json, sys, bench, bench_train
from dflash_reference.training import objective
shape, out, kinds, compiled = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4] == "1"
bench_train.SHAPE = bench.SHAPES[shape]   # the older tree's fixed shape
orig, rows = bench_train.bench_train, []
def one_at_a_time(target, layers, sequences, batch, losses, steps, runs):
    if not runs:
        return []
    if not compiled:   # as train without --compile: the head's loss through head_loss_chunk (the Triton kernel on CUDA)
        losses = dict(losses, chunked=functools.partial(objective.block_loss, chunk_grad=objective.head_loss_chunk(False)))
    rows.extend(orig(target, layers, sequences, batch, losses, steps, [("cached", "chunked", (1, 1), compiled, kind) for kind in kinds]))
    json.dump({"shape": shape, "tree": sys.argv[0], "rows": rows}, open(out, "w"), indent=1)
    return rows
bench_train.bench_train = one_at_a_time
argv = ["--skip", "distill,hf", "--dflash2-only", "--out", out + ".main.json", "--train-batch", "2" if shape == "qwen3-8b" else "8"]
if "--shape" in open("benchmarks/bench_train.py").read():
    argv += ["--shape", shape]
bench_train.main(argv)
PY
