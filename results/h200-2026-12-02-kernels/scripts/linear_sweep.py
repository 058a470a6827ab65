"""Sweep fastpath._linear's block configs against cuBLAS and the compiled plain-torch twin, bf16, at
the matmuls of a Qwen3-8B and a SmolLM2-135M layer, 1 and 16 rows. Each case is captured as one CUDA
graph of `copies` calls on distinct weights (so that L2 does not hold them, as in a real step);
median of 20 replays, per call. Writes linear-sweep.json."""
import itertools, json, statistics, sys, time
import torch
import triton
import dflash, fastpath

CASES = {"smollm2-135m": [("qkv", 960, 576, "norm"), ("o", 576, 576, "res"), ("gate_up", 3072, 576, "norm"),
                          ("down", 576, 1536, "gated"), ("lm_head", 49152, 576, "norm")],
         "qwen3-8b": [("qkv", 6144, 4096, "norm"), ("o", 4096, 4096, "res"), ("gate_up", 24576, 4096, "norm"),
                      ("down", 4096, 12288, "gated")]}
CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s) for n, k, (w, s) in
           itertools.product((16, 32, 64), (128, 256, 512, 1024, 2048), ((4, 2), (4, 3), (8, 3)))]


def graph_us(fn, copies, iters=20):
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    times = []
    for i in range(iters + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) * 1e3 / copies)
    return statistics.median(times)


OUT = sys.argv[1] if len(sys.argv) > 1 else "linear-sweep.json"


def save(results, attention):
    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=results, attention=attention),
              open(OUT, "w"), indent=1)


def main():
    dtype, results, default_config = torch.bfloat16, [], fastpath.linear_config
    attention = []
    for shape, (h, hk, d) in {"smollm2-135m": (9, 3, 64), "qwen3-8b": (32, 8, 128)}.items():
        copies = 30
        keys = [torch.randn(1, hk, 1024, d, device="cuda", dtype=dtype) for _ in range(copies)]
        values = [torch.randn(1, hk, 1024, d, device="cuda", dtype=dtype) for _ in range(copies)]
        for N in (1, 16):
            q = torch.randn(1, N, h, d, device="cuda", dtype=dtype)
            last = (640 + torch.arange(N, device="cuda"))[None]                          # (1, N)
            mask = torch.arange(1024, device="cuda") <= last[..., None]
            twin = torch.compile(lambda q, k, v: fastpath.attend(q, k, v, mask, d ** -0.5), fullgraph=True)
            row = dict(shape=shape, N=N, S=1024, last=640,
                       compiled_twin_us=graph_us(lambda i: twin(q, keys[i], values[i]), copies))
            for programs in (128, 256, 512, 1024):
                fastpath.PROGRAMS = programs
                row[f"triton_{programs}_us"] = graph_us(
                    lambda i: fastpath.triton_attend_upto(q, keys[i], values[i], last, d ** -0.5), copies)
            fastpath.PROGRAMS = 512
            attention.append(row)
            print(row, flush=True)
    for shape, cases in CASES.items():
        for name, N, K, mode in cases:
            copies = max(2, min(30, int(400e6 // (N * K * 2))))
            weights = [torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5 for _ in range(copies)]
            norm = dflash.RMSNorm(K, 1e-6).to("cuda", dtype)
            for M in (1, 16):
                x = torch.randn(M, 2 * K if mode == "gated" else K, device="cuda", dtype=dtype)
                res = torch.randn(M, N, device="cuda", dtype=dtype) if mode != "norm" else None
                kw = dict(norm=norm if mode == "norm" else None, gated=mode == "gated", residual=res)
                saved = fastpath.LINEAR_ROWS
                fastpath.LINEAR_ROWS = 0
                compiled_twin = torch.compile(lambda xx, w: fastpath.linear(xx, w, **kw), fullgraph=True)
                row = dict(shape=shape, matmul=name, N=N, K=K, prologue=mode, M=M, copies=copies,
                           weight_MB=N * K * 2 / 1e6)
                row["cublas_mm_us"] = graph_us(lambda i: x[:, :K] @ weights[i].T, copies)
                row["compiled_twin_us"] = graph_us(lambda i: compiled_twin(x, weights[i]), copies)
                want = fastpath.linear(x.double(), weights[0].double(), norm=None if mode != "norm" else
                                       dflash.RMSNorm(K, 1e-6).double().cuda(), gated=mode == "gated",
                                       residual=None if res is None else res.double())
                row["twin_err"] = (compiled_twin(x, weights[0]).double() - want).abs().max().item()
                fastpath.LINEAR_ROWS = saved
                configs = {}
                for cfg in CONFIGS:
                    if cfg["BLOCK_K"] > triton.next_power_of_2(K) or cfg["BLOCK_N"] * cfg["BLOCK_K"] > 32768:
                        continue
                    fastpath.linear_config = lambda n, k, cfg=cfg: cfg
                    try:
                        us = graph_us(lambda i: fastpath.triton_linear(x, weights[i], None if mode != "norm" else norm.weight,
                                                                      1e-6, mode == "gated", res), copies)
                        err = (fastpath.triton_linear(x, weights[0], None if mode != "norm" else norm.weight, 1e-6,
                                                      mode == "gated", res).double() - want).abs().max().item()
                        configs[json.dumps(cfg)] = dict(us=us, err=err)
                    except Exception as e:
                        configs[json.dumps(cfg)] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
                fastpath.linear_config = default_config
                row["default"] = json.dumps(default_config(N, K))
                row["triton"] = configs
                ok = {k: v for k, v in configs.items() if "us" in v}
                best = min(ok, key=lambda k: ok[k]["us"])
                row["best"], row["best_us"] = best, ok[best]["us"]
                row["best_TBps"] = N * K * 2 / (ok[best]["us"] * 1e-6) / 1e12
                row["cublas_TBps"] = N * K * 2 / (row["cublas_mm_us"] * 1e-6) / 1e12
                results.append(row)
                save(results, attention)
                print(f"{shape:13} {name:8} M={M:2}  cuBLAS {row['cublas_mm_us']:7.2f} us  twin {row['compiled_twin_us']:7.2f}"
                      f"  triton best {row['best_us']:7.2f} ({best}, err {ok[best]['err']:.2e})"
                      f"  {row['best_TBps']:.2f} vs {row['cublas_TBps']:.2f} TB/s", flush=True)
            del weights
    save(results, attention)


if __name__ == "__main__":
    main()
