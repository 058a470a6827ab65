"""Reading and checking DFlash checkpoints: every released drafter format resolved into one DraftConfig.

dflash.py holds the math; this file settles, once at load, everything a checkpoint can say about it: which
of the three released layouts it is (spec §6: z-lab, newer z-lab, Laguna), each config key read from
`dflash_config` first and then the top level, causality as vLLM reads it, and the checks that refuse a
checkpoint whose extra keys would be silently ignored. z-lab's separate q/k/v_proj are stacked into one
`qkv_proj` as they are read, so the modules never ask which format they came from; saving maps them back.
Every refusal is one `DFlashError` whose message names the field and its value.
"""
import json
import re
from pathlib import Path

import huggingface_hub
import safetensors.torch
import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM

from dflash import DFlashError, Drafter, DraftConfig, default_layer_ids, require
from files import replace_files


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


# Checkpoints a same-position DFlash reader would load wrong, silently: each is refused, naming why (spec §6).
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
    """A drafter config key from `dflash_config` first, then the top level (spec §6); a null in
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
    """A DFlash2 drafter (convolutions and a candidate selector, spec §9): its architecture, or any of its four
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

    refuse_unsupported(raw, nested)
    H, L, heads = int(key("hidden_size")), int(key("num_hidden_layers")), int(key("num_attention_heads"))
    for per_layer in ("num_attention_heads_per_layer", "num_key_value_heads_per_layer"):
        counts = key(per_layer, None)
        require(counts is None or len(set(counts)) <= 1, f"draft config: '{per_layer}' = {counts} differ per "
                "layer; a DFlash drafter needs one head count for every layer")
    laguna = is_laguna(raw)   # spec §6: no new flag
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
    head_dim = int(key("head_dim", None) or H // heads)
    v_head_dim = key("v_head_dim", head_dim)
    require(v_head_dim == head_dim, f"draft config: 'v_head_dim' = {v_head_dim} != head_dim {head_dim} is "
            "not supported")
    return DraftConfig(
        hidden_size=H, intermediate_size=int(key("intermediate_size")), num_layers=L, num_heads=heads,
        num_kv_heads=int(key("num_key_value_heads")), head_dim=head_dim,
        rms_norm_eps=float(key("rms_norm_eps")), block_size=config_block_size(raw),
        mask_token_id=int(key("mask_token_id")), target_layer_ids=[int(i) for i in layer_ids],
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
    require(looks_like_repo_id(path), f"{flag} '{path}': no such directory")
    try:
        return Path(huggingface_hub.snapshot_download(path))
    except Exception as err:   # any hub failure becomes one line naming the path
        raise DFlashError(f"{flag} '{path}': not a local directory, and the hub could not provide it "
                          f"({type(err).__name__})") from None


def load_drafter(path: str, target: nn.Module, dtype: torch.dtype, device: str) -> Drafter:
    """Load a drafter checkpoint (any of the three formats of spec §6): a local dir, or a hub id fetched."""
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
    have (spec §4: the target's cache must be cropped to the accepted length)."""
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
