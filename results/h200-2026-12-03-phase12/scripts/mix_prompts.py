"""Here, before the calls: one prompt file for phase 12b's single distill run. The first 16,000 of phase
11's self-written turns, then the 4,790 code stubs (indices + 1,000,000, so that no index is shared), then
phase 11's last 65 turns, whose last 64 are 11a's held-out set: `train --heldout 64` holds out the greedy
answers to a file's last prompts, so the held-out line continues 11a's.

    python results/h200-2026-12-03-phase12/scripts/mix_prompts.py SELF11 CODE OUT
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import train  # noqa: E402

self11, code, out = map(Path, sys.argv[1:4])
own, own_indices, own_meta = train.read_prompt_file(self11)
stubs, stub_indices, stub_meta = train.read_prompt_file(code)
assert len(own) == 50000 and len(stubs) >= 4790
prompts = own[:16000] + stubs[:4790] + own[49935:]
indices = own_indices[:16000] + [1_000_000 + i for i in stub_indices[:4790]] + own_indices[49935:]
assert len(set(indices)) == len(indices) and len(prompts) == 20855
meta = {"source": f"{own_meta.get('source')}: the first 16,000 and the last 65; then {stub_meta.get('source')} "
                  f"(indices + 1,000,000)", "max_prompt_tokens": max(own_meta["max_prompt_tokens"], stub_meta["max_prompt_tokens"])}
train.write_prompt_file(out, prompts, indices, meta)
print(f"{len(prompts)} prompts -> {out}; held out: indices {indices[-64]}..{indices[-1]}")
