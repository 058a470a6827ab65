"""A/B in one run: fastpath's target-only step (batch 1, SmolLM2-135M shapes, random weights, bf16,
prompt 512, 256 new) with attend_upto's Triton kernel against its plain-torch twin (the masked softmax
that fastpath compiled before the kernel). The twin is chosen by hiding Triton from fastpath.

    $ python results/h200-2026-12-01-continuous/ab_attention.py --out ab-attention.json
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench      # noqa: E402
import fastpath   # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    shape = bench.SHAPES["smollm2-135m"]
    target, _ = bench.build_pair(shape)
    prompt = torch.randint(0, shape["vocab_size"] - 1, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    bandwidth = bench.copy_bandwidth()
    floor_ms = (bench.param_bytes(target, skip=("embed_tokens",)) + bench.kv_bytes(target, 512 + 128)) / bandwidth * 1e3
    triton, rows, decoders = fastpath.triton, [], {}
    for name, module in (("attend_upto kernel", triton), ("plain-torch twin", None)):
        fastpath.triton = module   # read when the step is compiled and captured; the graph keeps it
        dec = decoders[name] = fastpath.Decoder(target, None, fastpath.capacity_for(512, 256, 0), 0)
        t0 = time.perf_counter()
        dec.generate(prompt, 8)
        torch.cuda.synchronize()
        print(f"{name}: compile + capture {time.perf_counter() - t0:.0f}s, graphs {bool(dec.graphs)}", flush=True)
    for rep in range(3):   # interleaved: kernel, twin, kernel, twin, ...
        for name, dec in decoders.items():
            fast = lambda target_, drafter_, ids, max_new, **kw: dec.generate(ids, max_new, **kw)
            times, _ = bench.round_times(fast, target, None, prompt, 256)
            ms = statistics.median(times[4:]) * 1e3
            rows.append(dict(variant=name, repeat=rep, ms_per_token=ms, floor_ms=floor_ms, graphed=bool(dec.graphs)))
            print(f"{name:20} repeat {rep}: {ms:.3f} ms/token (floor {floor_ms:.3f})", flush=True)
    fastpath.triton = triton
    for dec in decoders.values():
        dec.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bfloat16",
                           shape="smollm2-135m", batch=1, prompt_len=512, new_tokens=256,
                           copy_bandwidth_TBps=bandwidth / 1e12, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
