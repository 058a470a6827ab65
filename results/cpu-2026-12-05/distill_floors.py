"""The distillation floors of the stored bench_train runs, recomputed with bench_train.distill_floor_s:
each row's own K/V (its prompt plus half the new tokens on average) and the weights less the embedding.
The runs computed theirs from the longest prompt, 256, for every row, and read the embedding whole.
The prompts are rebuilt from bench_train's seed (lengths 16-256 from a generator seeded 0, drawn first in
every version of it); the old formula, rerun here, gives each stored floor to the digit, which checks the
bandwidth, matmul rate and shapes read back (it depends on the longest prompt only, not on their mean).

    $ python results/cpu-2026-12-05/distill_floors.py results/cpu-2026-12-05/distill-floors.json RUN.json ...
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import bench
import bench_train
from transformers import LlamaConfig, LlamaForCausalLM

shape = bench.SHAPES["smollm2-135m"]
keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size"]
cfg = LlamaConfig(**{k: shape[k] for k in keys}, max_position_embeddings=4096, tie_word_embeddings=False,
                  rope_theta=1e6)
with torch.device("meta"):   # shapes only: the floors count bytes and FLOPs
    target = LlamaForCausalLM(cfg).to(torch.bfloat16)
kv_per_slot = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2

rows = []
for path in sys.argv[2:]:
    run = json.load(open(path))
    bandwidth, flops = run["copy_bandwidth_gb_s"] * 1e9, run["matmul_tflops"] * 1e12
    for row in run["distill"]:
        if "floor_s" not in row:
            continue
        Bt, new = row["batch"], row["new_tokens"]
        lengths = torch.randint(16, 257, (Bt,), generator=torch.Generator().manual_seed(0)).tolist()
        old_s = new * max((bench.param_bytes(target) + Bt * (max(lengths) + new / 2) * kv_per_slot) / bandwidth,
                          2 * Bt * sum(p.numel() for p in target.parameters()) / flops)
        floor_s = bench_train.distill_floor_s(target, [[0] * n for n in lengths], new, bandwidth, flops)
        rows.append({"run": path, "impl": row["impl"], "batch": Bt, "new_tokens": new,
                     "tokens_per_s": row["tokens_per_s"], "stored_floor_tokens_per_s": row["floor_tokens_per_s"],
                     "old_formula_rerun": Bt * new / old_s, "floor_tokens_per_s": Bt * new / floor_s,
                     "mean_prompt": sum(lengths) / Bt})
        r = rows[-1]
        print(f"{path:62} {Bt:5} {new:4} {r['tokens_per_s']:9.0f} tok/s; floor {r['stored_floor_tokens_per_s']:9.0f} "
              f"stored ({r['old_formula_rerun']:9.0f} rerun) -> {r['floor_tokens_per_s']:9.0f}")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
