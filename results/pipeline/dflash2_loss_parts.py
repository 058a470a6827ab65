# One-off: the DFlash2 training loss's parts at the race's shapes (H100/H200), CUDA events, median of 20.
import json, os, statistics, torch, torch.nn.functional as F
import loss, dflash
from dflash import DraftConfig
def timed(f, n=20):
    for _ in range(3): f()
    torch.cuda.synchronize(); out = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); f(); e.record(); e.synchronize(); out.append(s.elapsed_time(e))
    return statistics.median(out)
V, H, c = 49152, 576, 8192
W = torch.randn(V, H, device="cuda", dtype=torch.bfloat16) * 0.05
rows = torch.randn(c, H, device="cuda", dtype=torch.bfloat16)
logits = F.linear(rows, W)
r = {"device": torch.cuda.get_device_name(), "chunk": [c, V]}
r["linear_ms"] = timed(lambda: F.linear(rows, W))
r["topk_ms"] = timed(lambda: logits.topk(16, dim=-1).indices)
for seg in (512, 1024, 2048):
    r[f"two_stage_{seg}_ms"] = timed(lambda: loss.top_k_ids(logits, 16, seg))
R = 8 * c   # about the labelled rows of a race step (32 sequences x 128 anchors x 15)
from types import SimpleNamespace
cfg = SimpleNamespace(hidden_size=H, vocab_size=V, selector_rank=64, selector_top_k=16)
sel = dflash.CandidateSelector(cfg).cuda() if cfg else None
if sel is not None:
    torch.nn.init.normal_(sel.predecessor_codebook); torch.nn.init.normal_(sel.successor_codebook, std=0.01)
    head = torch.nn.Linear(H, V, bias=False).cuda().to(torch.bfloat16); head.weight.data.copy_(W); head.requires_grad_(False)
    hidden = torch.randn(R, H, device="cuda", requires_grad=True)
    gold = torch.randint(0, V, (R,), device="cuda"); prev = torch.randint(0, V, (R,), device="cuda")
    cand = torch.randint(0, V, (R, 16), device="cuda"); w = torch.rand(R, device="cuda")
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            l = loss.selector_loss(sel, head, hidden, gold, prev, cand, w)
        l.backward()
    r["selector_loss_fwd_bwd_ms"] = timed(step, 10)
    r["selector_rows"] = R
print(json.dumps(r, indent=1)); json.dump(r, open(os.environ["OUT"] + "/topk.json", "w"), indent=1)
