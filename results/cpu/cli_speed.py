"""The README's CPU figures for the default command: `python dflash.py`, the same with the DFlash drafter it
grew from (commit b5b1968, `--draft`) and `python dflash.py --target-only`, each run RUNS times as its own
process, alternating, in float32 with the threads torch picks; tokens/s and τ
read from the lines the CLI prints (its own clock: the decode after the weights load). The floor is the bytes
a token must read (the target's fp32 weights, the tied LM head once; a DFlash round also reads the drafter's,
shared by τ tokens) over the memory copy bandwidth measured here (read + write of a 1 GiB fp32 tensor,
median of 10)."""
import json, platform, re, statistics, subprocess, sys, time
from pathlib import Path
import torch
RUNS = 5
def copy_bandwidth():
    x = torch.empty(2 ** 28); y = torch.empty_like(x); times = []
    for _ in range(10):
        t = time.perf_counter(); y.copy_(x); times.append(time.perf_counter() - t)
    return 2 * x.numel() * 4 / statistics.median(times)
def run(extra):
    out = subprocess.run([sys.executable, "dflash.py", *extra], capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    Path(f"/tmp/clispeed/out-{len(extra)}.txt").write_text(out.stderr + "\n---stdout---\n" + out.stdout)
    return {"tokens": int(re.search(r"tokens\s+(\d+)", text).group(1)), "tau": float(re.search(r"tau\s+([\d.]+)", text).group(1)),
            "tokens_per_s": float(re.search(r"tokens/s\s+([\d.]+)", text).group(1))}
V1 = ["--draft", "/tmp/v1drafter"]   # the DFlash drafter of commit b5b1968, for the side-by-side
runs = {"dflash": [], "dflash-v1": [], "target-only": []}
for _ in range(RUNS):
    runs["dflash"].append(run([])); runs["dflash-v1"].append(run(V1)); runs["target-only"].append(run(["--target-only"]))
    print(runs["dflash"][-1], runs["dflash-v1"][-1], runs["target-only"][-1], flush=True)
sys.path.insert(0, "."); import packages, checkpoint
bw = copy_bandwidth()
target = checkpoint.load_target(str(packages.ensure_smollm2()), torch.float32, "cpu")
drafter = checkpoint.load_drafter(str(packages.DEFAULT_DRAFT), target, torch.float32, "cpu")
tb = sum(p.numel() * 4 for p in target.parameters())   # tied head counted once by parameters()
db = sum(p.numel() * 4 for p in drafter.parameters())
med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
tau = statistics.median(r["tau"] for r in runs["dflash"])
report = {"setting": __doc__, "command": "python dflash.py [--target-only]", "drafter": str(packages.DEFAULT_DRAFT.name),
          "cpu": platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": "float32",
          "copy_bandwidth_gb_s": bw / 1e9, "target_fp32_bytes": tb, "drafter_fp32_bytes": db, "runs": runs,
          "median_tokens_per_s": med, "speedup": med["dflash"] / med["target-only"], "speedup_v1": med["dflash-v1"] / med["target-only"],
          "floor_ms_per_token": {"dflash": 1e3 * (tb + db) / tau / bw, "target-only": 1e3 * tb / bw}}
Path(sys.argv[1]).write_text(json.dumps(report, indent=1))
print(json.dumps({k: report[k] for k in ("median_tokens_per_s", "speedup", "floor_ms_per_token")}))
