"""The distilled data at a glance, and 64 of its greedy answers against HF generate's greedy answers to
the same prompts (bf16, batch 64): how many are identical, and where the others first differ."""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd()))   # run from the repository root

import offline
import train

target_dir, data, prompt_file = sys.argv[1:4]
sequences, meta = train.load_sequences(data)
answers = [len(s.ids) - s.prompt_len for s in sequences]
target, tokenizer = train.load_target_and_tokenizer(target_dir, torch.bfloat16, torch.device("cuda"))
stops = offline.stop_token_ids(target, tokenizer)
stopped = sum(int(s.ids[-1]) in stops for s in sequences)
print(f"{len(sequences)} answers, {sum(answers)} response tokens, mean {statistics.mean(answers):.0f}, "
      f"median {statistics.median(answers):.0f}; {stopped} end with a stop token, {sum(a == 512 for a in answers)} at 512")
prompts, _, _ = train.read_prompt_file(prompt_file)
picked = list(range(0, len(sequences), len(sequences) // 64))[:64]
hf = train.distill_ids(target, [sequences[i].ids[:sequences[i].prompt_len].tolist() for i in picked], 512,
                       tokenizer.pad_token_id or 0, stops)
same, first = 0, []
for i, h in zip(picked, hf):
    a, b = sequences[i].ids[sequences[i].prompt_len:].tolist(), h.ids[h.prompt_len:].tolist()
    if a == b:
        same += 1
    else:
        first.append(next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
print(f"HF greedy (bf16, batch 64) against BatchDecoder on 64 answers: {same} identical; the others first differ "
      f"at tokens {sorted(first)}")
