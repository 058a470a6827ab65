"""GPU benchmark of the training pipeline, bf16: self-distillation and drafter training throughput.

Builds a target with random weights at SmolLM2-135M's shapes (--shape; or loads --target), then, side by
side in one run, after warm-up:

  distill   response tokens/s of the same prompts at the same batch: distill.BatchDecoder (static K/V,
            continuous batching, one CUDA graph per temperature) against HF generate (dynamic cache).
            No stop tokens, so every row decodes all new tokens (the rate of rows that run to the
            cap; on real prompts ended rows are refilled). Floor: per step, max(weights + K/V
            read / copy bandwidth, matmul FLOPs / measured bf16 rate); the embedding is looked up,
            not read whole, and each row reads its own K/V, its prompt plus half the new tokens
            on average.
  train     one optimizer step of the packed forward over every anchor of a batch of sequences, for
            3 and 5 drafter layers, DFlash and DFlash2 (compiled, beside the compiled DFlash row): features cached (gathered from a flat device cache) or live (a
            target pass per step); the head's cross-entropy chunked through the frozen head
            (objective.FrozenHeadCrossEntropy), as whole (M, V) logits, or liger-kernel's fused linear
            cross-entropy where it is installed; eager or compiled as
            dflash-train train --compile compiles (the drafter's forward and the head's loss chunk), unrounded
            or with shapes rounded up (--pad-shapes 64 512).
            Each step draws a random batch, and each run its own batches, so shapes rarely repeat,
            as in training. Median of the timed steps after 3 warm-up steps (their seconds, the
            compile included, are reported); blocks/s (real blocks only) and the achieved TFLOP/s
            of train.step_flops.

    $ python benchmarks/bench_train.py --out bench-train.json
    $ python benchmarks/bench_train.py --shape qwen3-8b --skip distill,hf --dflash2-only --out dflash2-8b.json
"""

from __future__ import annotations

if __name__ == "__main__":   # a Ctrl-C while torch and transformers import ends as the CLI's own: exit 130
    import signal
    import sys
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import functools
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import bench
import dflash
from dflash_reference import loading, scripts
from dflash_reference.training import distill, objective, train

PADDED = (64, 512)   # the train row with rounded shapes (train --pad-shapes 64 512)
TRAIN_SEQUENCES = 64   # the random sequences the training rows draw their batches from


def matmul_rate(n=8192) -> float:
    """bf16 matmul FLOP/s on random data, median of 10 after 3 warm-ups."""
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * n ** 3 / statistics.median(times)


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def distill_floor_s(target, prompts, new: int, bandwidth: float, flops: float) -> float:
    """The least time `new` decode steps of every prompt can take: per step, the weights but the
    embedding read once and each row's K/V up to its length (its prompt plus half of `new` on
    average), or the matmul FLOPs, whichever takes longer. A tied embedding is the LM head too, and
    counts as one."""
    cfg = target.config
    kv_per_slot = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2   # bytes (bf16)
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    matmul = [p for p in target.parameters() if p is not embedding or p is head]   # every weight but a lookup
    weights = sum(p.numel() * p.element_size() for p in matmul)
    mean_span = sum(map(len, prompts)) / len(prompts) + new / 2
    step_bytes = weights + len(prompts) * mean_span * kv_per_slot
    step_flops = 2 * len(prompts) * sum(p.numel() for p in matmul)
    return new * max(step_bytes / bandwidth, step_flops / flops)


def bench_distill(target, prompts, max_new: int, hf_max_new: int, bandwidth: float, flops: float,
                  skip_hf: bool = False) -> list[dict]:
    """BatchDecoder and HF generate on the same prompts and batch; rows run to max_new (no stops)."""
    Bt, P = len(prompts), max(map(len, prompts))
    decoder = distill.BatchDecoder(target, Bt, P + max(max_new, hf_max_new))
    decoder.generate(prompts, max_new)                         # compiles and captures every bucket's graph: untimed
    rows = []
    for new in sorted({hf_max_new, max_new}):
        seconds = statistics.median(timed(lambda: decoder.generate(prompts, new)) for _ in range(3))
        floor = distill_floor_s(target, prompts, new, bandwidth, flops)
        rows.append({"impl": "BatchDecoder (graphs)", "batch": Bt, "new_tokens": new, "seconds": seconds,
                     "tokens_per_s": Bt * new / seconds, "floor_s": floor, "floor_tokens_per_s": Bt * new / floor})
    if skip_hf:
        return rows
    pad = 0
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts], device="cuda")
    attention = (torch.arange(P, device="cuda")[None] >= torch.tensor([P - len(p) for p in prompts],
                                                                      device="cuda")[:, None]).long()

    def hf():
        target.generate(input_ids=ids, attention_mask=attention, do_sample=False, max_new_tokens=hf_max_new,
                        min_new_tokens=hf_max_new, pad_token_id=pad, eos_token_id=None)

    hf()   # warm-up
    seconds = statistics.median(timed(hf) for _ in range(2))
    rows.append({"impl": "HF generate (dynamic cache)", "batch": Bt, "new_tokens": hf_max_new, "seconds": seconds,
                 "tokens_per_s": Bt * hf_max_new / seconds})
    return rows


def liger_loss(target, hidden, labels, weights):
    """block_loss through liger-kernel's fused linear cross-entropy: one call per block row k (one
    weight w_k each), summed, over the weight sum."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    ce = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    head = target.get_output_embeddings().weight
    labels = labels.to(hidden.device)
    total, weight_sum = 0, 0
    for k in range(1, labels.shape[1]):
        keep = labels[:, k] != objective.IGNORE
        total = total + weights[k] * ce(head, hidden[:, k][keep].to(head.dtype), labels[:, k][keep])
        weight_sum = weight_sum + weights[k] * keep.sum()
    return total / weight_sum


def full_logits_loss(target, hidden, labels, weights):
    """block_loss with the whole (M, V) float32 logits materialised, as autograd sees them."""
    labels = labels.to(hidden.device)
    keep = labels != objective.IGNORE
    w = weights.expand_as(labels)[keep]
    ce = F.cross_entropy(objective.lm_logits(target, hidden[keep]), labels[keep], reduction="none")
    return (w * ce).sum() / w.sum()


def bench_train(target, layers: int, sequences, batch: int, losses: dict, steps: int, runs: list[tuple]) -> list[dict]:
    """One row per run (features, loss, pad_shapes, compiled, drafter), each on a fresh drafter: "dflash", or
    "dflash2" as train --dflash2 makes it from one (rank 64, the rest the released defaults) with its selector's
    loss, or "dflash2-convs", the same drafter trained on the drafts' cross-entropy alone (its convolutions'
    cost without the selector's)."""
    raw = train.new_drafter_config(target, layers, 16, target.get_input_embeddings().weight.shape[0] - 1, 5)
    layer_ids = raw["dflash_config"]["target_layer_ids"]
    weights = objective.position_weights(16, 7.0, "cuda")
    cached = distill.CachedFeatures(target, sequences, layer_ids, torch.bfloat16)
    live = distill.LiveFeatures(target, sequences, layer_ids, torch.bfloat16)
    rows = []
    for run, (store_name, loss_name, pad, compiled, kind) in enumerate(runs):
        drafter = train.new_drafter(target, raw)
        if kind != "dflash":
            drafter, _ = train.as_dflash2(target, drafter, raw, loading.DFLASH2_DEFAULTS | {"selector_rank": 64})
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True)   # as train.train
        t_compile = time.perf_counter()
        if compiled:
            train.compile_drafter(drafter)   # as train --compile compiles it
        store, loss_fn = {"cached": cached, "live": live}[store_name], losses[loss_name]
        if loss_name == "chunked":   # as train: the head's loss chunk head_loss_chunk's, compiled with --compile
            loss_fn = functools.partial(objective.block_loss, chunk_grad=objective.head_loss_chunk(compiled))
        # batches of their own for each run: shapes that an earlier run met are cheaper to meet again
        # (cuDNN plans, the allocator), and training rarely meets a shape twice
        g = torch.Generator().manual_seed(run)
        times, blocks_seen, flops = [], [], []
        torch.cuda.reset_peak_memory_stats()
        for i in range(steps + 3):
            if i == 3:
                warmup_s = time.perf_counter() - t_compile   # 3 steps, the compile included
            indices = torch.randperm(len(sequences), generator=g)[:batch].tolist()   # a new shape nearly every step
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            features, labels, _ = objective.pad_positions(*store.batch(indices), pad[0])
            blocks = objective.make_blocks([sequences[j] for j in indices], 512, 16, drafter.config.mask_token_id,
                                       g, labels=labels, pad_to=pad[1])
            selector = {"selector": drafter.candidate_selector, "block_ids": blocks.block_ids} if kind == "dflash2" else {}
            with train.autocast(features.device):
                step_loss = loss_fn(target, train.draft_hidden(target, drafter, blocks, features), blocks.labels,
                                    weights, **selector)
            optimizer.zero_grad(set_to_none=True)
            step_loss.backward()
            optimizer.step()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
                blocks_seen.append(blocks.drawn())   # real blocks only
                flops.append(train.step_flops(drafter, target, blocks, features.shape[1], selector=kind == "dflash2"))
        seconds = statistics.median(times)
        rows.append({"layers": layers, "drafter": kind, "features": store_name, "loss": loss_name, "pad_shapes": list(pad), "batch": batch,
                     "compiled": compiled, "warmup_s": warmup_s,
                     "blocks_per_step": statistics.median(blocks_seen), "step_ms": seconds * 1e3,
                     "blocks_per_s": statistics.median(blocks_seen) / seconds,
                     "tflops": statistics.median(flops) / seconds / 1e12,
                     "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30})
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    p = scripts.parser(__doc__)
    p.add_argument("--target", help="a real target dir (default: --shape's shapes, random weights)")
    p.add_argument("--shape", choices=list(bench.SHAPES), default="smollm2-135m",
                   help="the random target's shapes (the drafters are 3 and 5 layers of its width)")
    p.add_argument("--distill-batch", type=int, default=1024)
    p.add_argument("--max-new", type=int, default=512, help="BatchDecoder new tokens per row")
    p.add_argument("--hf-max-new", type=int, default=128, help="new tokens per row in the side-by-side with HF")
    p.add_argument("--train-batch", type=int, default=8, help="sequences per training step (every anchor)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dflash2-only", action="store_true", help="train: only the compiled DFlash row beside the "
                   "DFlash2 rows (its whole loss, and its convolutions alone)")
    p.add_argument("--skip", default="", help="comma-separated: distill, hf (its HF generate row), train")
    p.add_argument("--out", help="write the results as JSON here (after each section)")
    args = p.parse_args(argv)
    scripts.require_at_least(args, 1, "distill_batch", "max_new", "hf_max_new", "train_batch", "steps")
    skip = bench.skipped(args.skip, ("distill", "hf", "train"))
    dflash.require(args.train_batch <= TRAIN_SEQUENCES, f"--train-batch = {args.train_batch} must be at most "
                   f"{TRAIN_SEQUENCES} (the sequences a step draws from)")
    bench.require_out_dir(args.out)
    dflash.require(torch.cuda.is_available(), f"{p.prog} times CUDA kernels: no CUDA device here")
    if args.target:
        target = loading.load_target(args.target, torch.bfloat16, "cuda")
    else:
        target = bench.build_pair(bench.SHAPES[args.shape])[0]
    bandwidth, flops = bench.copy_bandwidth(), matmul_rate()
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "dtype": "bfloat16", "target": args.target or f"{args.shape} shapes, random weights",
              "copy_bandwidth_gb_s": bandwidth / 1e9, "matmul_tflops": flops / 1e12}
    print(json.dumps(result), flush=True)

    def save():   # after each section, in one step: a run cut short keeps the sections before
        if args.out:
            scripts.replace_file(Path(args.out), lambda p: p.write_text(json.dumps(result, indent=2)))
    save()   # the conditions, before any section
    if "distill" not in skip:
        lengths = torch.randint(16, 257, (args.distill_batch,), generator=g).tolist()
        prompts = [torch.randint(0, vocab - 2, (n,), generator=g).tolist() for n in lengths]
        result["distill"] = bench_distill(target, prompts, args.max_new, args.hf_max_new, bandwidth, flops,
                                          "hf" in skip)
        save()
        print(f"\ndistill, batch {args.distill_batch}, prompts 16-256 tokens, bf16, copy {bandwidth / 1e9:.0f} GB/s, "
              f"matmul {flops / 1e12:.0f} TFLOP/s")
        print(f"{'impl':30} {'new':>5} {'s':>8} {'tok/s':>10} {'floor tok/s':>12}")
        for r in result["distill"]:
            print(f"{r['impl']:30} {r['new_tokens']:5} {r['seconds']:8.2f} {r['tokens_per_s']:10.0f} "
                  f"{r.get('floor_tokens_per_s', float('nan')):12.0f}")
    if "train" not in skip:
        sequences = [objective.Sequence(torch.randint(0, vocab - 2, (int(n),), generator=g), 100)
                     for n in torch.randint(300, 613, (TRAIN_SEQUENCES,), generator=g)]
        losses = {"chunked": objective.block_loss, "full-logits": full_logits_loss}
        try:
            import liger_kernel  # noqa: F401
            losses["liger-fused"] = liger_loss
        except ImportError:
            print("liger-kernel is not installed: its row is skipped")
        dflash2 = [("cached", "chunked", (1, 1), True, kind) for kind in ("dflash", "dflash2", "dflash2-convs")]
        runs3 = dflash2 if args.dflash2_only else (
            [("cached", "chunked", (1, 1), False, "dflash")] + dflash2 + [("cached", "chunked", PADDED, True, "dflash")]
            + [("cached", name, (1, 1), False, "dflash") for name in losses if name != "chunked"]
            + [("live", "chunked", (1, 1), False, "dflash")])
        runs5 = [] if args.dflash2_only else [("cached", "chunked", (1, 1), False, "dflash")]
        result["train"] = (bench_train(target, 3, sequences, args.train_batch, losses, args.steps, runs3)
                           + bench_train(target, 5, sequences, args.train_batch, losses, args.steps, runs5))
        print(f"\ntrain step, {args.train_batch} sequences of 300-612 tokens (prompt 100), every anchor, block 16, "
              f"bf16 autocast, fp32 master weights; matmul peak {flops / 1e12:.0f} TFLOP/s")
        print(f"{'layers':>6} {'drafter':>13} {'features':>8} {'loss':>12} {'pad':>7} {'compiled':>8} {'blocks':>7} "
              f"{'ms':>8} {'blocks/s':>9} {'TFLOP/s':>8} {'peak GiB':>8} {'warm-up s':>9}")
        for r in result["train"]:
            pad = "x".join(map(str, r["pad_shapes"]))
            print(f"{r['layers']:6} {r['drafter']:>13} {r['features']:>8} {r['loss']:>12} {pad:>7} {str(r['compiled']):>8} "
                  f"{r['blocks_per_step']:7.0f} {r['step_ms']:8.1f} {r['blocks_per_s']:9.0f} {r['tflops']:8.1f} "
                  f"{r['peak_gib']:8.1f} {r['warmup_s']:9.1f}")
        save()


if __name__ == "__main__":
    scripts.run(main)
