"""dflash.generate on CPU (float32, 2 threads, K = 7) with the drafts read from all W-1 block rows through
the target's LM head (as before) against only the k drafts to verify (dflash.propose now): the CLI's default
prompt and the first 3 MT-Bench prompts, 96 new tokens each, 3 interleaved runs, tokens/s of the four
together and each prompt's τ.

    $ cd results/cpu-2026-12-01 && python ../cpu-2026-12-02/ab_propose.py > ../cpu-2026-12-02/ab-propose.json
"""
import json, statistics, sys, time
sys.path.insert(0, ".")
import default_pair
import dflash, offline, train

target, drafter, tok, ids = default_pair.load()
stops = offline.stop_token_ids(target, tok)
k_rows = dflash.propose


def all_rows(drafter_, ctx, block, target_, count):   # the head over rows 1..W-1, then the first `count`
    hidden = dflash.draft_block(drafter_, ctx, target_.get_input_embeddings()(block))
    return target_.get_output_embeddings()(hidden[1:]).argmax(-1)[:count]


prompts = [ids] + [train.encode_chat(tok, p) for p in offline.read_mtbench()[:3]]
runs, taus = {"all rows": [], "k rows": []}, {}
for rep in range(3):
    for name, fn in [("all rows", all_rows), ("k rows", k_rows)]:
        dflash.propose = fn
        t, n, tau = time.perf_counter(), 0, []
        for p in prompts:
            g = dflash.generate(target, drafter, p, 96, num_drafts=7, stop_ids=stops)
            n, tau = n + len(g.tokens), tau + [g.tau]
        runs[name].append(n / (time.perf_counter() - t))
        taus[name] = tau
        print(name, rep, round(runs[name][-1], 2), [round(x, 2) for x in tau], file=sys.stderr, flush=True)
dflash.propose = k_rows
print(json.dumps({"setting": "CPU float32, 2 threads, K = 7, default prompt + MT-Bench 1-3, 96 new tokens, 3 interleaved runs",
                  "runs": {n: {"tok_s_median": statistics.median(r), "tok_s": r, "tau": taus[n]} for n, r in runs.items()}},
                 indent=1))
