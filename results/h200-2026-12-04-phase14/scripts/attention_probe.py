"""The packed forward's attention alone, two ways, forward and backward, at phase 13's training shapes:

  groups: today's (train.packed_forward): blocks in groups of 8 of one sequence; each group gets a copy
          of its sequence's context K/V, its own rows' K/V concatenated, the K/V heads repeated for GQA,
          and SDPA under a dense (G, 1, 128, N + 128) mask (train.packed_mask);
  flex:   one query run per sequence over [its context | all its block rows], GQA in the kernel, and a
          BlockMask with the same rule, so masked tiles are skipped and nothing is copied per group.

Both compute the same rows: on CPU (float32, forward only: flex attention has no CPU backward) the
script checks them equal and exits; on CUDA (bf16) it compares outputs and gradients, then times both,
forward and backward, median of 20 after 5, CUDA events, with flex_attention compiled.

    $ python attention_probe.py [OUT_JSON] [--device cuda] [--sequences 32]
"""
import argparse, json, os, statistics, sys
sys.path.insert(0, os.getcwd())
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
import train

p = argparse.ArgumentParser()
p.add_argument("out", nargs="?")
p.add_argument("--device", default="cpu")
p.add_argument("--sequences", type=int, default=32)
args = p.parse_args()
device, cuda = torch.device(args.device), args.device.startswith("cuda")
dtype = torch.bfloat16 if cuda else torch.float32
B, h, hk, d, per_seq = 16, 9, 3, 64, 128   # block, heads, K/V heads, head dim (SmolLM2), blocks a sequence at most
g = torch.Generator().manual_seed(0)

# sequences of 200-768 tokens, prompts 20-200, up to 128 anchors each in the response (train.choose_anchors)
lengths = torch.randint(200, 769, (args.sequences,), generator=g)
prompts = torch.randint(20, 200, (args.sequences,), generator=g)
anchor_lists = []
for n, pl in zip(lengths.tolist(), prompts.tolist()):
    valid = list(range(pl, n - 1))
    anchor_lists.append(sorted(valid[i] for i in torch.randperm(len(valid), generator=g)[:per_seq].tolist()))
N = int(lengths.max())
sequence = torch.tensor([s for s, a in enumerate(anchor_lists) for _ in a])            # (M,)
anchors = torch.tensor([x for a in anchor_lists for x in a])                            # (M,)
M = len(anchors)

ctx_k, ctx_v = (torch.randn(args.sequences, hk, N, d, generator=g).to(device, dtype) for _ in range(2))   # (Bt, hk, N, d)
row_q = torch.randn(M, B, h, d, generator=g).to(device, dtype)                          # (M, B, h, d)
row_k, row_v = (torch.randn(M, B, hk, d, generator=g).to(device, dtype) for _ in range(2))   # (M, B, hk, d)
leaves = [ctx_k, ctx_v, row_q, row_k, row_v]
grad_out = torch.randn(M, B, h, d, generator=g).to(device, dtype)

# today's groups, as train.packed_forward builds them
group = train.default_group(B)
owners, slots = train.attention_groups(sequence, group)                                 # (G,), (G, g)
owners, slots = owners.to(device), slots.to(device)
padded_anchors = torch.cat([anchors, anchors.new_zeros(1)]).to(device)                  # (M+1,)
row_anchors = padded_anchors[slots].repeat_interleave(B, -1)                            # (G, g·B)
slot_of_row = torch.arange(group * B, device=device).expand_as(row_anchors) // B       # (G, g·B)
dense_mask = train.packed_mask(row_anchors, slot_of_row, B, N, False, None)            # (G, 1, g·B, N+g·B)
where = torch.empty(M + 1, dtype=torch.long, device=device)
where[slots.flatten()] = torch.arange(slots.numel(), device=device)


def groups_attention(ck, cv, q, k, v):
    """-> (M, B, h, d), as DraftAttention.forward inside train.packed_forward."""
    pad = lambda t: torch.cat([t, t.new_zeros(1, *t.shape[1:])])[slots].flatten(1, 2)  # (G, g·B, heads, d)
    qg, kg, vg = (pad(t).transpose(1, 2) for t in (q, k, v))                            # (G, heads, g·B, d)
    keys = torch.cat([ck[owners], kg], -2).repeat_interleave(h // hk, 1)                # (G, h, N+g·B, d)
    values = torch.cat([cv[owners], vg], -2).repeat_interleave(h // hk, 1)
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=dense_mask)          # (G, h, g·B, d)
    return o.transpose(1, 2).unflatten(1, (group, B)).flatten(0, 1)[where[:M]]         # (M, B, h, d)


# flex: each sequence's blocks in order, padded to per_seq blocks; a padding block sees only itself
R = per_seq * B
first = torch.zeros(args.sequences + 1, dtype=torch.long)
first[1:] = torch.cumsum(torch.tensor([len(a) for a in anchor_lists]), 0)
index_in_seq = torch.arange(M) - first[sequence]                                         # (M,)
seq_anchor = torch.full((args.sequences, per_seq), -1, dtype=torch.long)                 # (Bt, blocks)
seq_anchor[sequence, index_in_seq] = anchors
seq_anchor = seq_anchor.to(device)
flat_row = (sequence * per_seq + index_in_seq).to(device)                                # (M,) block's slot


def mask_mod(b, head, q_idx, kv_idx):
    anchor = seq_anchor[b, q_idx // B]
    context = (kv_idx < N) & (kv_idx < anchor)
    own = (kv_idx >= N) & ((kv_idx - N) // B == q_idx // B)
    return context | own


block_mask = create_block_mask(mask_mod, args.sequences, None, R, N + R, device=args.device)
attend = torch.compile(flex_attention) if cuda else flex_attention


def flex_rows(t, heads):
    """(M, B, heads, d) -> (Bt, heads, R, d), each sequence's blocks in its slots, zeros elsewhere."""
    out = t.new_zeros(args.sequences * per_seq, B, heads, d).index_copy(0, flat_row, t)
    return out.unflatten(0, (args.sequences, per_seq)).flatten(1, 2).transpose(1, 2)


def flex_attention_rows(ck, cv, q, k, v):
    keys = torch.cat([ck, flex_rows(k, hk)], -2)                                         # (Bt, hk, N+R, d)
    values = torch.cat([cv, flex_rows(v, hk)], -2)
    o = attend(flex_rows(q, h), keys, values, block_mask=block_mask, enable_gqa=True)     # (Bt, h, R, d)
    return o.transpose(1, 2).unflatten(1, (per_seq, B)).flatten(0, 1)[flat_row]         # (M, B, h, d)


def run(fn):
    """Forward and backward (on CUDA) -> output, gradients of the leaves."""
    inputs = [t.detach().requires_grad_(cuda) for t in leaves]
    out = fn(*inputs)
    if cuda:
        out.backward(grad_out)
    return out.detach(), [t.grad for t in inputs if t.grad is not None]


result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "dtype": str(dtype),
          "sequences": args.sequences, "blocks": M, "groups": int(len(owners)), "N": N, "R": R,
          "block_mask_sparsity_percent": float(block_mask.sparsity())}
want, want_grads = run(groups_attention)
got, got_grads = run(flex_attention_rows)
errors = [(got - want).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(got_grads, want_grads)]
result["max_abs_difference_out_and_grads"] = errors
print(json.dumps({k: v for k, v in result.items()}))
if not cuda:
    assert max(errors) < 1e-4, errors
    print("flex attention rows equal the groups' (float32, CPU)")
else:
    for name, fn in [("groups", groups_attention), ("flex", flex_attention_rows)]:
        for _ in range(5):
            run(fn)
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(fn)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        result[f"{name}_ms_fwd_bwd"] = statistics.median(times)
        print(f"{name}: {result[f'{name}_ms_fwd_bwd']:.2f} ms forward + backward, one layer (median of 20)")
if args.out:
    json.dump(result, open(args.out, "w"), indent=1)
