"""FlashInfer's kernels against fastpath's at batch 1, on the H200 (issue 15's kernel-library candidate):
attention for one query (an AR step) and for a verify's 16 rows over a layer's K/V, and the residual
add + RMSNorm, at both bench shapes (SmolLM2-135M: 30 layers, heads 9/3, d 64, H 576; Qwen3-8B: 36
layers, 32/8, d 128, H 4096), bf16, 640 committed slots (bench.py's prompt 512 + 128 new).

- fastpath: `attend_upto` over the layer's (1, hk, 1024, d) buffer, as `dense_layer` calls it; the
  add + norm compiled by inductor (dynamic=False), as fastpath's compiled layer fuses them.
- FlashInfer: `single_decode_with_kv_cache` (1 query) and `single_prefill_with_kv_cache(causal=True)`
  (16 rows, the last 16 of the 640 slots) over contiguous (hk, 640, d) K/V: its kernels read K/V with
  a head stride of kv_len · d, so they cannot read fastpath's 1,024-slot buffer in place; this is the
  kernel's own best case, before any integration cost. `fused_add_rmsnorm` (in place).

Each variant makes one call per layer on that layer's own tensors; the layers are captured as one CUDA
graph, replayed 50 times after 5 (CUDA events), and µs a call is the replay over the layer count.
Every output is checked against float64 plain torch (max |error|).

    $ python flashinfer_probe.py OUT_JSON      # wheels installed beforehand (pip --no-deps)
    $ SKIP="qwen3-8b attention rows=16 flashinfer" python flashinfer_probe.py OUT_JSON   # leaves that one out
"""
import json, os, statistics, subprocess, sys, time, traceback
sys.path.insert(0, os.getcwd())
import torch
import fastpath

SHAPES = {"smollm2-135m": dict(layers=30, h=9, hk=3, d=64, H=576), "qwen3-8b": dict(layers=36, h=32, hk=8, d=128, H=4096)}
C, L, EPS = 1024, 640, 1e-6


def graph_us(fn, calls: int, reps: int = 50) -> float:
    """fn (calls kernel calls' worth of work) captured as one CUDA graph -> median µs a call over reps replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # warm-up (and JIT / compile) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def attention_want(q, keys, values, rows: int):
    """float64 softmax attention of the last `rows` slots' queries q (rows, h, d) over keys/values
    (hk, L, d), each seeing the slots up to its own -> (rows, h, d)."""
    h, hk, d = q.shape[1], keys.shape[0], q.shape[2]
    k, v = (t.double().repeat_interleave(h // hk, 0) for t in (keys, values))         # (h, L, d)
    scores = torch.einsum("nhd,hsd->hns", q.double(), k) * d ** -0.5                    # (h, rows, L)
    seen = torch.arange(L, device=q.device) <= (L - rows + torch.arange(rows, device=q.device))[:, None]
    return torch.einsum("hns,hsd->nhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v)


def add_norm(x, residual, weight):
    """Llama's residual add and RMSNorm, as fastpath's compiled layer has them -> (normed, new residual)."""
    r = x + residual
    rf = r.float()
    return weight * (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + EPS)).to(r.dtype), r


def main(out_path):
    import flashinfer
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": flashinfer.__version__,
              "nvcc": subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:],
              "setting": __doc__.split("\n\n")[0], "rows": [], "errors": {}}
    save = lambda: json.dump(result, open(out_path, "w"), indent=1)
    compiled_add_norm = torch.compile(add_norm, dynamic=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape_name, s in SHAPES.items():
        layers, h, hk, d, H = s["layers"], s["h"], s["hk"], s["d"], s["H"]
        buffers = [[torch.randn(1, hk, C, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                   for _ in range(layers)]                                              # (1, hk, C, d) K, V a layer
        dense = [[t[0, :, :L].contiguous() for t in kv] for kv in buffers]             # (hk, L, d) K, V a layer
        for rows in (1, 16):
            q = [torch.randn(rows, h, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            last = torch.arange(L - rows, L, device="cuda")[None]                       # (1, rows) each row's last slot
            outs = {}

            def ours():
                outs["fastpath"] = [fastpath.attend_upto(q[l][None], *buffers[l], last, d ** -0.5).view(rows, h, d)
                                    for l in range(layers)]

            def theirs():
                if rows == 1:
                    outs["flashinfer"] = [flashinfer.single_decode_with_kv_cache(q[l][0], *dense[l], kv_layout="HND",
                                                                                 sm_scale=d ** -0.5)[None]
                                          for l in range(layers)]
                else:
                    outs["flashinfer"] = [flashinfer.single_prefill_with_kv_cache(q[l], *dense[l], causal=True,
                                                                                  kv_layout="HND", sm_scale=d ** -0.5)
                                          for l in range(layers)]

            for name, fn in (("fastpath", ours), ("flashinfer", theirs)):
                key = f"{shape_name} attention rows={rows} {name}"
                if key in os.environ.get("SKIP", ""):   # e.g. a variant that kills the process
                    continue
                try:
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    first_s = time.perf_counter() - t0
                    us = graph_us(fn, layers)
                    want = attention_want(q[0], *dense[0], rows)
                    error = (outs[name][0].double() - want).abs().max().item()
                    result["rows"].append({"shape": shape_name, "what": "attention", "rows": rows, "impl": name,
                                           "us_per_call": us, "max_error": error, "first_call_s": first_s})
                    print(f"{key:58} {us:8.2f} µs a call   max error {error:.2e}   first call {first_s:.1f} s", flush=True)
                except Exception as e:   # one variant's failure is a result too: keep it and go on
                    result["errors"][key] = traceback.format_exc(limit=3)
                    print(f"{key:58} failed: {type(e).__name__}: {e}", flush=True)
                save()
        for rows in (1, 16):
            x = [torch.randn(rows, H, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            residual = [torch.randn(rows, H, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
            weight = torch.randn(H, generator=g, device="cuda", dtype=torch.bfloat16)
            want_normed, want_residual = add_norm(x[0].double(), residual[0].double(), weight.double())
            key = f"{shape_name} add+norm rows={rows}"
            try:
                us = graph_us(lambda: [compiled_add_norm(x[l], residual[l], weight) for l in range(layers)], layers)
                normed, new_residual = compiled_add_norm(x[0], residual[0], weight)
                error = max((normed.double() - want_normed).abs().max().item(),
                            (new_residual.double() - want_residual).abs().max().item())
                result["rows"].append({"shape": shape_name, "what": "add+norm", "rows": rows, "impl": "fastpath",
                                       "us_per_call": us, "max_error": error})
                print(f"{key + ' fastpath':58} {us:8.2f} µs a call   max error {error:.2e}", flush=True)
                # FlashInfer's works in place: each call first gets fresh copies of its inputs, and the copies,
                # timed alone, are taken off
                xs, rs = [t.clone() for t in x], [t.clone() for t in residual]

                def restore_and_norm():
                    for l in range(layers):
                        xs[l].copy_(x[l])
                        rs[l].copy_(residual[l])
                        flashinfer.fused_add_rmsnorm(xs[l], rs[l], weight, EPS)

                def restore():
                    for l in range(layers):
                        xs[l].copy_(x[l])
                        rs[l].copy_(residual[l])
                us_both, us_copies = graph_us(restore_and_norm, layers), graph_us(restore, layers)
                restore_and_norm()
                error = max((xs[0].double() - want_normed).abs().max().item(),
                            (rs[0].double() - want_residual).abs().max().item())
                result["rows"].append({"shape": shape_name, "what": "add+norm", "rows": rows, "impl": "flashinfer",
                                       "us_per_call": us_both - us_copies, "us_with_restoring_copies": us_both,
                                       "us_restoring_copies": us_copies, "max_error": error})
                print(f"{key + ' flashinfer':58} {us_both - us_copies:8.2f} µs a call   max error {error:.2e}   "
                      f"({us_both:.2f} with the 2 restoring copies, {us_copies:.2f} without the norm)", flush=True)
            except Exception as e:
                result["errors"][key] = traceback.format_exc(limit=3)
                print(f"{key:58} failed: {type(e).__name__}: {e}", flush=True)
            save()
    print(f"\n{result['setting']}\n{result['flashinfer']=}, {result['torch']=}")
    save()


if __name__ == "__main__":
    main(sys.argv[1])
