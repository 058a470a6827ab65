"""CPU costs of the parts of a DFlash round on the default pair (README, "How well it drafts"). Run from the repository root: python results/cpu-2026-12-01/step_costs.py OUT.json"""
import json, sys, time, torch, dflash
from transformers import DynamicCache
from contextlib import closing
import default_pair
target, drafter, tok, ids = default_pair.load()
results = {}
def med(f, n=15):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3
with torch.inference_mode(), closing(dflash.Capture(target, drafter.config.target_layer_ids)) as cap:
    cache = DynamicCache()
    prompt = torch.tensor(ids)
    logits, feats = dflash.target_forward(target, prompt, 0, cache, cap)
    P = len(ids)
    for rows in (1, 4, 8, 16):
        x = torch.tensor([100] * rows)
        def step():
            dflash.target_forward(target, x, P, cache, cap); cache.crop(-rows)
        results[f"target forward, {rows} rows"] = med(step)
    ctx = dflash.DraftContext.empty(drafter, "cpu")
    dflash.append_context(drafter, ctx, drafter.project_context(feats))
    emb = target.get_input_embeddings()
    for W in (16, 4):
        block = torch.tensor([100] + [16] * (W - 1))
        results[f"draft_block, W = {W}"] = med(lambda: dflash.draft_block(drafter, ctx, emb(block)))
    hidden = dflash.draft_block(drafter, ctx, emb(torch.tensor([100] + [16] * 15)))
    head = target.get_output_embeddings()
    for r in (15, 3):
        results[f"LM head over {r} draft rows"] = med(lambda: head(hidden[1:r+1]).argmax(-1))
for k, v in results.items():
    print(f"{k:32s} {v:7.1f} ms")
json.dump({"conditions": "the default pair (SmolLM2-135M-Instruct + shipped drafter), float32, CPU, 2 threads, "
           "dflash.py's functions after a prefill of the CLI's default prompt, median of 15 calls, ms",
           "ms": results}, open(sys.argv[1], "w"), indent=1)
