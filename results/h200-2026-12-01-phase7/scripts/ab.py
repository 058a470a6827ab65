"""Training step time when every step brings new shapes (as in training): SDPA through cuDNN (the default
on the H200) against cuDNN left out (efficient attention), eager, then cuDNN left out compiled. 3 layers,
cached features, chunked loss, groups of 8, 32 sequences x <= 128 anchors a step (phase 7's setting)."""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
import bench, train
from torch.nn.attention import sdpa_kernel, SDPBackend
SHAPE = bench.SHAPES["smollm2-135m"]
target, _ = bench.build_pair(SHAPE)
g = torch.Generator().manual_seed(0)
vocab = target.config.vocab_size
seqs = [train.Sequence(torch.randint(0, vocab - 2, (int(n),), generator=g), int(p))
        for n, p in zip(torch.randint(200, 769, (640,), generator=g), torch.randint(20, 200, (640,), generator=g))]
layer_ids = train.new_drafter_config(target, 3, 16, vocab - 1, 5)["dflash_config"]["target_layer_ids"]
cached = train.CachedFeatures(target, seqs, layer_ids, torch.bfloat16)
weights = train.position_weights(16, 7.0, "cuda")
rows = []
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
ALL = NO_CUDNN + [SDPBackend.CUDNN_ATTENTION]
for name, backends, compiled, seed, pad in [("cudnn eager", ALL, False, 1, (1, 1)), ("no-cudnn eager", NO_CUDNN, False, 2, (1, 1)),
                                            ("cudnn eager pad64", ALL, False, 3, (64, 1)),
                                            ("no-cudnn compiled", NO_CUDNN, True, 4, (1, 1))]:
    drafter = train.new_drafter(target, train.new_drafter_config(target, 3, 16, vocab - 1, 5))
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    if compiled:
        drafter.compile(dynamic=True)
    gen = torch.Generator().manual_seed(seed)
    times, blocks = [], []
    for i in range(24 if not compiled else 20):
        idx = torch.randperm(len(seqs), generator=gen)[:32].tolist()
        torch.cuda.synchronize(); t0 = time.perf_counter()
        with sdpa_kernel(backends):
            f, l = train.pad_positions(*cached.batch(idx), pad[0])
            b = train.make_blocks([seqs[j] for j in idx], 128, 16, drafter.config.mask_token_id, gen, labels=l)
            with train.autocast(f.device):
                loss = train.block_loss(target, train.draft_hidden(target, drafter, b, f), b.labels, weights)
            opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        torch.cuda.synchronize()
        if i >= 4:
            times.append(time.perf_counter() - t0); blocks.append(b.drawn())
    s = statistics.median(times)
    rows.append({"run": name, "step_ms": s * 1e3, "blocks_per_s": statistics.median(blocks) / s,
                 "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3, "steps": len(times)})
    print(rows[-1], flush=True)
json.dump(rows, open(os.environ["OUT"] + "/ab-sdpa.json", "w"), indent=1)
