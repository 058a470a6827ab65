"""Training's pace against its batch, on the H200: train.train's own loop (as ab_step.py in
../../h200-2026-12-02-step/ runs it), a SmolLM2-135M-shaped target with random weights, 3 drafter
layers, cached features, random sequences of 200-768 tokens (prompts 20-200) x <= 128 anchors, the
drafter and the head's loss compiled. For each batch: 48 steps from a fresh drafter; the pace is the
median of steps 9-48 as train() reports them (blocks/s, TFLOP/s), and the peak memory.
--pad-positions M pads each step's context to a multiple of M positions (train --pad-shapes M 1;
phase 16's next call: M = 128 lines the block rows up with flex attention's tiles).

    $ [PROBE_PATH=DIR] python batch_sweep.py OUT_JSON [BATCH ...] [--pad-positions M]   # default batches 32 64 128, M 1

PROBE_PATH (phase 17): directories searched before the checkout, e.g. an older train.py and dflash.py.
"""
import argparse, json, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
sys.path[:0] = [d for d in os.environ.get("PROBE_PATH", "").split(":") if d]
import torch
import bench, train

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("batches", type=int, nargs="*")
p.add_argument("--pad-positions", type=int, default=1)
args = p.parse_args()
out, batches = args.out, args.batches or [32, 64, 128]
target, _ = bench.build_pair(bench.SHAPES["smollm2-135m"])
g = torch.Generator().manual_seed(0)
vocab = target.config.vocab_size
seqs = [train.Sequence(torch.randint(0, vocab - 2, (int(n),), generator=g), int(p))
        for n, p in zip(torch.randint(200, 769, (2048,), generator=g), torch.randint(20, 200, (2048,), generator=g))]
raw = train.new_drafter_config(target, 3, 16, vocab - 1, 5)
result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
          "setting": "train.train, SmolLM2-135M shape (random weights), 3 layers, cached features, sequences of "
                     "200-768 tokens (prompts 20-200) x <= 128 anchors, --compile; median of steps 9-48", "runs": []}
for batch in batches:
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    drafter = train.new_drafter(target, raw)
    cfg = train.TrainConfig(epochs=100, batch_size=batch, anchors=128, lr=6e-4, eval_every=10**9,
                            max_steps=48, compile=True, seed=0, pad_shapes=(args.pad_positions, 1))
    t0 = time.perf_counter()
    history = train.train(target, drafter, seqs, [], cfg, progress=False)
    torch.cuda.synchronize()
    timed = history[8:]
    run = {"batch": batch, "pad_positions": args.pad_positions, "wall_s": time.perf_counter() - t0,
           "median_blocks_per_step": statistics.median(h["blocks"] for h in timed),
           "median_step_ms": statistics.median(h["blocks"] / h["blocks_per_s"] for h in timed) * 1e3,
           "median_blocks_per_s": statistics.median(h["blocks_per_s"] for h in timed),
           "median_tflops": statistics.median(h["tflops"] for h in timed),
           "peak_memory_GiB": torch.cuda.max_memory_allocated() / 2 ** 30,
           "losses_first_4": [h["loss"] for h in history[:4]]}
    result["runs"].append(run)
    print(json.dumps(run), flush=True)
    del drafter
    torch.cuda.empty_cache()
print(f"\n{result['setting']}\n{'batch':>5} {'blocks/step':>11} {'ms/step':>8} {'blocks/s':>9} {'TFLOP/s':>8} {'peak GiB':>8}")
for r in result["runs"]:
    print(f"{r['batch']:5} {r['median_blocks_per_step']:11.0f} {r['median_step_ms']:8.1f} {r['median_blocks_per_s']:9.0f} "
          f"{r['median_tflops']:8.1f} {r['peak_memory_GiB']:8.1f}")
json.dump(result, open(out, "w"), indent=1)
