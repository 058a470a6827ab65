"""The packed forward's attention alone (one layer, bf16, forward and forward + backward) at phase 13's
training shapes (phase 16's cpu_counts.phase13_anchors, as its flex_probe.py: 32 sequences of 200-768 positions,
<= 128 sorted anchors of blocks of 16, seed 0; SmolLM2's drafter heads 9 / 3, head dim 64), q strided as the layer makes it:

  one call     flex attention over [context | own rows] with the whole rule's BlockMask (1ab4896)
  two parts    dflash.attend_packed: flex attention over the context, dense products within each block

each compiled with static shapes and with dynamic=True, as train --compile compiles the drafter. In the
training step (phase 16, call 4) one call's flex kernels took 2.65 ms forward and 3.9 ms backward a
layer against 1.11 and 2.14 in flex_probe.py (static): the dynamic rows here say whether dynamic
shapes are that difference. CUDA events, median of 20 after 5; outputs compared with one call, static.

    $ python attention_probe.py OUT_JSON
"""
import json, os, sys
sys.path.insert(0, os.getcwd())
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
import bench, dflash, train
from cpu_tiles import phase13_anchors   # this folder's, from phase 16's cpu_counts.py

device, dtype = "cuda", torch.bfloat16
Bt, B, h, hk, d, per_seq = 32, 16, 9, 3, 64, 128
block_anchors, N = phase13_anchors(torch.Generator().manual_seed(0))                  # (Bt, P), the context's length
R, g = per_seq * B, torch.Generator().manual_seed(0)
block_anchors = block_anchors.to(device)
q = torch.randn(Bt, R, h, d, generator=g).to(device, dtype).transpose(1, 2)              # (Bt, h, R, d) strided
k, v = (torch.randn(Bt, hk, N + R, d, generator=g).to(device, dtype) for _ in range(2))  # (Bt, hk, N+R, d)
grad_out = torch.randn(Bt, h, R, d, generator=g).to(device, dtype)
rule = train.packed_rule(block_anchors, B, torch.tensor(N, device=device), False, None)
masks = {"one call": create_block_mask(rule, Bt, None, R, N + R, device=device),
         "two parts": train.packed_mask(block_anchors, B, N, False, None, True)}
functions = {"one call": lambda q, k, v, mask: flex_attention(q, k, v, block_mask=mask, enable_gqa=True),
             "two parts": dflash.attend_packed}
result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "Bt": Bt, "N": N, "R": R,
          "heads": [h, hk, d], "variants": {}}
print(f"{Bt} sequences, N {N}, {R} query rows each; heads {h}/{hk}, d {d}; bf16; one layer")
want = None
for name in ("one call", "two parts"):
    for dynamic in (False, True):
        label = f"{name}, {'dynamic' if dynamic else 'static'}"
        torch._dynamo.reset()
        fn = torch.compile(functions[name], dynamic=dynamic, options={"fx_graph_cache": False})
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        call = lambda: fn(*leaves, masks[name])
        try:
            out = call()
            out.backward(grad_out)
            fwd = bench.graph_time(lambda: call().detach(), iters=20)
            both = bench.graph_time(lambda: call().backward(grad_out), iters=20)
        except Exception as error:   # a variant that fails is reported, not fatal
            result["variants"][label] = {"error": repr(error)[:600]}
            print(f"{label:20s} failed: {repr(error)[:300]}", flush=True)
            continue
        want = out.detach().float() if want is None else want
        diff = (out.float() - want).abs().max().item()
        result["variants"][label] = {"fwd_ms": fwd, "fwd_bwd_ms": both, "max_diff_from_one_call_static": diff}
        print(f"{label:20s} forward {fwd:6.3f} ms  forward+backward {both:6.3f} ms  max diff {diff:.3g}", flush=True)
if len(sys.argv) > 1:
    json.dump(result, open(sys.argv[1], "w"), indent=1)
