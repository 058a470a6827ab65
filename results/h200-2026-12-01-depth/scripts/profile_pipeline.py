"""Kernel profile of (i) one BatchDecoder decode step (batch 2048, S = 512 attended slots, SmolLM2-135M
shapes, random weights), graph-replayed and eager, and (ii) one training step as bench_train.py runs
it (3 layers, cached features, chunked head loss, 8 sequences, every anchor).

Run from .carry/code:  python3 ../profile_pipeline.py OUTDIR
Writes OUTDIR/profile-decode.txt and OUTDIR/profile-train.txt.
"""
import collections
import io
import os
import re
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import bench
import fastpath
import train

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
SHAPE = bench.SHAPES["smollm2-135m"]
CUDA = torch.autograd.DeviceType.CUDA
CPU = torch.autograd.DeviceType.CPU

ATTN_CTX = re.compile(r"\battend\b|scaled_dot_product|ScaledDotProduct|efficient_attention|flash_attention|"
                      r"cudnn_attention|aten::_?softmax\b|aten::_softmax_backward|(?<!Log)SoftmaxBackward|"
                      r"BmmBackward|aten::bmm")
ATTN_NAME = re.compile(r"fmha|flash|attention|Attention", re.I)
GEMM_NAME = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|gemv|splitK|Kernel2", re.I)
COPY_NAME = re.compile(r"copy|Memcpy|Memset|CatArray|index|gather|scatter|fill|take|embedding", re.I)
COPY_CTX = re.compile(r"aten::(copy_|index_copy_|index|cat|gather|scatter|clone|contiguous|_to_copy|fill_|zero_|"
                      r"embedding|masked_select|nonzero|take)")
ELEM_NAME = re.compile(r"elementwise|reduce|norm|rsqrt|pow|mean|silu|sigmoid|mul|add|exp|where|masked|softmax|"
                       r"log|neg|cos|sin|div|sum|max|argmax|arange|clamp|foreach|multi_tensor|adam", re.I)


def name_group(name):
    if ATTN_NAME.search(name):
        return "attention"
    if GEMM_NAME.search(name):
        return "GEMM"
    if COPY_NAME.search(name):
        return "copies/index"
    if ELEM_NAME.search(name):
        return "elementwise/norm/rope"
    return "other"


def ancestors(evt):
    names = []
    while evt is not None:
        names.append(evt.name)
        evt = evt.cpu_parent
    return names


def group(name, chain):
    """kernel name + chain of launching CPU ops (innermost first) -> group."""
    ctx = " | ".join(chain)
    if ATTN_CTX.search(ctx) or ATTN_NAME.search(name):
        return "attention"
    g = name_group(name)
    if g in ("GEMM", "copies/index"):
        return g
    if chain and COPY_CTX.search(chain[0]):
        return "copies/index"
    return g


def kernels_of(prof):
    """-> list of (start_us, name, duration_us, chain of launching CPU op names), device kernels only
    (memcpy/memset included), sorted by start time."""
    events = prof.events()
    cpu_by_id = {e.id: e for e in events if e.device_type == CPU}
    out = []
    for e in events:
        if e.device_type != CUDA:
            continue
        cid = getattr(e, "linked_correlation_id", 0) or 0
        parent = cpu_by_id.get(cid)
        chain = ancestors(parent) if parent is not None else []
        out.append((e.time_range.start, e.name, e.time_range.end - e.time_range.start, chain))
    out.sort(key=lambda k: k[0])
    return out


def phase_of(chain, phases, default):
    for n in chain:
        if n in phases:
            return n
    return default


def summarize(f, title, kernels, steps, wall_ms, groups_from_context=True, phases=None, default_phase=None):
    total = sum(k[2] for k in kernels) / steps / 1e3
    print(f"\n=== {title} ===", file=f)
    print(f"per step: {len(kernels) / steps:.0f} kernels, {total:.3f} ms of kernel time; measured wall "
          f"(unprofiled) {wall_ms:.3f} ms per step", file=f)
    by_group, by_group_n = collections.Counter(), collections.Counter()
    sub = collections.defaultdict(collections.Counter)
    for _, name, dur, chain in kernels:
        g = group(name, chain) if groups_from_context else name_group(name)
        by_group[g] += dur
        by_group_n[g] += 1
        if g == "attention":
            sub[g][name_group(name) if name_group(name) != "attention" else "fused attention"] += dur
    print("time by group (ms per step, share, kernels per step):", file=f)
    for g in ["GEMM", "attention", "elementwise/norm/rope", "copies/index", "other"]:
        print(f"  {g:24} {by_group[g] / steps / 1e3:9.3f} ms  {100 * by_group[g] / max(1, sum(by_group.values())):5.1f}%"
              f"  {by_group_n[g] / steps:7.1f}", file=f)
    if sub["attention"]:
        print("  attention, by kernel kind: " + ", ".join(f"{k} {v / steps / 1e3:.3f} ms"
                                                         for k, v in sub["attention"].most_common()), file=f)
    if phases:
        by_phase, by_phase_n = collections.Counter(), collections.Counter()
        for _, name, dur, chain in kernels:
            p = phase_of(chain, phases, default_phase)
            by_phase[p] += dur
            by_phase_n[p] += 1
        print("time by phase (ms per step, kernels per step):", file=f)
        for p, v in by_phase.most_common():
            print(f"  {p:28} {v / steps / 1e3:9.3f} ms  {by_phase_n[p] / steps:7.1f}", file=f)
    per = collections.defaultdict(lambda: [0, 0.0, collections.Counter()])
    for _, name, dur, chain in kernels:
        row = per[name]
        row[0] += 1
        row[1] += dur
        row[2][group(name, chain) if groups_from_context else name_group(name)] += 1
    print("top-30 kernels by time (per step: calls, ms total, us mean; group):", file=f)
    for name, (n, dur, gs) in sorted(per.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"  {n / steps:6.1f} {dur / steps / 1e3:9.3f} ms {dur / n:9.1f} us  {gs.most_common(1)[0][0]:22} "
              f"{name[:150]}", file=f)
    return total


def cuda_ms(fn, n):
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def profile_decode(f):
    t0 = time.perf_counter()
    target, _ = bench.build_pair(SHAPE)
    Bt, P, S = 2048, 256, 512
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 257, (Bt,), generator=g).tolist()
    prompts = [torch.randint(0, SHAPE["vocab_size"] - 2, (n,), generator=g).tolist() for n in lengths]
    decoder = train.BatchDecoder(target, Bt, P + 512)
    decoder.generate(prompts, S - P + 1)     # prefill + steps up to slot 511: graphs for S = 384 and 512
    graph = decoder.graphs[(S, 0.0)]
    decoder.slot.fill_(S - 1)
    print(f"decode: batch {Bt}, prompts 16-256 left-padded to {P}, attended slots S = {S}, greedy; "
          f"setup {time.perf_counter() - t0:.1f}s; graphs {sorted(decoder.graphs)}", file=f)
    cfg = target.config
    kv = Bt * S * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    print(f"K/V read per step: {kv / 1e9:.2f} GB -> {kv / 4.2e12 * 1e3:.2f} ms at 4.2 TB/s", file=f)
    graph_ms = cuda_ms(graph.replay, 20)

    def eager():
        with torch.inference_mode():
            decoder.step(S, 0.0)
    eager()
    eager_ms = cuda_ms(eager, 5)
    # graph replay: kernels inside the graph, if CUPTI reports them
    steps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    graph_kernels = kernels_of(prof)
    print(f"graph replay: {len(graph_kernels)} device events in {steps} replays", file=f)
    # eager step, with attend marked so its kernels group as attention
    real_attend = fastpath.attend

    def attend(*a, **k):
        with record_function("attend"):
            return real_attend(*a, **k)
    fastpath.attend = attend
    eager()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof_e:
        for _ in range(steps):
            eager()
        torch.cuda.synchronize()
    fastpath.attend = real_attend
    eager_kernels = kernels_of(prof_e)
    summarize(f, f"EAGER decode step (decoder.step, attend marked), {steps} steps profiled", eager_kernels, steps,
              eager_ms)
    if graph_kernels:
        # borrow the eager step's op context kernel by kernel where the sequences match
        per_g, per_e = len(graph_kernels) // steps, len(eager_kernels) // steps
        borrowed = graph_kernels
        if per_g == per_e and all(a[1] == b[1] for a, b in zip(graph_kernels[:per_g], eager_kernels[:per_e])):
            borrowed = [(s, n, d, eager_kernels[i % per_e][3]) for i, (s, n, d, _) in enumerate(graph_kernels)]
            note = "groups from the eager step's op context (kernel sequences match one for one)"
        else:
            note = f"groups from kernel names only (graph {per_g} vs eager {per_e} kernels per step)"
            borrowed = [(s, n, d, []) for s, n, d, _ in graph_kernels]
        summarize(f, f"GRAPH-REPLAYED decode step, {steps} replays profiled; {note}", borrowed, steps, graph_ms)
        span = (graph_kernels[-1][0] + graph_kernels[-1][2] - graph_kernels[0][0]) / steps / 1e3
        print(f"graph: first kernel start to last kernel end, per step: {span:.3f} ms", file=f)
    else:
        print(f"\nGRAPH-REPLAYED step: the profiler saw no kernels inside the graph; wall {graph_ms:.3f} ms",
              file=f)
    print("\n--- key_averages of the EAGER step, sort_by device_time_total (totals over "
          f"{steps} steps) ---", file=f)
    print(prof_e.key_averages().table(sort_by="device_time_total", row_limit=30, max_name_column_width=90), file=f)
    if graph_kernels:
        print(f"\n--- key_averages of the GRAPH replays (totals over {steps} replays) ---", file=f)
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=30, max_name_column_width=90), file=f)
    del decoder, graph, target
    torch.cuda.empty_cache()


def profile_train(f):
    target, _ = bench.build_pair(SHAPE)
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    sequences = [train.Sequence(torch.randint(0, vocab - 2, (int(n),), generator=g), 100)
                 for n in torch.randint(300, 613, (64,), generator=g)]
    raw = train.new_drafter_config(target, 3, 16, SHAPE["vocab_size"] - 1, 5)
    drafter = train.new_drafter(target, raw)
    weights = train.position_weights(16, 7.0, "cuda")
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    store = train.CachedFeatures(target, sequences, drafter.config.target_layer_ids, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    batch = 8
    info = {}

    def step(i):
        indices = list(range((i * batch) % len(sequences), (i * batch) % len(sequences) + batch))
        with record_function("features_gather"):
            features, labels = store.batch(indices)
        with record_function("make_blocks"):
            blocks = train.make_blocks([sequences[j] for j in indices], 512, 16, drafter.config.mask_token_id,
                                       gen, labels=labels)
        with train.autocast(features.device):
            with record_function("drafter_forward"):
                hidden = train.draft_hidden(target, drafter, blocks, features)
            with record_function("head_loss_fwd+grad"):
                loss = train.block_loss(target, hidden, blocks.labels, weights)
        with record_function("zero_grad"):
            optimizer.zero_grad(set_to_none=True)
        with record_function("backward_call"):
            loss.backward()
        with record_function("optimizer_step"):
            optimizer.step()
        info["blocks"], info["N"] = len(blocks.anchors), features.shape[1]
        info["flops"] = train.step_flops(drafter, target, blocks, features.shape[1])

    for i in range(3):
        step(i)
    walls = []
    for i in range(3, 9):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
    wall = statistics.median(walls)
    steps = 2
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(9, 9 + steps):
            step(i)
        torch.cuda.synchronize()
    kernels = kernels_of(prof)
    print(f"train step: 3 layers, cached features, chunked head loss (FrozenHeadCrossEntropy), {batch} sequences of "
          f"300-612 tokens (prompt 100), every anchor; last step {info['blocks']} blocks, N {info['N']}; "
          f"median wall {wall:.1f} ms of {len(walls)} steps ({walls}); {info['flops'] / wall / 1e9:.1f} TFLOP/s "
          f"by step_flops; peak {torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB", file=f)
    total = summarize(f, f"TRAINING step, {steps} steps profiled", kernels, steps, wall,
                      phases={"features_gather", "make_blocks", "drafter_forward", "head_loss_fwd+grad", "zero_grad",
                              "backward_call", "optimizer_step"}, default_phase="backward (autograd thread)")
    if kernels:
        span = (kernels[-1][0] + kernels[-1][2] - kernels[0][0]) / steps / 1e3
        print(f"first kernel start to last kernel end, per step: {span:.3f} ms; GPU idle share of that span "
              f"{100 * (1 - total / span):.1f}%", file=f)
    print(f"\n--- key_averages, sort_by device_time_total (totals over {steps} steps) ---", file=f)
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=30, max_name_column_width=90), file=f)
    print(f"\n--- key_averages, sort_by self_device_time_total (totals over {steps} steps) ---", file=f)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=90), file=f)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    for name, fn in [("profile-decode.txt", profile_decode), ("profile-train.txt", profile_train)]:
        t = time.perf_counter()
        buf = io.StringIO()
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, bf16", file=buf)
        try:
            fn(buf)
        except Exception:
            buf.write("\nFAILED:\n" + traceback.format_exc())
        buf.write(f"\n(profile took {time.perf_counter() - t:.1f}s)\n")
        with open(os.path.join(OUT, name), "w") as out:
            out.write(buf.getvalue())
        print(buf.getvalue()[:1500], flush=True)
