"""Measure a DFlash drafter: τ, acceptance per draft position, speedup over the target alone
(tokens/s against tokens/s, each timed by the wall clock), and losslessness on every prompt, on
MT-Bench and HumanEval (loading.py reads them from their PyPI packages). Both runs of each prompt go through the same implementation: dflash.py's
generate, or two held fastpath Decoders (the target alone, and DFlash).

    $ dflash-eval --target DIR --draft drafter/SmolLM2-135M-Instruct-DFlash2-b16 --impl fastpath --out eval
"""

from __future__ import annotations

if __name__ == "__main__":   # a Ctrl-C while torch and transformers import ends as the CLI's own: exit 130
    import signal
    import sys
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import functools
import itertools
import json
import sys
import time
from contextlib import ExitStack, closing
from pathlib import Path

import torch

import dflash
import fastpath
from dflash import DFlashError, Drafter
from dflash_reference import loading, scripts


# -----------------------------------------------------------------------------
# Evaluation: τ, acceptance per position, wall-clock, and losslessness on every prompt

def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def evaluate(generate_fn, target, drafter: Drafter, prompts: list[list[int]], max_new_tokens: int,
             stop_ids=(), progress: bool = True, sampling: dflash.Sampling = dflash.Sampling(),
             seed: int = 0, on_prompt=None) -> dict:
    """DFlash against the target alone on each prompt, through `generate_fn` (dflash.generate, or
    any function with its signature and Generation result). A short untimed run of the first prompt
    warms up first (compilation, allocator). τ is pooled over every round of every prompt; speedup is
    DFlash's tokens/s over the target alone's (generate_fn with no drafter), each its tokens over its
    total time: where the two texts differ in length (sampling, or bf16 near-ties) a ratio of times
    would credit the shorter text with speed.
    Greedy runs must match the target alone token for token ("lossless"); sampled runs draw other
    random numbers than the target alone, so there "lossless" is None (tests check the law).
    on_prompt(result so far) runs after each prompt, so that a caller can save as it goes."""
    from tqdm import tqdm
    device = target.get_input_embeddings().weight.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(d, ids, max_new=max_new_tokens):
        sync()
        t0 = time.perf_counter()
        gen = generate_fn(target, d, ids, max_new, stop_ids=stop_ids, sampling=sampling, seed=seed)
        sync()
        return gen, time.perf_counter() - t0

    if not prompts:
        raise DFlashError("evaluate: no prompts")
    warm_up = min(max_new_tokens, 2 * drafter.config.block_size)   # every step's shapes, not a whole answer
    timed(None, prompts[0], warm_up)
    K = len(timed(drafter, prompts[0], warm_up)[0].position_drafted)   # drafts per round: block_size - 1 unless set
    per_prompt = []
    bar = tqdm(prompts, desc="eval", unit="prompt", disable=not progress)
    for ids in bar:
        reference, seconds_ref = timed(None, ids)
        gen, seconds = timed(drafter, ids)
        per_prompt.append({"prompt_tokens": len(ids), "new_tokens": len(gen.tokens), "tau": gen.tau,
                           "target_tokens": len(reference.tokens), "target_s": seconds_ref, "dflash_s": seconds,
                           "first_mismatch": first_difference(gen.tokens, reference.tokens),
                           "acceptance_lengths": gen.acceptance_lengths,
                           "position_accepted": gen.position_accepted, "position_drafted": gen.position_drafted})
        result = summary(per_prompt, K, drafter.config.block_size, max_new_tokens, sampling.temperature == 0)
        bar.set_postfix(tau=f"{result['tau']:.2f}" if result["tau"] is not None else "-",
                        speedup=f"{result['speedup']:.2f}x")
        if on_prompt is not None:
            on_prompt(result)
    return result


def summary(per_prompt: list[dict], K: int, block_size: int, max_new_tokens: int, greedy: bool) -> dict:
    """The figures of the prompts run so far (evaluate's per-prompt records)."""
    lengths = [n for p in per_prompt for n in p["acceptance_lengths"]]
    accepted = [sum(p["position_accepted"][k] for p in per_prompt) for k in range(K)]
    drafted = [sum(p["position_drafted"][k] for p in per_prompt) for k in range(K)]
    t_target, t_dflash = sum(p["target_s"] for p in per_prompt), sum(p["dflash_s"] for p in per_prompt)
    target_tokens, new_tokens = sum(p["target_tokens"] for p in per_prompt), sum(p["new_tokens"] for p in per_prompt)
    mismatches = [i for i, p in enumerate(per_prompt) if p["first_mismatch"] is not None] if greedy else []
    return {"prompts": len(per_prompt), "block_size": block_size, "num_drafts": K, "max_new_tokens": max_new_tokens,
            "tau": sum(lengths) / len(lengths) if lengths else None,   # None: no round ran (nothing to rate)
            "acceptance": [a / d if d else None for a, d in zip(accepted, drafted)],   # None: never drafted
            "target_seconds": t_target, "dflash_seconds": t_dflash,
            "speedup": (new_tokens / t_dflash) / (target_tokens / t_target),
            "target_tokens_per_s": target_tokens / t_target,
            "dflash_tokens_per_s": new_tokens / t_dflash, "lossless": not mismatches if greedy else None,
            "mismatched_prompts": mismatches, "per_prompt": per_prompt}


def pyplot():
    """matplotlib.pyplot with the file-only Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_eval(results: dict[str, dict], path: Path) -> bool:
    """Acceptance rate per block position for each dataset, and τ / speedup per dataset.
    Returns False (and writes nothing) where matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        tau = "no rounds" if r["tau"] is None else f"τ {r['tau']:.2f}"
        left.plot(range(1, len(r["acceptance"]) + 1), r["acceptance"], marker="o", label=f"{name} ({tau})")
    left.set(xlabel="draft position k in the block", ylabel="accepted / drafted", ylim=(0, 1.02),
             title="acceptance per block position")
    left.legend()
    names = list(results)
    x = torch.arange(len(names)).float()
    right.bar(x - 0.2, [results[n]["tau"] or 0.0 for n in names], width=0.4, label="τ (tokens / round)")
    right.bar(x + 0.2, [results[n]["speedup"] for n in names], width=0.4, label="speedup vs target alone")
    right.set_xticks(x.tolist(), names)
    top = max(max(results[n]["tau"] or 0.0, results[n]["speedup"]) for n in names)
    right.set(title="τ and speedup (tokens/s over the target alone's)", ylim=(0, 1.3 * top))   # headroom for the legend
    right.legend(loc="upper center", ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def blocks_seen(log: dict) -> list[int]:
    """Training blocks seen after each step of a training.json history: the per-step count where the
    history records it, else batch_size × anchors per step (histories written before it did, when
    every sequence had that many blocks, padding included)."""
    per_step = log["args"]["batch_size"] * log["args"]["anchors"]
    return list(itertools.accumulate(h.get("blocks", per_step) for h in log["history"]))


def phase_points(logs: dict[str, dict]) -> dict[str, list[tuple[int, float]]]:
    """(training blocks seen, held-out τ) of each phase, the phases end to end (each continued from
    the one before); a phase that measured its starting checkpoint (`at_init`) starts there."""
    points, start = {}, 0
    for name, log in logs.items():
        seen = blocks_seen(log)
        at_init = log.get("at_init") or {}   # a phase whose first file held none out has no heldout_tau
        points[name] = [(start, at_init["heldout_tau"])] if "heldout_tau" in at_init else []
        points[name] += [(start + seen[i], h["heldout_tau"]) for i, h in enumerate(log["history"]) if "heldout_tau" in h]
        start += seen[-1]
    return points


def plot_training(logs: dict[str, dict], path: Path) -> bool:
    """Held-out τ against training blocks seen, one line per phase (`phase_points`). Returns False
    where matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = plt.cm.tab20.colors   # more phases than the default cycle's 10 colours
    for k, (name, points) in enumerate(phase_points(logs).items()):
        ax.plot([x / 1e6 for x, _ in points], [y for _, y in points], marker="o", label=name,
                color=colors[k % len(colors)])
    ax.set(xlabel="training blocks seen (millions, all phases)", ylabel="held-out τ",
           title="held-out τ by phase (each phase on its own held-out answers)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))   # beside the lines, never over them
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -----------------------------------------------------------------------------
# CLI

def fastpath_generate(stack: ExitStack, target, drafter, capacity: int, K: int, sampling: dflash.Sampling):
    """A generate_fn over two held Decoders (target alone, DFlash), each compiled once for every prompt."""
    decoders = {d: stack.enter_context(closing(fastpath.Decoder(target, d, capacity, K if d else 0, True, sampling)))
                for d in (None, drafter)}

    def generate_fn(target_, drafter_, ids, max_new_tokens, *, stop_ids=(), sampling=None, seed=None):
        return decoders[drafter_].generate(ids, max_new_tokens, stop_ids=stop_ids, seed=seed)
    return generate_fn


def main(argv=None):
    args = parse_args(argv)
    dflash.require(args.limit is None or args.limit >= 1, f"--limit = {args.limit} must be at least 1")
    scripts.require_seed(args.seed)
    dflash.require(args.max_new_tokens >= 1, f"--max-new-tokens = {args.max_new_tokens} must be at least 1")
    dflash.require(args.target is None or args.draft is not None, f"--target = {args.target!r} needs --draft")
    out = Path(args.out)
    dflash.require(not out.exists() or out.is_dir(), f"--out {out} is a file; give a directory for eval.json")
    scripts.quiet_transformers()
    device, dtype = scripts.device_and_dtype(args.device, args.dtype)
    sampling = dflash.Sampling(args.temperature, args.top_p, args.top_k, args.drafts)
    args.target, args.draft = loading.pair_paths(args.target, args.draft)
    target, tokenizer = loading.load_target_and_tokenizer(args.target, dtype, device)
    drafter = loading.load_drafter(args.draft, target, dtype, device)
    K = args.num_drafts if args.num_drafts is not None else \
        scripts.default_num_drafts(drafter.config.block_size, device)
    # the request's limits checked once, before the data sets load (each prompt's length is checked as it runs)
    dflash.check_request([0], args.max_new_tokens, K, **dflash.request_limits(target, drafter))
    stops = loading.stop_token_ids(target, tokenizer)
    prompts = {name: [loading.encode_chat(tokenizer, text) for text in loading.EVAL_DATASETS[name]()[:args.limit]]
               for name in args.datasets}
    out.mkdir(parents=True, exist_ok=True)
    hardware = torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu, {torch.get_num_threads()} threads"
    report = {"target": args.target, "draft": args.draft, "impl": args.impl, "device": hardware,
              "dtype": str(dtype).removeprefix("torch."), "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "drafts": args.drafts, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
              "num_drafts": K, "interrupted": False, "datasets": {}}
    with ExitStack() as stack:
        generate_fn = functools.partial(dflash.generate, num_drafts=K)
        if args.impl == "fastpath":   # one buffer size for every prompt: one compile, not one per length
            longest = max(len(ids) for batch in prompts.values() for ids in batch)
            capacity = fastpath.capacity_for(longest, args.max_new_tokens, K)
            generate_fn = fastpath_generate(stack, target, drafter, capacity, K, sampling)
        def save(name, result):   # after every prompt, in one step: an interrupted run keeps what it ran
            report["datasets"][name] = result
            scripts.replace_file(out / "eval.json", lambda p: p.write_text(json.dumps(report, indent=1)))

        for name, batch in prompts.items():
            print(f"{name}: {len(batch)} prompts; warming up on the first (untimed"
                  f"{', compiling and capturing the steps' if args.impl == 'fastpath' and device.startswith('cuda') else ''})",
                  file=sys.stderr)
            try:
                r = evaluate(generate_fn, target, drafter, batch, args.max_new_tokens, stops, sampling=sampling,
                             seed=args.seed, on_prompt=functools.partial(save, name))
            except KeyboardInterrupt:
                report["interrupted"] = True
                if name in report["datasets"]:
                    save(name, report["datasets"][name])
                done = {n: d["prompts"] for n, d in report["datasets"].items()}
                print(f"\ninterrupted: {out / 'eval.json'} holds the prompts run, "
                      f"{', '.join(f'{n} {c}' for n, c in done.items()) or 'none'}", file=sys.stderr)
                raise SystemExit(130) from None
            verdict = {True: "lossless", None: "sampled"}.get(r["lossless"], f"MISMATCH on prompts {r['mismatched_prompts']}")
            if r["lossless"] is False and dtype in (torch.bfloat16, torch.float16):
                verdict = (f"differs from the target alone on {len(r['mismatched_prompts'])}/{r['prompts']} prompts: in "
                           f"{str(dtype).removeprefix('torch.')} a {drafter.config.block_size}-row verify rounds "
                           f"differently from a 1-row step, so near-tied argmaxes can flip (float32 is token-identical)")
            tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
            print(f"{name}: {r['prompts']} prompts, τ {tau}, speedup {r['speedup']:.2f}x "
                  f"({r['dflash_tokens_per_s']:.1f} vs {r['target_tokens_per_s']:.1f} tokens/s), {verdict}",
                  file=sys.stderr)
    plotted = plot_eval(report["datasets"], out / "eval.png")
    print(f"-> {out / 'eval.json'}" + (f", {out / 'eval.png'}" if plotted else " (no matplotlib: no plot)"),
          file=sys.stderr)


def parse_args(argv=None):
    p = scripts.parser("τ, acceptance per position, speed and losslessness of a DFlash drafter on MT-Bench and "
                   "HumanEval.")
    scripts.add_pair_flags(p)
    p.add_argument("--datasets", nargs="+", choices=list(loading.EVAL_DATASETS), default=list(loading.EVAL_DATASETS),
                   help="evaluation sets to run, in order")
    p.add_argument("--limit", type=int, help="first N prompts of each dataset (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens to generate at most per prompt")
    p.add_argument("--impl", default="dflash", choices=["dflash", "fastpath"], help="implementation that decodes")
    p.add_argument("--num-drafts", type=int, help="drafts K per round (default block_size - 1; on CPU at most "
                   f"{scripts.CPU_NUM_DRAFTS}, as the CLI)")
    scripts.add_sampling_flags(p, "sampling seed (both runs of a prompt)", seed_default=0)
    p.add_argument("--out", default="eval", help="dir for eval.json and eval.png")
    scripts.add_device_flags(p)
    return p.parse_args(argv)



def command():
    """`dflash-eval`: main, with bad input as one `error:` line (exit 2) and Ctrl-C as exit 130."""
    scripts.run(main)


if __name__ == "__main__":
    command()
