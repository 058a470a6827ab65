"""Where a training step's time goes, kernel by kernel: train.train's step in phase 13's setting (a
SmolLM2-135M-shaped target with random weights, 3 drafter layers, cached features, 32 random sequences
of 200-768 tokens (prompts 20-200) x <= 128 anchors, the drafter and the head's loss compiled), timed
with the GPU synchronized over 20 steps after 12 of warm-up, then profiled over 10 more. The kernels are
grouped (GEMMs, attention, the head's loss chunk, other compiled kernels, eager elementwise, copies,
the optimizer) with their time per step; the top kernels are listed. The batch sweep
(../../h200-2026-12-04-stored/) showed the pace is the kernels'; this says which.

    $ python step_profile.py OUT_JSON [--soft] [--code DIR] [--device cpu --sequences 4 --no-compile]   # the last: a smoke run

It also times each part of a step on the host (enqueue times, the GPU running behind; the packed
forward's block_slots and packed_mask within draft_hidden). --soft profiles logit distillation's step
(train --soft-labels). --code DIR imports train.py and dflash.py from DIR before the checkout's (phase
15: the packed forward before flex attention, in old/, made as ../README.md says). Written for phase 14;
phase 15 added those two and grouped attention kernels before GEMMs (cutlass named the memory-efficient
attention's kernels into the GEMMs).
"""
import argparse, json, os, re, statistics, sys, time
p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--code", help="a folder whose train.py and dflash.py are imported first")
p.add_argument("--soft", action="store_true")
p.add_argument("--device", default="cuda")
p.add_argument("--sequences", type=int, default=32, help="sequences a step")
p.add_argument("--no-compile", action="store_true")
args = p.parse_args()
sys.path[:0] = ([args.code] if args.code else []) + [os.getcwd()]
import torch
import bench, train

device, cuda = torch.device(args.device), args.device.startswith("cuda")

target, _ = bench.build_pair(bench.SHAPES["smollm2-135m"], torch.bfloat16 if cuda else torch.float32, args.device)
g = torch.Generator().manual_seed(0)
vocab = target.config.vocab_size
count = max(64 * args.sequences, 8)
seqs = [train.Sequence(torch.randint(0, vocab - 2, (int(n),), generator=g), int(pl))
        for n, pl in zip(torch.randint(200, 769, (count,), generator=g), torch.randint(20, 200, (count,), generator=g))]
raw = train.new_drafter_config(target, 3, 16, vocab - 1, 5)
torch.manual_seed(0)
drafter = train.new_drafter(target, raw)
target.requires_grad_(False)
drafter.train().requires_grad_(True)
if not args.no_compile:
    if hasattr(train, "compile_drafter"):   # as train --compile (phase 18: the context's path too)
        train.compile_drafter(drafter)
    else:
        drafter.compile(**getattr(train, "COMPILE", {"dynamic": True}))   # (phase 17: caches off)
chunk_grad = train.head_loss_chunk(not args.no_compile, args.soft)
weights = train.position_weights(16, train.default_gamma(16), device)
store = train.CachedFeatures(target, seqs, raw["dflash_config"]["target_layer_ids"], target.dtype, args.soft)
optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
mask_id = drafter.config.mask_token_id


host = {}   # host seconds of the current step by part: the GPU runs behind, so these are enqueue times


def timed_part(name, fn):
    """fn, with its host seconds added to host[name]."""
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        host[name] = host.get(name, 0.0) + time.perf_counter() - t0
        return out
    return run


for name in ("block_slots", "packed_mask"):   # the packed forward's host work (absent before flex attention)
    if hasattr(train, name):
        setattr(train, name, timed_part(name, getattr(train, name)))


def step(i: int) -> int:
    """One step of train.train's loop on batch i -> its blocks; host[...] gets each part's host seconds."""
    host.clear()
    t0 = time.perf_counter()
    indices = list(range(i * args.sequences, (i + 1) * args.sequences))
    features, labels, teacher = train.pad_positions(*store.batch(indices), 1)
    blocks = train.make_blocks([seqs[j] for j in indices], 128, 16, mask_id, g, labels=labels)
    t1 = time.perf_counter()
    with train.autocast(device):
        hidden = train.draft_hidden(target, drafter, blocks, features)
        t2 = time.perf_counter()
        loss = train.block_loss(target, hidden, blocks.labels, weights, chunk_grad,
                                None if teacher is None else train.block_teacher(teacher, blocks))
    t3 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    t4 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    optimizer.step()
    t5 = time.perf_counter()
    host.update({"batch": t1 - t0, "draft_hidden": t2 - t1, "loss": t3 - t2, "backward": t4 - t3,
                 "clip and optimizer": t5 - t4, "step (enqueued)": t5 - t0})
    return blocks.drawn()


sync = torch.cuda.synchronize if cuda else (lambda: None)
warmup, timed, profiled = (12, 20, 10) if cuda else (1, 2, 1)
for i in range(warmup):
    step(i)
sync()
times, blocks, host_parts = [], [], []
for i in range(warmup, warmup + timed):
    t0 = time.perf_counter()
    blocks.append(step(i))
    host_parts.append(dict(host))
    sync()
    times.append(time.perf_counter() - t0)
host_ms = {name: statistics.median(parts.get(name, 0.0) for parts in host_parts) * 1e3 for name in host_parts[0]}

activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
with torch.profiler.profile(activities=activities) as prof:
    for i in range(warmup + timed, warmup + timed + profiled):
        step(i)
    sync()

GROUPS = [("attention", r"fmha|flash|flex|attention|efficient"),
          ("GEMM", r"gemm|cutlass|nvjet|sm90_xmma|cublas|splitk"),
          # the drafter's compiled own-row attention (attend_packed) fuses a logsumexp and a logaddexp; the
          # head's loss is the Triton _head_chunk_grad, or log_softmax kernels compiled for --soft
          ("attention", r"^triton\w*(logsumexp|logaddexp)"),
          ("head loss chunk", r"log_softmax|_softmax|head_chunk_grad"),
          ("other compiled (Triton)", r"^triton"),
          ("optimizer", r"multi_tensor|adam|foreach"),
          ("copies, fills", r"memcpy|memset|copy|fill|cat|index|gather|scatter"),
          ("eager elementwise, reductions", r"elementwise|vectorized|reduce|unrolled")]
kernels = {}
for event in prof.key_averages():
    is_kernel = event.device_type == torch.autograd.DeviceType.CUDA if cuda else event.self_cpu_time_total > 0
    if not is_kernel:
        continue
    us = (getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)) if cuda \
        else event.self_cpu_time_total
    kernels[event.key] = {"us_per_step": us / profiled, "calls_per_step": event.count / profiled}
grouped = {}
for name, k in kernels.items():
    group = next((gname for gname, pattern in GROUPS if re.search(pattern, name, re.I)), "other")
    entry = grouped.setdefault(group, {"us_per_step": 0.0, "kernels_per_step": 0.0})
    entry["us_per_step"] += k["us_per_step"]
    entry["kernels_per_step"] += k["calls_per_step"]
step_ms = statistics.median(times) * 1e3
kernel_ms = sum(k["us_per_step"] for k in kernels.values()) / 1e3
result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
          "code": os.path.abspath(train.__file__),
          "setting": f"train.train's step, SmolLM2-135M shape (random weights), 3 layers, cached features, "
                     f"{args.sequences} sequences of 200-768 tokens x <= 128 anchors, "
                     f"{'compiled' if not args.no_compile else 'eager'}, {'--soft-labels' if args.soft else 'argmax labels'}; "
                     f"median of {timed} steps after {warmup}, profile of {profiled}",
          "median_step_ms": step_ms, "median_blocks": statistics.median(blocks),
          "blocks_per_s": statistics.median(blocks) / statistics.median(times),
          "kernel_ms_per_step": kernel_ms, "host_ms_median": host_ms, "groups": grouped,
          "top_kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_step"])[:30])}
json.dump(result, open(args.out, "w"), indent=1)
print(result["setting"])
print(f"step {step_ms:.1f} ms (median), {result['blocks_per_s']:.0f} blocks/s; kernels {kernel_ms:.1f} ms a step")
print("host ms a step (median; the time to enqueue each part, the GPU behind): "
      + ", ".join(f"{name} {ms:.1f}" for name, ms in host_ms.items()))
print(f"{'group':32} {'ms/step':>8} {'share':>6} {'kernels':>8}")
for group, entry in sorted(grouped.items(), key=lambda kv: -kv[1]["us_per_step"]):
    print(f"{group:32} {entry['us_per_step'] / 1e3:8.2f} {entry['us_per_step'] / 1e3 / kernel_ms:6.1%} "
          f"{entry['kernels_per_step']:8.0f}")
print("\ntop kernels, µs a step (calls):")
for name, k in list(result["top_kernels"].items())[:15]:
    print(f"{k['us_per_step']:9.0f} ({k['calls_per_step']:.0f})  {name[:110]}")
