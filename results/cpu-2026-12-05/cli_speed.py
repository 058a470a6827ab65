"""The README's CPU figures for the default command: `python dflash.py` and `python dflash.py --target-only`,
each run RUNS times as its own process, alternating, on this machine's CPU in float32 with the threads
torch picks. Each run's tokens/s and τ are read from the lines the CLI prints (its own clock: the decode
after the weights load). The floor is the bytes a token must read (the target's fp32 weights, the tied
LM head once; a DFlash round also reads the drafter's, shared by τ tokens) over this machine's memory
copy bandwidth, measured here (read + write of a 1 GiB fp32 tensor, median of 10).

    $ python results/cpu-2026-12-05/cli_speed.py OUT.json [RUNS]
"""
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import torch
from safetensors import safe_open

sys.path.insert(0, os.getcwd())
import offline

DRAFTER = "drafter/SmolLM2-135M-Instruct-DFlash-b16"


def copy_bandwidth(nbytes=1 << 30) -> float:
    """Memory copy bandwidth in bytes/s (bytes read + bytes written), median of 10 after 2."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        t0 = time.perf_counter()
        dst.copy_(src)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def fp32_bytes(path) -> int:
    """The fp32 bytes of a safetensors file's tensors (whatever dtype it stores them in)."""
    with safe_open(path, "pt") as f:
        return sum(4 * math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def run(flags) -> dict:
    """One `python dflash.py` process -> its printed tokens, τ and tokens/s."""
    done = subprocess.run([sys.executable, "dflash.py", *flags], capture_output=True, text=True, check=True)
    stats = dict(re.findall(r"^\s*(tokens|rounds|tau|tokens/s)\s+(\S+)$", done.stdout, re.M))
    return {"tokens": int(stats["tokens"]), "tau": float(stats["tau"]) if "tau" in stats else None,
            "tokens_per_s": float(stats["tokens/s"])}


def main(out_path, runs=3):
    target_dir = offline.ensure_smollm2()
    target_bytes = fp32_bytes(target_dir / "model.safetensors")
    drafter_bytes = fp32_bytes(f"{DRAFTER}/model.safetensors")
    bandwidth = copy_bandwidth()
    rows = {"dflash": [], "target-only": []}
    for _ in range(runs):   # alternating, so that a slower spell of the machine falls on both
        rows["dflash"].append(run([]))
        rows["target-only"].append(run(["--target-only"]))
    tau = statistics.median(r["tau"] for r in rows["dflash"])
    floors = {"dflash": (target_bytes + drafter_bytes) / tau / bandwidth, "target-only": target_bytes / bandwidth}
    result = {"setting": __doc__.split("\n\n")[0], "command": "python dflash.py [--target-only]",
              "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "dtype": "float32", "copy_bandwidth_gb_s": bandwidth / 1e9,
              "target_fp32_bytes": target_bytes, "drafter_fp32_bytes": drafter_bytes, "runs": rows,
              "median_tokens_per_s": {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in rows.items()},
              "floor_ms_per_token": {k: v * 1e3 for k, v in floors.items()}}
    json.dump(result, open(out_path, "w"), indent=1)
    print(f"{result['setting']}\n{result['cpu']}, {result['threads']} threads, torch {result['torch']}, float32; "
          f"copy {bandwidth / 1e9:.1f} GB/s")
    print(f"{'command':14} {'runs tokens/s':28} {'median':>7} {'ms/token':>9} {'floor ms':>9} {'× floor':>8}  τ")
    for name, runs_ in rows.items():
        speed = result["median_tokens_per_s"][name]
        floor_ms = result["floor_ms_per_token"][name]
        speeds = ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs_)
        print(f"{name:14} {speeds:28} {speed:7.1f} {1e3 / speed:9.1f} "
              f"{floor_ms:9.2f} {1e3 / speed / floor_ms:8.1f}  "
              + (', '.join(f"{r['tau']:.2f}" for r in runs_) if name == "dflash" else "-"))
    print(f"DFlash over target-only, medians: {result['median_tokens_per_s']['dflash'] / result['median_tokens_per_s']['target-only']:.2f}×"
          f" -> {out_path}")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
