"""Shared by every test: tiny checkpoints in the released formats (conformance/cases.py), loaded once per session, and the
helpers the tests compare with. Targets run in float64 with a peaked LM head so that no near-tie can make the
oracle ambiguous. GPU tests are marked `gpu` and skip without CUDA; tests of the PyPI data packages are
marked `package`.
"""
import json
import os
import subprocess
import sys
from contextlib import closing
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings, strategies as st
from safetensors.torch import save_file
from transformers import DynamicCache

import dflash
import fastpath
from dflash import DraftContext
from dflash_reference import loading
from dflash_reference.conformance import cases
from dflash_reference.training import distill, train

HERE = Path(__file__).parent
VOCAB, MAX_POS = 96, 256
H, T_LAYERS = cases.H, cases.T_LAYERS
FAMILIES = ["qwen3", "llama", "laguna"]
FORMATS = ["zlab", "zlab-new", "laguna", "dflash2"]
settings.register_profile("default", deadline=None, max_examples=25,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile("default")
torch.set_num_threads(1)   # tiny models: threads only add synchronisation overhead


def target_config(family: str, **extra):
    """A tiny target's transformers config (cases.target_config's keys)."""
    from transformers import AutoConfig
    raw = cases.target_config(family, VOCAB, MAX_POS, **extra)
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def write_target(directory: Path, family: str, **extra) -> Path:
    return cases.write_target(directory, family, 1, VOCAB, MAX_POS, **extra)


def drafter_shapes(fmt: str, num_layers: int, n: int, hidden=H, heads=4, kv_heads=2, head_dim=8, inter=48):
    """Tensor names and shapes of each released format (docs/checkpoints.md), as conformance/cases.py writes them out apart from
    loading.py."""
    raw = {"architectures": ["DFlashLagunaForCausalLM" if fmt == "laguna" else "DFlashDraftModel"],
           "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": head_dim, "intermediate_size": inter, "num_hidden_layers": num_layers}
    return cases.drafter_tensor_shapes(raw, n)


def drafter_config(fmt: str, block_size: int, layer_ids, num_layers=2, window=4, hidden=H, head_dim=8) -> dict:
    """cases.drafter_config with this suite's vocabulary; a Laguna one as released: mask id 12, and the
    eagle_aux_hidden_state_layer_ids a loader must not read as the captured layers."""
    raw = cases.drafter_config(fmt, block_size, layer_ids, VOCAB, num_layers, window, hidden, head_dim,
                              mask_token_id=12 if fmt == "laguna" else None)
    if fmt == "laguna":
        raw["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in layer_ids]
    return raw


def write_drafter(directory: Path, fmt: str, block_size=4, layer_ids=(1, 3), num_layers=2, window=4,
                  hidden=H, seed=0, sharded=False, head_dim=8) -> Path:
    raw = drafter_config(fmt, block_size, layer_ids, num_layers, window, hidden, head_dim)
    return cases.write_drafter(directory, raw, seed, len(layer_ids), sharded)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {family: write_target(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def targets(checkpoints):
    return {family: loading.load_target(str(path), torch.float64, "cpu") for family, path in checkpoints.items()}


@pytest.fixture(scope="session")
def targets32(checkpoints):
    return {family: loading.load_target(str(path), torch.float32, "cpu") for family, path in checkpoints.items()}


@pytest.fixture(scope="session")
def drafters(targets, targets32, tmp_path_factory):
    """Loaded drafters by (family, format, block size[, dtype]), written to disk and read back."""
    root, cache = tmp_path_factory.mktemp("drafters"), {}

    def get(family, fmt, block_size, dtype=torch.float64):
        key = (family, fmt, block_size, dtype)
        if key not in cache:
            path = write_drafter(root / f"{family}-{fmt}-{block_size}", fmt, block_size,
                                 layer_ids=(1, 3, 4) if fmt == "laguna" else (1, 3), sharded=fmt == "zlab-new")
            target = (targets if dtype == torch.float64 else targets32)[family]
            cache[key] = loading.load_drafter(str(path), target, dtype, "cpu")
        return cache[key]
    return get


def hf_greedy(target, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_same_tokens(got, want):
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert got == want, f"token streams differ at index {first}: {got[first:first + 5]} vs {want[first:first + 5]}"


def forward_with_capture(target, ids, layer_ids):
    """dflash.target_forward from position 0 with a fresh cache and capture: logits (N, V), features (N, n·H)."""
    with closing(dflash.Capture(target, layer_ids)) as capture:
        return dflash.target_forward(target, ids, 0, DynamicCache(), capture)


def context_of(drafter, c):
    """A drafter context holding rows c (S, H) at positions 0..S-1, through dflash.append_context."""
    ctx = DraftContext.empty(drafter, c.device)
    dflash.append_context(drafter, ctx, c)
    return ctx


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)



def laguna(drafters, block_size=4):
    return drafters("qwen3", "laguna", block_size)


def edit_config(path: Path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def drop_tensors(path: Path, prefix: str, add=None):
    from safetensors.torch import load_file
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if prefix not in k}
    save_file({**tensors, **(add or {})}, path / "model.safetensors")




COMMANDS = {"dflash-train": "dflash_reference.training.train", "dflash-eval": "dflash_reference.evaluation",
            "dflash-conformance": "dflash_reference.conformance.checker"}   # installed commands: their modules


def command_line(script: str) -> list[str]:
    """How a user runs `script`: dflash.py, fastpath.py or a benchmark from the clone, or an installed command."""
    return [sys.executable, "-m", COMMANDS[script]] if script in COMMANDS else [sys.executable, str(HERE / script)]


def run_cli(*args, script="dflash.py"):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*command_line(script), *args], capture_output=True, text=True, env=env)


def spec_args(target, draft, *extra):
    return ["--target", str(target), "--draft", str(draft), "--prompt-ids", "1,2", "--max-new-tokens", "4",
            "--device", "cpu", "--dtype", "float32", *extra]



def helped(real_propose, reference, prompt_len, start_of, seed):
    """Wrap a real `propose`: the first r drafts of each block are overwritten with the truth (r drawn
    per position from `seed`), so rounds accept partially and later drafts still come from the
    drafter's own context. `start_of(state)` reads the bonus position from either file's state."""
    import random

    def propose(drafter, state, block, target, count, *sampling):
        drafts, q = real_propose(drafter, state, block, target, count, *sampling)
        drafts, start = drafts.clone(), int(start_of(state))
        r = random.Random(seed * 100003 + start).randint(0, len(block) - 1)   # by the block: both files' width
        for i in range(min(r, len(drafts))):
            if start + 1 + i - prompt_len < len(reference):
                drafts[i] = reference[start + 1 + i - prompt_len]
        return drafts, q
    return propose


def run_both(target, drafter, prompt, max_new, help_seed, capacity=None, **kwargs):
    reference = hf_greedy(target, prompt, max_new + 8)
    with mock.patch.object(dflash, "propose", helped(dflash.propose, reference, len(prompt),
                                                     lambda ctx: ctx.length, help_seed)):
        ref = dflash.generate(target, drafter, prompt, max_new, **kwargs)
    with mock.patch.object(fastpath, "propose", helped(fastpath.propose, reference, len(prompt),
                                                       lambda buf: buf.start, help_seed)):
        fast = fastpath.generate(target, drafter, prompt, max_new, capacity=capacity, **kwargs)
    return ref, fast, reference


def assert_same_generation(fast, ref):
    assert_same_tokens(fast.tokens, ref.tokens)
    assert fast.acceptance_lengths == ref.acceptance_lengths
    assert fast.rounds == ref.rounds
    assert fast.position_accepted == ref.position_accepted


def targets32_for(drafter):
    """A minimal stand-in target for Decoder construction: only embeddings and config are used."""
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM(target_config("qwen3"))



MASK = VOCAB - 1



@pytest.fixture(scope="module")
def llama_data(tmp_path_factory):
    """A tiny float32 Llama target on disk and loaded, with its greedy answers to 24 random prompts."""
    path = write_target(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    target = loading.load_target(str(path), torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 9, (24,), generator=g)]
    return path, target, distill.distill_ids(target, prompts, 20, pad_id=0)


def fresh_drafter(target, block_size=4, num_layers=1, num_features=3, seed=0):
    torch.manual_seed(seed)
    raw = train.new_drafter_config(target, num_layers, block_size, MASK, num_features)
    return raw, train.new_drafter(target, raw)


def head_chunk_cases(device, dtype, rows, vocab, soft=False):
    """Logits (rows, vocab) in `dtype`, labels (with `soft`, the teacher's logits) and row weights, and
    the float64 chunk loss (cross-entropy, or KL to the teacher) and its gradient."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(device, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g).to(device)
    w = torch.rand(rows, generator=g).to(device)
    teacher_logits = (3 * torch.randn(rows, vocab, generator=g)).to(device, dtype)   # last: CE cases as before
    exact = logits.double().requires_grad_(True)
    if soft:
        per_row = F.kl_div(exact.log_softmax(-1), teacher_logits.double().log_softmax(-1), log_target=True,
                           reduction="none").sum(-1)                                  # (rows,)
    else:
        per_row = F.cross_entropy(exact, labels, reduction="none")                    # (rows,)
    want = (w.double() * per_row).sum()
    (want_grad,) = torch.autograd.grad(want, exact)
    return logits, teacher_logits if soft else labels, w, want.detach(), want_grad


def run_train_cli(*args):
    return subprocess.run([*command_line("dflash-train"), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def catalog_paths(checkpoints, llama_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("catalog")
    _, _, sequences = llama_data
    distill.save_sequences(root / "data.pt", sequences, {"prompt_indices": list(range(len(sequences)))})
    return {"t": str(checkpoints["qwen3"]), "d": str(write_drafter(root / "good", "zlab")), "l": str(llama_data[0]),
            "data": str(root / "data.pt")}
