"""GPU benchmark: DFlash step time against the bandwidth floor, batch 1, bf16.

Builds a target and a DFlash drafter with the shapes of a real pair and random weights (timing
only: with random weights the drafter is never right, so the measured τ is 1 and throughput is
also projected at τ = 6.5), then times, after warm-up, with CUDA events / synchronised clocks:

  hf-eager          HF generate, greedy, dynamic cache
  hf-static-compile HF generate, static cache, torch.compile(mode="reduce-overhead")
  dflash-ref        one dflash.py step (draft + verify)
  fast-ar           fastpath target-only greedy step (one token), and its graph replay alone
  fast-dflash       one fastpath DFlash step (graph replay), and its draft and verify parts
  fast-dflash2      the same for a DFlash2 drafter of the same backbone (its draft part beside DFlash's)
  sampled           the draft part alone at T 0.7: DFlash's drafts drawn from its p and its argmax, DFlash2's
                    drawn from its selector's q

and per layer (one target layer at 1 and K+1 rows, one drafter layer, each compiled and captured
alone): kernels, kernel time, replay time and the kernels by name.

Each row: ms per step, tokens/s at the measured τ and at τ = 6.5, and the floor = bytes that must be
read per step / device copy bandwidth measured in this run. A fastpath or dflash.py row is the median
of its decode steps after the first 4 (20 at least); a graph row the median of 50 replays; an HF row
the median of 3 runs of 64 tokens, less a 1-token run (the prefill), over 63. With --profile, each
graphed draft part's kernels by name (calls and µs per replay) go into the JSON (`draft_profiles`).

    $ python benchmarks/bench.py --shape qwen3-8b --out bench-qwen3-8b.json
    $ python benchmarks/bench.py --shape smollm2-135m
"""

from __future__ import annotations

if __name__ == "__main__":   # a Ctrl-C while torch and transformers import ends as the CLI's own: exit 130
    import signal
    import sys
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import dflash
import fastpath
from dflash_reference import scripts

SHAPES = {   # target config and DFlash drafter shape
    "qwen3-8b": dict(family="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     draft_layers=5, block_size=16, layer_ids=[1, 9, 17, 25, 33]),
    "smollm2-135m": dict(family="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         draft_layers=3, block_size=16, layer_ids=dflash.default_layer_ids(30, 3)),
}
PROJECTED_TAU = 6.5   # the paper's Qwen3-8B GSM8K acceptance length
MAX_POSITIONS = 4096   # the built target's max_position_embeddings
MIN_NEW_TOKENS = 25    # a random drafter's run commits one token a round: 24 rounds, 20 after the first 4
HF_NEW_TOKENS = 64     # what each HF row generates
SAMPLED_TEMPERATURE = 0.7   # the draft parts of `sampled`: row, drafter, Sampling.drafts
SAMPLED_ROWS = [("  fast draft part, T 0.7, drafts drawn", "dflash", "sampled"),
                ("  fast draft part, T 0.7, argmax", "dflash", "argmax"),
                ("  fast DFlash2 draft part, T 0.7", "dflash2", "sampled")]


def build_pair(shape: dict, dtype=torch.bfloat16, device="cuda"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    cfg_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if shape["family"] == "qwen3" else \
                         (LlamaConfig, LlamaForCausalLM)
    keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size"]
    tcfg = cfg_cls(**{k: shape[k] for k in keys}, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
                   rope_theta=1e6)
    torch.manual_seed(0)
    with torch.device(device):
        target = model_cls(tcfg).to(dtype).eval()
    dcfg = dflash.DraftConfig(
        hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_layers=shape["draft_layers"], num_heads=shape["num_attention_heads"],
        num_kv_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"], rms_norm_eps=1e-6,
        block_size=shape["block_size"], mask_token_id=shape["vocab_size"] - 1, target_layer_ids=shape["layer_ids"],
        rope_thetas=[1e6] * shape["draft_layers"], causal=[False] * shape["draft_layers"],
        windows=[None] * shape["draft_layers"])
    # the same backbone as DFlash2 (DFLASH2_DEFAULTS, z-lab's sizes): convolutions around each sublayer, a selector
    dcfg2 = dataclasses.replace(dcfg, conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16,
                                vocab_size=shape["vocab_size"])
    with torch.device(device):
        drafter = dflash.Drafter(dcfg).to(dtype).eval().requires_grad_(False)
        drafter2 = dflash.Drafter(dcfg2).to(dtype).eval().requires_grad_(False)
        for p in drafter2.candidate_selector.parameters():   # random codebooks: the walk's picks vary
            p.normal_(std=0.02)
    return target, drafter, drafter2


def inductor_settings() -> dict:
    """The inductor options (set by TORCHINDUCTOR_* variables) that change the compiled steps' kernels."""
    import torch._inductor.config as config
    return dict(enable_pdl=getattr(config.triton, "enable_pdl", None), max_autotune=config.max_autotune,
                coordinate_descent_tuning=config.coordinate_descent_tuning)


def copy_bandwidth(nbytes=2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written), median of 20."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times)


def skipped(flag: str, rows) -> set[str]:
    """--skip's comma-separated names, each checked against the rows a script can skip."""
    names = {name.strip() for name in flag.split(",") if name.strip()}
    dflash.require(names <= set(rows), f"--skip: {sorted(names - set(rows))} are not rows; use {', '.join(rows)}")
    return names


def require_out_dir(out: str | None):
    """--out's folder must exist and --out must not be a folder: checked before anything is timed."""
    if out is not None:
        dflash.require(not Path(out).is_dir(), f"--out {out} is a directory; give a file name")
        dflash.require(Path(out).resolve().parent.is_dir(), f"--out {out}: its directory does not exist")


def param_bytes(module, skip=()) -> int:
    return sum(p.numel() * p.element_size() for name, p in module.named_parameters()
               if not any(s in name for s in skip))


def kv_bytes(target, positions: int, dtype_bytes=2) -> int:
    c = target.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * positions * dtype_bytes


def round_times(generate_fn, target, drafter, prompt, max_new_tokens) -> tuple[list[float], dflash.Generation]:
    """Wall time of each decode round: the callback fires after the round's tokens reached the host
    (every implementation reads them, which synchronises), so successive stamps bracket one step."""
    stamps = []
    gen = generate_fn(target, drafter, prompt, max_new_tokens, on_tokens=lambda toks: stamps.append(
        time.perf_counter()))
    return [b - a for a, b in zip(stamps, stamps[1:])], gen


def graph_time(replay, iters=50, before=lambda: None) -> float:
    """Median ms of a captured graph's replay, with events around each replay, after 5 warm-ups;
    before() runs ahead of each replay, outside the events."""
    times = []
    for i in range(iters + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before()
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def profile_step(dec, steps=10) -> dict:
    """Kernel count and the costliest kernels of the graphed draft and verify parts, printed, and as a
    dict for the JSON: kernels and kernel time per step, and per kernel name its calls and µs per step."""
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            for graph in dec.graphs.values():
                graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time for e in kernels) / 1e3 / steps
    print(f"profile: {len(kernels) / steps:.0f} kernels per step, {busy_ms:.3f} ms of kernel time per step")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
    by_name = {}
    for e in kernels:
        calls, us = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (calls + 1, us + e.device_time)
    top = sorted(by_name.items(), key=lambda item: -item[1][1])
    return dict(steps=steps, kernels_per_step=len(kernels) / steps, kernel_ms_per_step=busy_ms,
                kernels=[dict(name=name[:120], calls_per_step=calls / steps, us_per_step=us / steps)
                         for name, (calls, us) in top])


def profile_eager(name: str, run, steps: int):
    """Where an eager step's time goes: run(n) decodes n tokens; the profiles of run(steps + 1) and
    run(1) are subtracted, so the prefill drops out. Prints, per step, the kernels and their GPU time,
    the CUDA runtime calls with the host time spent in them, and the host ops that cost the most."""
    from collections import Counter
    from torch.profiler import ProfilerActivity, profile

    def profiled(n):
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(n)
            torch.cuda.synchronize()
        events = prof.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        calls = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda")]
        counts, host_us = Counter(e.name for e in calls), Counter()
        for e in calls:
            host_us[e.name] += e.cpu_time_total
        return prof, len(kernels), sum(e.device_time for e in kernels), counts, host_us

    run(2)   # warm-up
    prof, kernels, busy_us, counts, host_us = profiled(steps + 1)
    _, kernels1, busy1, counts1, host1 = profiled(1)
    print(f"\nprofile of {name}, per step (mean of {steps}): {(kernels - kernels1) / steps:.0f} kernels, "
          f"{(busy_us - busy1) / steps / 1e3:.3f} ms of kernel time")
    for call in sorted(counts, key=lambda c: -host_us[c]):
        print(f"  {call:<34}{(counts[call] - counts1[call]) / steps:8.1f} calls {(host_us[call] - host1[call]) / steps / 1e3:9.3f} ms host")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


def layer_profile(run, steps=20) -> dict:
    """One layer's call `run()`, compiled (fullgraph) and captured as a CUDA graph: `graph_profile`."""
    compiled = torch.compile(run, fullgraph=True, dynamic=False)   # static shapes, as the Decoder's graphs
    return graph_profile(captured(compiled), steps)


def captured(run) -> torch.cuda.CUDAGraph:
    """`run()` after 3 warm-up calls (compiles, autotuning), captured as a CUDA graph."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def graph_profile(graph, steps=20, calls=1) -> dict:
    """A captured graph of `calls` like calls, per call: its kernels, their names, the kernel time and
    the replay time (CUDA events, median of 50), and per name the kernel µs (`name_us`)."""
    from collections import Counter
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names, us, per = Counter(e.name[:90] for e in kernels), Counter(), steps * calls
    for e in kernels:
        us[e.name[:90]] += e.device_time
    return dict(kernels=len(kernels) / per, kernel_us=sum(e.device_time for e in kernels) / per,
                replay_us=graph_time(graph.replay) * 1e3 / calls, names={n: c / per for n, c in names.most_common()},
                name_us={n: round(t / per, 3) for n, t in us.most_common()})


def draft_graph(dec, prompt) -> torch.cuda.CUDAGraph:
    """A Decoder's draft part alone, compiled as capture_graphs compiles it and captured after the prompt's
    prefill, its uniforms drawn once (its verify part is not compiled: a draft row replays only this)."""
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=1024):   # one compile per Decoder
        dec.prefill(prompt)
        dec.buf.max_accept.fill_(dec.K)
        if dec.draws_drafts:
            dec.buf.draft_uniforms.uniform_()
        return captured(torch.compile(dec.draft_step, fullgraph=True, dynamic=False))


def layer_profiles(dec, context: int) -> dict:
    """`layer_profile` of one target layer (fastpath.dense_layer, 1 and K+1 rows at the mid-generation
    context) and one drafter layer (fastpath.draft_layer, a block of W rows) over dec's buffers."""
    stack, K, device = dec.target_stack, dec.K, dec.device
    layer, H = stack.layers[0], stack.target.config.hidden_size
    out = {}
    for rows in (1, K + 1):
        x = torch.randn(1, rows, H, device=device, dtype=torch.bfloat16)                 # (1, N, H)
        slots = context + torch.arange(rows, device=device)[None]                        # (1, N)
        cos, sin = stack.target.model.rotary_emb(x, slots)
        out[f"target layer, {rows} row{'s' if rows > 1 else ''}"] = layer_profile(lambda: fastpath.dense_layer(
            layer, stack.apply_rotary, stack.qkv[0], stack.gate_up[0], stack.batch_keys[0][:1],
            stack.batch_values[0][:1], x, cos, sin, slots))
    module, W = dec.fused.module, dec.fused.module.config.block_size
    x = torch.randn(W, H, device=device, dtype=torch.bfloat16)                           # (W, H)
    positions = context + torch.arange(W, device=device)
    table = module.rope_tables(positions, x.dtype)[module.layers[0].self_attn.rope_theta]
    first, last = fastpath.visible_slots(positions, module.layers[0].causal, module.layers[0].window)
    out[f"drafter layer, {W} rows"] = layer_profile(lambda: fastpath.draft_layer(
        module.layers[0], dec.fused.gate_up[0], dec.buf.ctx_keys[0], dec.buf.ctx_values[0], x, table,
        positions, first, last))
    return out


def hf_generate_rate(target, prompt, max_new_tokens, **kwargs) -> float:
    """ms per token of HF generate (decode part: total minus a 1-token run for the prefill)."""
    ids = torch.tensor([prompt], device="cuda")

    def run(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0, **kwargs)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(8)   # warm-up (and compilation, for compiled variants)
    return (statistics.median(run(max_new_tokens) for _ in range(3)) - run(1)) / (max_new_tokens - 1) * 1e3


def main(argv=None):
    p = scripts.parser(__doc__)
    p.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--skip", default="", help="comma-separated rows to skip: fast, fast-ar, steps (the DFlash and "
                   "DFlash2 steps: their draft parts are then compiled and captured alone), dflash2 (the DFlash2 "
                   "drafter of the same backbone beside the DFlash one), sampled (draft parts at T 0.7), layers, "
                   "dflash-ref, hf-eager, hf-static-compile")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--profile", action="store_true", help="also print the kernels of the graphed AR and DFlash steps, "
                   "and keep each draft part's kernels by name in the JSON")
    p.add_argument("--profile-eager", action="store_true",
                   help="also profile the eager rows: a dflash.py step and an HF generate token")
    args = p.parse_args(argv)
    skip = skipped(args.skip, ("fast", "fast-ar", "steps", "dflash2", "sampled", "layers", "dflash-ref", "hf-eager",
                               "hf-static-compile"))
    shape = SHAPES[args.shape]
    dflash.require(args.prompt_len >= 1, f"--prompt-len = {args.prompt_len} must be at least 1")
    dflash.require(args.new_tokens >= MIN_NEW_TOKENS, f"--new-tokens = {args.new_tokens} must be at least "
                   f"{MIN_NEW_TOKENS} (a row is the median of its steps after the first 4, 20 at least)")
    longest = args.prompt_len + max(args.new_tokens, 0 if skip >= {"hf-eager", "hf-static-compile"} else HF_NEW_TOKENS)
    dflash.require(longest + shape["block_size"] <= MAX_POSITIONS,
                   f"--prompt-len + --new-tokens = {args.prompt_len + args.new_tokens} (at least {HF_NEW_TOKENS} "
                   f"for the HF rows) leaves no room for a block in the target's {MAX_POSITIONS} positions")
    require_out_dir(args.out)
    dflash.require(torch.cuda.is_available(), f"{p.prog} times CUDA kernels: no CUDA device here")
    target, drafter, drafter2 = build_pair(shape)
    K = shape["block_size"] - 1
    prompt = torch.randint(0, shape["vocab_size"] - 1, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    context = args.prompt_len + args.new_tokens // 2

    bandwidth = copy_bandwidth()
    lm_head = param_bytes(target.get_output_embeddings())
    ar_bytes = param_bytes(target, skip=("embed_tokens",)) + kv_bytes(target, context)
    draft_bytes = param_bytes(drafter) + lm_head   # the LM head is read again for the draft logits
    # DFlash2's codebooks are read a row per candidate and step (K·k·r values), not whole
    draft2_bytes = param_bytes(drafter2, skip=("codebook",)) + lm_head
    floor_ar, floor_step = ar_bytes / bandwidth * 1e3, (ar_bytes + draft_bytes) / bandwidth * 1e3
    conditions = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                      transformers=__import__("transformers").__version__, python=platform.python_version(),
                      shape=args.shape, dtype="bfloat16", batch=1, prompt_len=args.prompt_len,
                      new_tokens=args.new_tokens, K=K, weights="random (timing only; τ measured = 1)",
                      copy_bandwidth_TBps=bandwidth / 1e12, bytes_ar=ar_bytes, bytes_dflash_step=ar_bytes + draft_bytes,
                      compile_and_capture_s={}, inductor=inductor_settings(), sampled_rows=SAMPLED_ROWS)
    rows, errors, layers, profile, ar_profile, draft_profiles = [], {}, {}, None, None, {}
    print(f"\n{args.shape}: {conditions['gpu']}, bf16, batch 1, prompt {args.prompt_len}, {args.new_tokens} new, "
          f"K={K}, random weights, inductor {conditions['inductor']}; copy {bandwidth / 1e12:.2f} TB/s; floors {floor_ar:.3f} ms/AR token, "
          f"{floor_step:.3f} ms/DFlash step (incl. {lm_head / 1e9:.2f} GB LM head read again for drafts)")
    print(f"{'row':<22}{'ms/step':>9}{'tau':>6}{'tok/s':>9}{'tok/s@6.5':>11}{'floor ms':>10}{'x floor':>9}")

    def add(name, ms, tau, floor, speculative=False, note=""):
        tokens_at_6_5 = PROJECTED_TAU if speculative else 1.0   # an AR step commits one token whatever τ is
        r = dict(row=name, ms_per_step=ms, tau=tau, tok_s=tau / ms * 1e3 if ms else None,
                 tok_s_at_6_5=tokens_at_6_5 / ms * 1e3 if ms else None,
                 floor_ms=floor, ratio=ms / floor if ms else None, note=note)
        rows.append(r)
        fmt = lambda v, f: format(v, f) if v is not None else "-"
        print(f"{r['row']:<22}{fmt(r['ms_per_step'], '9.3f')}{r['tau']:6.2f}{fmt(r['tok_s'], '9.1f')}"
              f"{fmt(r['tok_s_at_6_5'], '11.1f')}{r['floor_ms']:10.3f}{fmt(r['ratio'], '9.2f')}  {r['note']}",
              flush=True)
        save()

    def save():   # rewritten after every row, in one step, so a run cut short still leaves its numbers
        if args.out:
            value = dict(conditions=conditions, rows=rows, errors=errors, layers=layers, step_profile=profile,
                         ar_step_profile=ar_profile, draft_profiles=draft_profiles)
            scripts.replace_file(Path(args.out), lambda p: p.write_text(json.dumps(value, indent=2)))

    capacity = fastpath.capacity_for(args.prompt_len, args.new_tokens, K)
    pairs = (("fast-ar", None), ("fast-dflash", drafter), ("fast-dflash2", drafter2))
    decoders = {name: fastpath.Decoder(target, d, capacity, K if d is not None else 0)   # held side by side
                for name, d in pairs if "fast" not in skip and name not in skip and
                not (name == "fast-dflash2" and "dflash2" in skip)}
    for name, dec in decoders.items():
        if dec.drafter is not None and "steps" in skip:
            continue   # its draft part alone, below
        t0 = time.perf_counter()
        dec.generate(prompt, 8)   # compiles and captures the step
        torch.cuda.synchronize()
        conditions["compile_and_capture_s"][name] = round(time.perf_counter() - t0, 1)
        fast = lambda target_, drafter_, ids, max_new, **kw: dec.generate(ids, max_new, **kw)
        times, gen = round_times(fast, target, dec.drafter, prompt, args.new_tokens)
        floor = {"fast-ar": floor_ar, "fast-dflash": floor_step}.get(name, (ar_bytes + draft2_bytes) / bandwidth * 1e3)
        add(name + (" step" if dec.drafter is not None else ""), statistics.median(times[4:]) * 1e3, gen.tau,
            floor, speculative=dec.drafter is not None)

    def add_graph(row, dec, part, floor_bytes, graph=None):   # a captured part replayed at the mid-generation context
        if graph is None and part == "draft" and "steps" in skip:   # the draft part alone, compiled and captured here
            t0 = time.perf_counter()
            graph = draft_graph(dec, prompt)
            conditions["compile_and_capture_s"][row.strip()] = round(time.perf_counter() - t0, 1)
        graph = graph or dec.graphs[part]
        with torch.inference_mode():   # a verify advances start: put it back before each replay, untimed
            ms = graph_time(graph.replay, before=lambda: dec.buf.start.fill_(context))
        add(row, ms, 1.0, floor_bytes / bandwidth * 1e3)
        if args.profile and part == "draft":
            with torch.inference_mode():
                dec.buf.start.fill_(context)
                draft_profiles[row.strip()] = found = graph_profile(graph)
            save()
            print(f"    {found['kernels']:.0f} kernels, {found['kernel_us']:.1f} us of kernel time; costliest: " +
                  ", ".join(f"{n[:40]} {t:.1f}" for n, t in list(found["name_us"].items())[:4]))

    ar = decoders.get("fast-ar")
    if ar is not None and ar.graphs:   # the AR row is a whole step, host loop included; this is its graph alone
        add_graph("  fast AR graph", ar, "verify", ar_bytes)
        if args.profile:
            print("AR step:", end=" ")
            ar_profile = profile_step(ar)
            save()
    dec2 = decoders.get("fast-dflash2")
    dec = decoders.get("fast-dflash")
    if dec is not None and (dec.graphs or "steps" in skip):
        add_graph("  fast draft part", dec, "draft", draft_bytes)
        if dec2 is not None:   # beside v1's: the same backbone with the convolutions and the walk
            add_graph("  fast DFlash2 draft part", dec2, "draft", draft2_bytes)
        if "steps" not in skip:
            add_graph("  fast verify part", dec, "verify", ar_bytes)
        if "sampled" not in skip:   # the draft part alone at T > 0: drafts drawn or the argmax
            for row, d, drafts in SAMPLED_ROWS:
                if d == "dflash2" and dec2 is None:
                    continue
                sampling = dflash.Sampling(SAMPLED_TEMPERATURE, drafts=drafts)
                at_t = fastpath.Decoder(target, drafter2 if d == "dflash2" else drafter, capacity, K, sampling=sampling)
                t0 = time.perf_counter()
                graph = draft_graph(at_t, prompt)
                conditions["compile_and_capture_s"][row.strip()] = round(time.perf_counter() - t0, 1)
                add_graph(row, at_t, "draft", draft2_bytes if d == "dflash2" else draft_bytes, graph)
                at_t.close()
    if dec is not None and dec.graphs:
        if args.profile:
            print("DFlash step:", end=" ")
            profile = profile_step(dec)
            save()
        if "layers" not in skip:
            with torch.inference_mode():
                layers.update(layer_profiles(dec, context))
            save()
            print("\nper layer (compiled and captured alone):")
            for what, found in layers.items():
                print(f"  {what:<26}{found['kernels']:5.0f} kernels {found['kernel_us']:8.1f} us kernel time "
                      f"{found['replay_us']:8.1f} us replay")
    if "dflash-ref" not in skip:
        times, gen = round_times(dflash.generate, target, drafter, prompt, 32)
        add("dflash-ref step", statistics.median(times[4:]) * 1e3, gen.tau, floor_step, speculative=True)
        if args.profile_eager:
            profile_eager("a dflash.py step", lambda n: dflash.generate(target, drafter, prompt, n), 8)
    if "hf-eager" not in skip:
        add("hf-eager", hf_generate_rate(target, prompt, HF_NEW_TOKENS), 1.0, floor_ar)
        if args.profile_eager:
            ids = torch.tensor([prompt], device="cuda")
            profile_eager("an HF generate token", lambda n: target.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0), 8)
    if "hf-static-compile" not in skip:
        eager_forward = target.forward
        try:
            target.forward = torch.compile(eager_forward, mode="reduce-overhead", fullgraph=True)
            add("hf-static-compile", hf_generate_rate(target, prompt, HF_NEW_TOKENS, cache_implementation="static"),
                1.0, floor_ar)
        except Exception as err:   # report, keep going: this row is known to fail on some releases
            errors["hf-static-compile"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            add("hf-static-compile", None, 1.0, floor_ar, note="failed: " + errors["hf-static-compile"][:90])
        finally:
            target.forward = eager_forward
    print(f"compile + capture (s): {conditions['compile_and_capture_s']}")
    for dec in decoders.values():
        dec.close()


if __name__ == "__main__":
    scripts.run(main)
