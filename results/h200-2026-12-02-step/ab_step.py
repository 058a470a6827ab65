"""train.train's own loop, the code before this change against after, on the H200: run from a directory
whose train.py / dflash.py it imports (the repo root, or a copy of the previous commit's files).
Phase 10's setting: a SmolLM2-135M-shaped target with random weights, 3 drafter layers, cached
features, 32 random sequences of 200-768 tokens (prompts 20-200) x <= 128 anchors a step, the
drafter and the head's loss compiled. 64 steps from a fresh drafter; the pace is the median of steps
9-64 (each step's seconds as train() reports them) and, independently, their wall time: the run's
wall time less step 1..8's. Then a kernel profile of steps 2-6 of a 6-step run.

    $ python ab_step.py NAME OUT_JSON
"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
import bench, train

name, out = sys.argv[1], sys.argv[2]
SHAPE = bench.SHAPES["smollm2-135m"]
target, _ = bench.build_pair(SHAPE)
g = torch.Generator().manual_seed(0)
vocab = target.config.vocab_size
seqs = [train.Sequence(torch.randint(0, vocab - 2, (int(n),), generator=g), int(p))
        for n, p in zip(torch.randint(200, 769, (640,), generator=g), torch.randint(20, 200, (640,), generator=g))]
raw = train.new_drafter_config(target, 3, 16, vocab - 1, 5)


def run(steps, seed=0):
    torch.manual_seed(seed)
    drafter = train.new_drafter(target, raw)
    cfg = train.TrainConfig(epochs=100, batch_size=32, anchors=128, lr=6e-4, eval_every=10**9,
                            max_steps=steps, compile=True, seed=seed)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    history = train.train(target, drafter, seqs, [], cfg, progress=False)
    torch.cuda.synchronize()
    return history, time.perf_counter() - t0


history, wall = run(64)
timed = history[8:]
seconds = [h["blocks"] / h["blocks_per_s"] for h in history]
result = {"run": name, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
          "setting": "train.train, SmolLM2-135M shape (random), 3 layers, cached features, 32 sequences of "
                     "200-768 tokens x <= 128 anchors, --compile",
          "first_step_s": seconds[0], "steps_timed": len(timed),
          "median_step_ms": statistics.median(h["blocks"] / h["blocks_per_s"] for h in timed) * 1e3,
          "median_blocks_per_s": statistics.median(h["blocks_per_s"] for h in timed),
          "median_tflops": statistics.median(h["tflops"] for h in timed),
          "wall_blocks_per_s": sum(h["blocks"] for h in timed) / (wall - sum(seconds[:8])),
          "losses_first_8": [h["loss"] for h in history[:8]],
          "peak_memory_GiB": torch.cuda.max_memory_allocated() / 2**30}
print(json.dumps(result), flush=True)

from torch.profiler import ProfilerActivity, profile, record_function
make_blocks, starts = train.make_blocks, []


def marked_make_blocks(*args, **kwargs):   # marks each step's start: steps 2-6 are profiled, step 1 recompiles
    starts.append(time.perf_counter())
    with record_function("make_blocks"):
        return make_blocks(*args, **kwargs)


train.make_blocks = marked_make_blocks
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    history6, _ = run(6, seed=1)
    torch.cuda.synchronize()
    end = time.perf_counter()
marks = sorted(e.time_range.start for e in prof.events() if e.name == "make_blocks")
kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.start >= marks[1]]
result["profile_steps_2_to_6"] = {"wall_ms_per_step": (end - starts[1]) / 5 * 1e3, "kernels_per_step": len(kernels) / 5,
                                  "kernel_ms_per_step": sum(e.device_time for e in kernels) / 5 / 1e3,
                                  "steps_ms": [h["blocks"] / h["blocks_per_s"] * 1e3 for h in history6]}
print(result["profile_steps_2_to_6"], flush=True)
table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=80)
print(table)
result["profile_table_6_steps_with_capture"] = table
json.dump(result, open(out, "w"), indent=1)
