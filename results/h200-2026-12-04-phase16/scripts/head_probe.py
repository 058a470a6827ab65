"""The head's loss chunk at training's size (8,192 rows of bf16 logits over SmolLM2's 49,152-word
vocabulary): the plain-torch math eager and compiled by inductor (dynamic rows, as train --compile
had it), and the Triton kernel train.triton_head_chunk_grad at several tiles and warps. CUDA events,
median of 20 after 5 warm-ups; the floor is one read of the logits and one write of the gradient at
the copy bandwidth measured in the same run (the kernel reads each row twice; the second read may
come from L2). Each result's loss and gradient are checked against the eager math.

    $ python head_probe.py [OUT_JSON]
"""
import json, os, statistics, sys
sys.path.insert(0, os.getcwd())
import torch
import bench, train

rows, V = train.CE_CHUNK, 49152
g = torch.Generator(device="cuda").manual_seed(0)
logits = (3 * torch.randn(rows, V, device="cuda", generator=g)).bfloat16()          # (c, V)
labels = torch.randint(0, V, (rows,), device="cuda", generator=g)
w = torch.rand(rows, device="cuda", generator=g)


def timed(fn):
    """Median ms of fn, CUDA events around each call, 20 after 5 warm-ups (bench.graph_time)."""
    return bench.graph_time(fn, iters=20)


big = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
copy_ms = timed(lambda: big.clone())
bandwidth = 2 * big.numel() / (copy_ms * 1e-3)                                         # bytes/s, read + write
floor_ms = 2 * logits.numel() * logits.element_size() / bandwidth * 1e3
want_loss, want_grad = train.head_chunk_grad(logits, labels, w)
compiled = torch.compile(train.head_chunk_grad, dynamic=True)
candidates = {"plain torch, eager": lambda: train.head_chunk_grad(logits, labels, w),
              "plain torch, inductor (dynamic)": lambda: compiled(logits, labels, w)}
for block in (1024, 2048, 4096, 8192):
    for warps in (4, 8, 16):
        candidates[f"Triton kernel, tile {block}, {warps} warps"] = (
            lambda b=block, n=warps: train.triton_head_chunk_grad(logits, labels, w, block=b, warps=n))
result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "vocab": V,
          "copy_bandwidth_TBps": bandwidth / 1e12, "floor_ms": floor_ms, "runs": {}}
print(f"{rows} x {V} bf16 logits; copy {bandwidth / 1e12:.2f} TB/s; floor (read once, write once) {floor_ms:.3f} ms")
for name, fn in candidates.items():
    loss, grad = fn()
    ms = timed(fn)
    result["runs"][name] = {"ms": ms, "x_floor": ms / floor_ms,
                            "loss_diff": abs(loss.item() - want_loss.item()),
                            "grad_max_diff": (grad.float() - want_grad.float()).abs().max().item()}
    r = result["runs"][name]
    print(f"{name:40s} {ms:7.3f} ms  {r['x_floor']:5.2f}x floor  loss diff {r['loss_diff']:.2e}  grad diff {r['grad_max_diff']:.2e}", flush=True)
if len(sys.argv) > 1:
    json.dump(result, open(sys.argv[1], "w"), indent=1)
