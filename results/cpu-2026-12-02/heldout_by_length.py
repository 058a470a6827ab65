"""Does the held-out estimate over-predict the evaluation sets because of answer length? The held-out
answers run to 512 new tokens, the evaluation's to 256. For the first 24 MT-Bench prompts and the 24
self-written turns that phase 9a held out last, this answers each greedily (≤ 512 new tokens, CPU,
float32) and walks the shipped drafter's rounds (train.estimate_acceptance, as the held-out estimate
does) over the whole answer and over its first 256 tokens.

    $ python results/cpu-2026-12-02/heldout_by_length.py   # -> results/cpu-2026-12-02/heldout-by-length.json
"""
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
import torch  # noqa: E402

import dflash, offline, train  # noqa: E402

torch.set_num_threads(2)
target_dir = offline.ensure_smollm2()
target, tokenizer = train.load_target_and_tokenizer(str(target_dir), torch.float32, "cpu")
drafter = dflash.load_drafter(str(offline.DEFAULT_DRAFT), target, torch.float32, "cpu")
self_prompts, _, _ = train.read_prompt_file(HERE.parent / "h200-2026-12-02-phase9" / "logs" / "self-prompts.json.xz")
sets = {"mtbench": offline.read_mtbench()[:24], "self (phase 9a's held-out turns)": self_prompts[-64:][-24:]}
decoder = train.BatchDecoder(target, 24, 256 + 512)
report = {"drafter": str(offline.DEFAULT_DRAFT), "device": "cpu, float32", "max_new_tokens": 512, "sets": {}}
for name, prompts in sets.items():
    t0 = time.perf_counter()
    sequences = train.distill(target, tokenizer, prompts, 512, 24, decoder=decoder)
    row = {"prompts": len(prompts), "mean_response_tokens": sum(len(s.ids) - s.prompt_len for s in sequences) / len(sequences)}
    for cap in (512, 256):
        tau, acceptance = train.estimate_acceptance(target, drafter, train.first_response_tokens(sequences, cap))
        row[f"tau_first_{cap}"] = tau
        row[f"acceptance_first_{cap}"] = acceptance[:5]
    row["seconds"] = time.perf_counter() - t0
    report["sets"][name] = row
    print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if "acceptance" not in k}, flush=True)
(HERE / "heldout-by-length.json").write_text(json.dumps(report, indent=1))
