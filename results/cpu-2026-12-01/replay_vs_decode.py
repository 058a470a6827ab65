"""Is the held-out τ estimate (the replay of train.estimate_acceptance) equal to decoding's τ on the
same text? CPU, float32, the shipped drafter, the first N prompts of MT-Bench and HumanEval.

    $ python results/cpu-2026-12-01/replay_vs_decode.py TARGET_DIR 3 OUT.json
"""
import json, sys
from pathlib import Path
import torch
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import dflash, train, offline  # noqa: E402
T = sys.argv[1]
target, tok = train.load_target_and_tokenizer(T, torch.float32, "cpu")
drafter = dflash.load_drafter(str(ROOT / "drafter" / "SmolLM2-135M-Instruct-DFlash-b16"), target, torch.float32, "cpu")
stops = offline.stop_token_ids(target, tok)
out = []
for name in ["mtbench", "humaneval"]:
    texts = offline.EVAL_DATASETS[name]()[:int(sys.argv[2])]
    for text in texts:
        ids = train.encode_chat(tok, text)
        g = dflash.generate(target, drafter, ids, 200, num_drafts=15, stop_ids=stops)
        toks = g.tokens
        seq = train.Sequence(torch.tensor(ids + toks), len(ids))
        tau_est, acc = train.estimate_acceptance(target, drafter, [seq], batch_size=1)
        rounds = train.heldout_rounds(target, drafter, [seq], batch_size=1)[0]
        out.append({"set": name, "tau_decode": g.tau, "tau_replay": tau_est, "n": len(toks),
                    "rounds_replay": len(rounds)})
        print(out[-1], flush=True)
json.dump(out, open(sys.argv[3], "w"), indent=1)
