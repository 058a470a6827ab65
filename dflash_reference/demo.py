"""The demo: `python dflash.py` and `python fastpath.py`, installed as `dflash-demo` and `dflash-fast`.

The default pair, or any target and drafter, one prompt: its text streamed as rounds commit, then the
stats (drafter, tokens, rounds, τ, speed, acceptance per draft position), or one JSON line. dflash.py
takes and returns token ids only; the tokenizer side is loading.py's.

    $ python dflash.py --max-new-tokens 64 --json
"""
import json
import signal
import sys
import threading
import time
from contextlib import contextmanager

import torch

from dflash import Generation, Interrupted, Sampling, check_request, generate, require
from dflash_reference import loading, scripts

# -----------------------------------------------------------------------------
# Text as it commits, and the stats


@contextmanager
def ctrl_c_held():
    """Ctrl-C (SIGINT) held back until the block ends, then raised as KeyboardInterrupt. Raised between
    counting a round and printing it, or inside the print, it would leave the count claiming text that
    never reached the stream. Only Python's own handler in the main thread is held; any other runs."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def printer(tokenizer):
    """An on_tokens callback that prints a generation as it is committed: its text, or ids without a
    tokenizer. Ctrl-C waits for a print to end, so that `seen` is always exactly what was printed."""
    seen = []

    def print_tokens(tokens: list[int]):
        with ctrl_c_held():
            if tokenizer is None:
                seen.extend(tokens)
                return print(" ".join(map(str, tokens)), end=" ", flush=True)
            text_before = tokenizer.decode(seen, skip_special_tokens=True)
            seen.extend(tokens)
            print(tokenizer.decode(seen, skip_special_tokens=True)[len(text_before):], end="", flush=True)
    print_tokens.seen = seen   # what it has printed, for a caller that must finish the text
    return print_tokens


def drafter_kind(drafter) -> str:
    """What drafted, in the stats: DFlash2 (its convolutions and selector), Laguna DFlash, DFlash, or none."""
    if drafter is None:
        return "none (the target alone)"
    cfg = drafter.config
    if drafter.candidate_selector is not None:
        return f"DFlash2 (convolutions of {cfg.conv_kernel_size} taps, selector over {cfg.selector_top_k} candidates)"
    return "Laguna DFlash" if cfg.gated else "DFlash"


def stats_table(gen, seconds: float, drafter: str | None = None) -> str:
    """A generation's drafter, tokens, rounds, τ, speed and acceptance per draft position, as the CLI prints them."""
    rates = [f"{a / d:.2f}" if d else "-" for a, d in zip(gen.position_accepted, gen.position_drafted)]
    rows = [("drafter", drafter)] if drafter else []
    rows += [("tokens", len(gen.tokens)), ("rounds", len(gen.rounds)), ("tau", "-" if gen.tau is None else f"{gen.tau:.2f}"),
            ("tokens/s", f"{len(gen.tokens) / seconds:.1f}")] + ([("accept@pos", " ".join(rates))] if rates else [])
    if getattr(gen, "interrupted", False):
        rows.append(("interrupted", "by Ctrl-C; the figures above cover the tokens before it"))
    return "\n".join(f"{name:>11}  {value}" for name, value in rows)

# -----------------------------------------------------------------------------
# python dflash.py / python fastpath.py


REFERENCE = "DFlash speculative decoding through dflash.py, the readable reference (lossless: greedy or sampled)."
FAST = ("DFlash speculative decoding through fastpath.py, the fast twin of dflash.py: the same tokens from static "
        "buffers and fused weights, its steps captured as CUDA graphs on CUDA (lossless: greedy or sampled).")


def parse_args(argv=None, description: str = REFERENCE):
    p = scripts.parser(description)
    scripts.add_pair_flags(p)
    p.add_argument("--prompt", default="Write a short poem about the sea.", help="prompt text")
    p.add_argument("--prompt-ids", help="comma-separated token ids, instead of --prompt")
    p.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--num-drafts", type=int, help=f"drafts K per step (default block_size - 1; on CPU at most "
                   f"{scripts.CPU_NUM_DRAFTS}, where a wider verify costs more than it gains)")
    p.add_argument("--compute-width", choices=["block", "drafts"], default="block", help="drafter rows: B or K+1")
    p.add_argument("--target-only", action="store_true", help="decode with the target alone, same loop")
    scripts.add_sampling_flags(p, "seed of the sampling uniforms, for reproducible runs (default: a fresh seed each run)")
    scripts.add_device_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON line instead of text and stats")
    return p.parse_args(argv)


def main(argv=None, generate_fn=None, description: str = REFERENCE):
    """The CLI; `generate_fn` swaps in another implementation with generate's signature. Every request check
    that needs only the configs runs before the weights load; Ctrl-C prints the stats so far (with --json,
    the JSON so far, from before the first token on), exit code 130."""
    args = parse_args(argv, description)
    device, dtype = scripts.device_and_dtype(args.device, args.dtype)
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.drafts)
    scripts.require_seed(args.seed)
    require(args.target is None or args.draft is not None or args.target_only,
            f"--target = {args.target!r} needs --draft (or --target-only)")
    ids = None if args.prompt_ids is None else [t.strip() for t in args.prompt_ids.split(",") if t.strip()]
    require(all(t.lstrip("-").isdigit() for t in ids or []),
            f"--prompt-ids = {args.prompt_ids!r} must be comma-separated integers")
    scripts.quiet_transformers()
    gen, printer_fn, tokenizer, t0, kind = Generation(tokens=[]), None, None, time.perf_counter(), None
    try:
        target_path, draft_path = loading.pair_paths(args.target, args.draft)
        tcfg = loading.target_config(str(target_path))
        draft_dir = None if args.target_only else loading.checkpoint_dir(str(draft_path), "--draft")
        block_size = None if args.target_only else \
            loading.config_block_size(loading.read_file(draft_dir / "config.json", "draft config"))
        tokenizer = loading.load_tokenizer(str(target_path))
        require(ids is not None or tokenizer is not None, f"--target '{target_path}' has no tokenizer: pass --prompt-ids")
        prompt_ids = [int(t) for t in ids] if ids is not None else loading.encode_prompt(tokenizer, args.prompt, not args.no_chat)
        K = 0 if block_size is None else args.num_drafts if args.num_drafts is not None else \
            scripts.default_num_drafts(block_size, device)
        check_request(prompt_ids, args.max_new_tokens, K, vocab_rows=tcfg.vocab_size,
                      max_positions=tcfg.max_position_embeddings, block_size=block_size)

        target = loading.load_target(str(target_path), dtype, device)
        drafter = None if args.target_only else loading.load_drafter(str(draft_dir), target, dtype, device)
        kind = drafter_kind(drafter)
        t0, generate_fn = time.perf_counter(), generate_fn or generate
        printer_fn = None if args.json else printer(tokenizer)
        gen = generate_fn(target, drafter, prompt_ids, args.max_new_tokens, num_drafts=K or None,
                          full_block=args.compute_width == "block", stop_ids=loading.stop_token_ids(target, tokenizer),
                          on_tokens=printer_fn, sampling=sampling, seed=args.seed)
    except Interrupted as stop:
        gen = stop.generation
    except KeyboardInterrupt:   # before generate's first round (loading, prefill): nothing was committed
        gen.interrupted = True
    if printer_fn is not None:   # tokens committed after the last print
        printer_fn(gen.tokens[len(printer_fn.seen):])
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if args.json:
        text = tokenizer.decode(gen.tokens, skip_special_tokens=True) if tokenizer is not None else None
        print(json.dumps({"tokens": gen.tokens, "text": text, "acceptance_lengths": gen.acceptance_lengths,
                          "tau": gen.tau, "rounds": gen.rounds, "drafter": kind, "interrupted": gen.interrupted}))
    elif printer_fn is not None or not gen.interrupted:
        print("\n" + stats_table(gen, seconds, kind))
    if gen.interrupted:
        if printer_fn is None and not args.json:
            print("\ninterrupted", file=sys.stderr)
        raise SystemExit(130)


def reference():
    """`dflash-demo` and `python dflash.py`: the demo through dflash.py, the reference."""
    scripts.run(main)


def fast():
    """`dflash-fast` and `python fastpath.py`: the demo through fastpath.py, the fast twin."""
    import fastpath
    scripts.run(main, generate_fn=fastpath.generate, description=FAST)


if __name__ == "__main__":   # run by dflash.py or fastpath.py, which name themselves as DECODER
    fast() if globals().get("DECODER") == "fastpath" else reference()
