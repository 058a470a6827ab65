"""What an inductor cache hit changes in train.train's loop, on the H200: batch_sweep.py's setting (a
SmolLM2-135M-shaped target with random weights, 3 layers, cached features, 32 sequences of 200-768
tokens x <= 128 anchors, --compile), 24 steps; steps 11-18 profiled (CPU and CUDA), the profile
scheduled from a global optimizer-step hook. Run it twice on a fresh machine: the first process compiles
and fills inductor's caches, the second finds its graphs there.

    $ [PROBE_PATH=DIR] python cache_probe.py OUT_PREFIX   # OUT_PREFIX.json (step times), OUT_PREFIX.txt (tables)
"""
import json, os, statistics, sys
sys.path.insert(0, os.getcwd())
sys.path[:0] = [d for d in os.environ.get("PROBE_PATH", "").split(":") if d]   # e.g. an older train.py first
import torch
import torch.optim.optimizer
from torch.profiler import ProfilerActivity, profile, schedule
import bench, train

out = sys.argv[1]
target, _ = bench.build_pair(bench.SHAPES["smollm2-135m"])
g = torch.Generator().manual_seed(0)
vocab = target.config.vocab_size
seqs = [train.Sequence(torch.randint(0, vocab - 2, (int(n),), generator=g), int(p))
        for n, p in zip(torch.randint(200, 769, (2048,), generator=g), torch.randint(20, 200, (2048,), generator=g))]
torch.manual_seed(0)
drafter = train.new_drafter(target, train.new_drafter_config(target, 3, 16, vocab - 1, 5))
cfg = train.TrainConfig(epochs=100, batch_size=32, anchors=128, lr=6e-4, eval_every=10**9, max_steps=24,
                        compile=True, seed=0)
prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
               schedule=schedule(wait=9, warmup=1, active=8, repeat=1))
hook = torch.optim.optimizer.register_optimizer_step_post_hook(lambda *_: prof.step())
with prof:
    history = train.train(target, drafter, seqs, [], cfg, progress=False)
hook.remove()
step_ms = [h["blocks"] / h["blocks_per_s"] * 1e3 for h in history]
result = {"fx_graph_cache": os.environ.get("TORCHINDUCTOR_FX_GRAPH_CACHE", "default"),
          "step_ms": step_ms, "median_step_ms_9_24": statistics.median(step_ms[8:]),
          "losses_first_4": [h["loss"] for h in history[:4]]}
events = prof.key_averages()
result["top_device"] = [{"name": e.key[:120], "calls": e.count, "device_ms": e.self_device_time_total / 1e3}
                        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]]
result["top_cpu"] = [{"name": e.key[:120], "calls": e.count, "cpu_ms": e.self_cpu_time_total / 1e3}
                     for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]]
result["device_ms_total"] = sum(e.self_device_time_total for e in events) / 1e3
result["kernel_calls"] = sum(e.count for e in events if e.self_device_time_total > 0)
json.dump(result, open(out + ".json", "w"), indent=1)
with open(out + ".txt", "w") as f:
    f.write(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=90) + "\n")
    f.write(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90) + "\n")
print(f"median step {result['median_step_ms_9_24']:.1f} ms; profiled 8 steps: device {result['device_ms_total']:.1f} ms, "
      f"{result['kernel_calls']} device calls; top device: " +
      "; ".join(f"{e['name'][:50]} {e['device_ms']:.1f}" for e in result["top_device"][:4]))
