"""The packed forward's BlockMask built two ways at phase 13's shapes (32 sequences of 200-768 positions,
<= 128 blocks of 16 each; anchors as train.choose_anchors draws them), over 12 batches of new shapes:
create_block_mask eagerly (train.packed_mask today: the rule evaluated over the whole dense grid), and
torch.compile(create_block_mask, dynamic=True). For each: host ms to build (no sync), ms to build with
the GPU done (synchronized), peak GiB, and whether the two give the same tiles. Median over the last 8.

    $ python mask_probe.py [OUT_JSON] [--device cuda]
"""
import argparse, json, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
from torch.nn.attention.flex_attention import create_block_mask
import train

p = argparse.ArgumentParser()
p.add_argument("out", nargs="?")
p.add_argument("--device", default="cuda")
p.add_argument("--batches", type=int, default=12)
args = p.parse_args()
cuda = args.device.startswith("cuda")
sync = torch.cuda.synchronize if cuda else (lambda: None)
g = torch.Generator().manual_seed(0)
B, Bt = 16, 32
batches = []
for _ in range(args.batches):
    lengths = torch.randint(200, 769, (Bt,), generator=g)
    prompts = torch.randint(20, 150, (Bt,), generator=g)   # leaves >= 34 anchor places
    anchors = [sorted(torch.randperm(int(n - pl - B), generator=g)[:128] + int(pl)) for n, pl in zip(lengths, prompts)]
    P = max(map(len, anchors))
    block_anchors = torch.zeros(Bt, P, dtype=torch.long)
    for b, a in enumerate(anchors):
        block_anchors[b, :len(a)] = torch.stack(a)
    batches.append((block_anchors.to(args.device), int(lengths.max())))

builders = {"eager (today)": create_block_mask, "compiled, dynamic": torch.compile(create_block_mask, dynamic=True)}
result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "batches": args.batches}
tiles = {}
for name, build in builders.items():
    host, done, peak, first_s = [], [], [], None
    for i, (block_anchors, N) in enumerate(batches):
        P = block_anchors.shape[1]
        rule = train.packed_rule(block_anchors, B, torch.tensor(N, device=args.device), False, None)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        mask = build(rule, Bt, None, P * B, N + P * B, device=args.device)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        if i == 0:
            first_s = t2 - t0
        host.append((t1 - t0) * 1e3)
        done.append((t2 - t0) * 1e3)
        peak.append(torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0)
        tiles.setdefault(i, []).append(mask.to_dense())
    result[name] = {"host_ms": statistics.median(host[-8:]), "built_ms": statistics.median(done[-8:]),
                    "peak_gib": max(peak), "first_call_s": first_s}
    print(name, result[name], flush=True)
result["same_tiles"] = all(torch.equal(a, b) for a, b in tiles.values())
print("same tiles:", result["same_tiles"])
if args.out:
    json.dump(result, open(args.out, "w"), indent=1)
