"""The packed forward's attention alone (one layer, forward and backward, bf16) at phase 13's training
shapes (32 sequences of 200-768 positions, <= 128 blocks of 16, SmolLM2's drafter heads: 9 query heads,
3 K/V heads, head dim 64), through compiled flex attention as train.packed_forward calls it, and
variants that say where its time goes:

  today          train.packed_rule, BlockMask tiles of 128 (train.packed_mask), default kernel options
  tiles 64       the same rule, tiles of 64 (more skipped), the kernel's blocks 64 x 64
  row table      the rule reading each query row's anchor from a (Bt, P*B) table, no q // B
  no mask_mod    today's BlockMask, but the kept tiles apply no rule (wrong rows: the cost of the rule)
  dense          no mask at all: every tile computed (the kernel's pace without sparsity)

CUDA events, median of 20 after 5; per variant: ms forward, ms forward + backward, tiles kept, and the
largest difference from today's output (the rule variants must give the same rows).

    $ python flex_probe.py [OUT_JSON]

It calls train.py as it was when it was written (628356e: `packed_mask(rule, Bt, rows, N, device, sparse)`,
one flex call over [context | own rows]); both changed since. Run it in a worktree at 628356e.
"""
import json, os, statistics, sys
sys.path.insert(0, os.getcwd())
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
import bench, train

device, dtype = "cuda", torch.bfloat16
Bt, B, h, hk, d, per_seq = 32, 16, 9, 3, 64, 128
g = torch.Generator().manual_seed(0)
lengths = torch.randint(200, 769, (Bt,), generator=g)
prompts = torch.randint(20, 150, (Bt,), generator=g)
block_anchors = torch.zeros(Bt, per_seq, dtype=torch.long)                               # (Bt, P), padding at 0
for b, (n, pl) in enumerate(zip(lengths.tolist(), prompts.tolist())):
    a = sorted((torch.randperm(n - pl - B, generator=g)[:per_seq] + pl).tolist())
    block_anchors[b, :len(a)] = torch.tensor(a)
N, R = int(lengths.max()), per_seq * B
block_anchors = block_anchors.to(device)
q = torch.randn(Bt, h, R, d, generator=g).to(device, dtype)                              # (Bt, h, R, d)
k, v = (torch.randn(Bt, hk, N + R, d, generator=g).to(device, dtype) for _ in range(2))  # (Bt, hk, N+R, d)
grad_out = torch.randn(Bt, h, R, d, generator=g).to(device, dtype)
N_t = torch.tensor(N, device=device)
rule = train.packed_rule(block_anchors, B, N_t, False, None)
row_anchor = block_anchors.repeat_interleave(B, 1)                                        # (Bt, R)


def row_table_rule(b, head, qi, kv):
    anchor = row_anchor[b, qi]
    return torch.where(kv < N_t, kv < anchor, (kv - N_t) // B == qi // B)


def no_rule(b, head, qi, kv):
    return qi >= 0


attend = torch.compile(flex_attention)
today = train.packed_mask(rule, Bt, R, N, device, True)
variants = {
    "today": (today, {}),
    "tiles 64": (create_block_mask(rule, Bt, None, R, N + R, device=device, BLOCK_SIZE=64),
                 {"BLOCK_M": 64, "BLOCK_N": 64}),
    "row table": (create_block_mask(row_table_rule, Bt, None, R, N + R, device=device), {}),
    "no mask_mod": (type(today).from_kv_blocks(today.kv_num_blocks, today.kv_indices, today.full_kv_num_blocks,
                                   today.full_kv_indices, BLOCK_SIZE=today.BLOCK_SIZE,
                                   mask_mod=no_rule, seq_lengths=(R, N + R)), {}),
    "dense": (None, {}),
}


def timed(fn):
    """Median ms of fn, CUDA events around each call, 20 after 5 warm-ups (bench.graph_time)."""
    return bench.graph_time(fn, iters=20)


result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "Bt": Bt, "N": N, "R": R,
          "heads": [h, hk, d], "variants": {}}
want = None
print(f"{Bt} sequences, N {N}, {R} query rows each; heads {h}/{hk}, d {d}; bf16; one layer")
for name, (mask, options) in variants.items():
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    call = lambda: attend(*leaves, block_mask=mask, enable_gqa=True, kernel_options=options or None)
    try:
        out = call()
        out.backward(grad_out)
        fwd = timed(lambda: call().detach())
        both = timed(lambda: call().backward(grad_out))
    except Exception as error:   # a variant the kernel refuses is reported, not fatal
        result["variants"][name] = {"error": repr(error)[:400]}
        print(f"{name:12s} failed: {repr(error)[:200]}", flush=True)
        continue
    kept = None if mask is None else 100 - float(mask.sparsity())
    diff = None if want is None or name in ("no mask_mod", "dense") else (out.float() - want).abs().max().item()
    want = out.detach().float() if want is None else want
    result["variants"][name] = {"fwd_ms": fwd, "fwd_bwd_ms": both, "tiles_kept_percent": kept, "max_diff_from_today": diff}
    print(f"{name:12s} forward {fwd:6.3f} ms  forward+backward {both:6.3f} ms  tiles kept "
          f"{'all' if kept is None else f'{kept:.1f}%'}  diff {diff}", flush=True)
if len(sys.argv) > 1:
    json.dump(result, open(sys.argv[1], "w"), indent=1)
