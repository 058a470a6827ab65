import time, dflash, offline, json, sys
import default_pair
target, drafter, tok, ids = default_pair.load()
stops = offline.stop_token_ids(target, tok)
variants = {"target-only": dict(d=None), "K=15": dict(K=15), "K=8": dict(K=8), "K=7": dict(K=7), "K=6": dict(K=6),
            "K=3": dict(K=3)}
runs = {k: [] for k in variants}; taus = {}
for rep in range(int(sys.argv[1])):
    for name, v in variants.items():
        t = time.perf_counter()
        g = dflash.generate(target, None if "d" in v else drafter, ids, 128, num_drafts=v.get("K"),
                            full_block=v.get("full", True), stop_ids=stops)
        runs[name].append(len(g.tokens) / (time.perf_counter() - t)); taus[name] = g.tau
json.dump({n: {"tok_s_median": sorted(runs[n])[len(runs[n])//2], "tau": taus[n], "runs": runs[n]} for n in variants}, open("/tmp/cpuk.json", "w"), indent=1)
for name in variants:
    r = sorted(runs[name]); print(f"{name:18s} tau {taus[name]:.2f}  tok/s median {r[len(r)//2]:.1f}  runs {[round(x,1) for x in runs[name]]}")
