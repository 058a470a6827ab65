"""Training step with the head's loss chunk eager against compiled (train --compile now compiles both the
drafter's forward and train.head_chunk_grad), then a kernel profile of the compiled step. Phase 7's
setting: 3 layers, cached features, groups of 8, 32 random sequences of 200-768 tokens (prompts 20-200)
x <= 128 anchors a step, each run its own batches. Median of 20 steps after 4. Also: the two losses on
one batch with one drafter, and the step's kernel time against its wall time."""
import functools, json, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
import bench, train
SHAPE = bench.SHAPES["smollm2-135m"]
OUT = os.environ["OUT"]
target, _ = bench.build_pair(SHAPE)
g = torch.Generator().manual_seed(0)
vocab = target.config.vocab_size
seqs = [train.Sequence(torch.randint(0, vocab - 2, (int(n),), generator=g), int(p))
        for n, p in zip(torch.randint(200, 769, (640,), generator=g), torch.randint(20, 200, (640,), generator=g))]
raw = train.new_drafter_config(target, 3, 16, vocab - 1, 5)
cached = train.CachedFeatures(target, seqs, raw["dflash_config"]["target_layer_ids"], torch.bfloat16)
weights = train.position_weights(16, 7.0, "cuda")
compiled_chunk = torch.compile(train.head_chunk_grad, dynamic=True)
result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "setting":
          "3 layers, cached features, groups of 8, 32 sequences of 200-768 tokens x <= 128 anchors, drafter compiled",
          "runs": []}


def step(drafter, opt, idx, gen, chunk_grad):
    f, l = cached.batch(idx)
    b = train.make_blocks([seqs[j] for j in idx], 128, 16, drafter.config.mask_token_id, gen, labels=l)
    with train.autocast(f.device):
        loss = train.block_loss(target, train.draft_hidden(target, drafter, b, f), b.labels, weights, chunk_grad)
    opt.zero_grad(set_to_none=True); loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0); opt.step()
    return loss, b


def fresh():
    torch.manual_seed(0)
    drafter = train.new_drafter(target, raw)
    drafter.compile(dynamic=True)
    return drafter, torch.optim.AdamW(drafter.parameters(), lr=1e-4)


for name, chunk_grad, seed in [("head loss eager", train.head_chunk_grad, 1), ("head loss compiled", compiled_chunk, 2)]:
    drafter, opt = fresh()
    gen = torch.Generator().manual_seed(seed)
    times, blocks = [], []
    t_first = time.perf_counter()
    for i in range(24):
        idx = torch.randperm(len(seqs), generator=gen)[:32].tolist()
        torch.cuda.synchronize(); t0 = time.perf_counter()
        loss, b = step(drafter, opt, idx, gen, chunk_grad)
        loss.item(); torch.cuda.synchronize()
        if i == 0:
            first_s = time.perf_counter() - t_first
        if i >= 4:
            times.append(time.perf_counter() - t0); blocks.append(b.drawn())
    s = statistics.median(times)
    result["runs"].append({"run": name, "step_ms": s * 1e3, "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3,
                           "blocks_per_s": statistics.median(blocks) / s, "first_step_s": first_s, "steps": len(times)})
    print(result["runs"][-1], flush=True)

# the same batch, the same drafter: eager and compiled chunk give the same loss (bf16 autocast)
drafter, _ = fresh()
idx = list(range(32))
f, l = cached.batch(idx)
b = train.make_blocks([seqs[j] for j in idx], 128, 16, drafter.config.mask_token_id, torch.Generator().manual_seed(9), labels=l)
with torch.no_grad(), train.autocast(f.device):
    hidden = train.draft_hidden(target, drafter, b, f)
    losses = [train.block_loss(target, hidden, b.labels, weights, c).item() for c in (train.head_chunk_grad, compiled_chunk)]
result["same_batch_loss"] = {"eager": losses[0], "compiled": losses[1], "rel_diff": abs(losses[0] - losses[1]) / losses[0]}
print(result["same_batch_loss"], flush=True)
json.dump(result, open(f"{OUT}/ab-head.json", "w"), indent=1)

# kernel profile of 3 compiled steps
from torch.profiler import profile, ProfilerActivity
drafter, opt = fresh()
gen = torch.Generator().manual_seed(3)
for _ in range(3):
    step(drafter, opt, torch.randperm(len(seqs), generator=gen)[:32].tolist(), gen, compiled_chunk)[0].item()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter()
    for _ in range(3):
        step(drafter, opt, torch.randperm(len(seqs), generator=gen)[:32].tolist(), gen, compiled_chunk)[0].item()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 3
events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
kernel_us = sum(e.self_device_time_total for e in events) / 3
top = sorted(events, key=lambda e: -e.self_device_time_total)[:40]
result["profile"] = {"wall_ms_per_step": wall * 1e3, "kernel_ms_per_step": kernel_us / 1e3,
                     "kernels_per_step": sum(e.count for e in events) / 3,
                     "top": [{"name": e.key[:120], "ms_per_step": e.self_device_time_total / 3e3, "calls_per_step": e.count / 3}
                             for e in top]}
print(f"profile: wall {wall * 1e3:.1f} ms/step, kernels {kernel_us / 1e3:.1f} ms/step, "
      f"{result['profile']['kernels_per_step']:.0f} kernels/step")
for t in result["profile"]["top"][:30]:
    print(f"{t['ms_per_step']:8.2f} ms {t['calls_per_step']:6.0f}x  {t['name']}")
cpu = sorted([e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU],
             key=lambda e: -e.self_cpu_time_total)[:15]
result["profile"]["cpu_top"] = [{"name": e.key[:120], "self_cpu_ms_per_step": e.self_cpu_time_total / 3e3} for e in cpu]
for t in result["profile"]["cpu_top"]:
    print(f"cpu {t['self_cpu_ms_per_step']:8.2f} ms  {t['name']}")
json.dump(result, open(f"{OUT}/ab-head.json", "w"), indent=1)
