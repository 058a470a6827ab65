# One-off: the head-loss chunk's parts with and without DFlash2's top 16 (CUDA events, median of 20).
import json, os, statistics, sys, torch, torch.nn.functional as F
sys.path[:0] = [os.getcwd()]
from dflash_reference.training import objective
def timed(f, n=20):
    for _ in range(3): f()
    torch.cuda.synchronize(); out = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); f(); e.record(); e.synchronize(); out.append(s.elapsed_time(e))
    return statistics.median(out)
r = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": 8192, "dtype": "bfloat16"}
for V, H in [(49152, 576), (151936, 4096)]:
    W = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.05
    rows = torch.randn(8192, H, device="cuda", dtype=torch.bfloat16)
    logits = F.linear(rows, W)
    labels = torch.randint(0, V, (8192,), device="cuda"); w = torch.rand(8192, device="cuda")
    r[f"V{V}"] = {"linear_ms": timed(lambda: F.linear(rows, W)),
                  "kernel_ms": timed(lambda: objective.triton_head_chunk_grad(logits, labels, w)),
                  "kernel_top16_ms": timed(lambda: objective.triton_head_chunk_grad(logits, labels, w, 16)),
                  "torch_topk16_ms": timed(lambda: logits.topk(16, dim=-1).indices)}
    print(V, r[f"V{V}"], flush=True)
json.dump(r, open(os.environ["OUT"] + "/parts.json", "w"), indent=1)
