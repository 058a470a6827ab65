"""bench_train.main() on the code of the current directory, plus what it does not report:
the wall time of every BatchDecoder.generate call (the first one compiles, where the code compiles,
and captures every bucket's graph), dynamo+inductor compile seconds, and one bucket graph's replay
timed alone (CUDA events, median of 20) and profiled once (kernel count and kernel time).
Everything is added to the --out JSON under "extra".

    $ cd CODE && python3 -c "exec(open('PATH/timed_bench.py').read())" --skip train,hf --distill-batch 2048 --out X.json
"""
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
import bench_train  # noqa: E402
import train  # noqa: E402

calls, decoders = [], []
_generate = train.BatchDecoder.generate


def timed_generate(self, prompts, max_new_tokens, *args, **kwargs):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = _generate(self, prompts, max_new_tokens, *args, **kwargs)
    torch.cuda.synchronize()
    calls.append({"max_new": max_new_tokens, "seconds": time.perf_counter() - t0, "graphs": len(self.graphs),
                  "compiled": getattr(self, "compiled", False)})
    print("generate", calls[-1], flush=True)
    decoders[:] = [self]
    return out


def compile_seconds():
    try:
        names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
        return float(dict(zip(names, values)).get("_compile.compile_inner", 0.0))
    except Exception as err:
        return repr(err)[:200]


def replay_stats(dec, S: int) -> dict:
    graph = dec.graphs[(S, 0.0)]
    dec.slot.fill_(S - 1)   # a valid slot inside the span: the replays rewrite its K/V, harmless here
    times = []
    for _ in range(23):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    row = {"S": S, "replay_ms_median": statistics.median(times[3:])}
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        row["kernels"] = len(kernels)
        row["kernel_ms"] = sum(e.device_time for e in kernels) / 1e3
    except Exception as err:   # the profile is a bonus: never lose the timings for it
        row["profile_error"] = repr(err)[:200]
    return row


train.BatchDecoder.generate = timed_generate
out = sys.argv[sys.argv.index("--out") + 1]
sys.argv[0] = "bench_train.py"
try:
    with torch._dynamo.config.patch(recompile_limit=1024):   # no-op for code that does not compile
        bench_train.main()
finally:
    extra = {"calls": calls, "compile_s": compile_seconds(), "replays": []}
    if decoders:
        with torch.inference_mode():
            for S in (384, 512, 768):
                if (S, 0.0) in decoders[0].graphs:
                    try:
                        extra["replays"].append(replay_stats(decoders[0], S))
                    except Exception as err:
                        extra["replays"].append({"S": S, "error": repr(err)[:200]})
                    print("replay", extra["replays"][-1], flush=True)
    try:
        with open(out) as f:
            result = json.load(f)
    except FileNotFoundError:
        result = {}
    result["extra"] = extra
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("extra", json.dumps(extra), flush=True)
