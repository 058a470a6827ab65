"""The packed forward three ways on CPU, float32, at the shipped pair's real shapes (SmolLM2-135M-Instruct,
the shipped drafter, block 16, head dim 64): (1) today's dense path (one query run per sequence, SDPA
over the rule's dense mask), (2) today's flex path forced on CPU (the BlockMask of 128 × 128 tiles,
flex attention unfused), (3) the groups of 8253ddf's train.py (given as a file). Over every full-block
anchor of the target's greedy answers to the first COUNT MT-Bench prompts: the largest difference in
the drafter's hidden states, and the held-out rounds (τ) each way.

    $ git show 8253ddf:train.py > /tmp/old_train.py
    $ python results/h200-2026-12-04-phase15/scripts/cpu_layout_probe.py /tmp/old_train.py [OUT_JSON] [--count 4]
"""
import argparse, importlib.util, json, os, sys
sys.path.insert(0, os.getcwd())
import torch
import dflash, offline, train
from torch.nn.attention.flex_attention import flex_attention

p = argparse.ArgumentParser()
p.add_argument("old_train")
p.add_argument("out", nargs="?")
p.add_argument("--count", type=int, default=4)
p.add_argument("--new-tokens", type=int, default=160)
args = p.parse_args()
spec = importlib.util.spec_from_file_location("old_train", args.old_train)
old_train = sys.modules["old_train"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old_train)

torch.manual_seed(0)
target, tokenizer = train.load_target_and_tokenizer(str(offline.ensure_smollm2()), torch.float32, "cpu")
drafter = dflash.load_drafter(str(offline.DEFAULT_DRAFT), target, torch.float32, "cpu")
sequences = []
for prompt in offline.read_mtbench()[:args.count]:
    ids = train.encode_chat(tokenizer, prompt)
    out = target.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False)[0]
    sequences.append(train.Sequence(out, len(ids)))
B, mask_id = drafter.config.block_size, drafter.config.mask_token_id
anchors = [train.choose_anchors(s, len(s.ids), B, None, full_only=True) for s in sequences]
blocks = train.make_blocks(sequences, max(map(len, anchors)), B, mask_id, anchor_lists=anchors)
features, _, _ = train.capture_features(target, *train.pad_sequences(sequences), drafter.config.target_layer_ids,
                                        torch.float32, with_labels=False)
dense_mask = train.packed_mask


def forced_sparse(rule, Bt, rows, N, device, sparse):
    return dense_mask(rule, Bt, rows, N, device, True)


ways = {"dense (today's CPU path)": lambda: None, "flex BlockMask, unfused (today's CUDA path, forced)": None,
        "groups (8253ddf)": None}
hidden, taus = {}, {}
with torch.no_grad():
    for name in ways:
        module = old_train if name.startswith("groups") else train
        if name.startswith("flex"):
            train.packed_mask, dflash.compiled_flex_attention = forced_sparse, flex_attention
        hidden[name] = module.draft_hidden(target, drafter, blocks, features)          # (M, B, H)
        rounds = module.heldout_rounds(target, drafter, sequences)
        taus[name] = sum(len(r) + sum(r) for r in rounds) / sum(len(r) for r in rounds)
        train.packed_mask = dense_mask
names = list(ways)
result = {"sequences": len(sequences), "blocks": len(blocks.anchors), "N": int(features.shape[1]),
          "max_abs_hidden_difference_vs_dense": {n: (hidden[n] - hidden[names[0]]).abs().max().item() for n in names[1:]},
          "tau": taus}
print(json.dumps(result, indent=1))
if args.out:
    json.dump(result, open(args.out, "w"), indent=1)
