"""Tiny random checkpoints in the exact released formats (spec §6): what the tests and the conformance kit run on.

No released DFlash drafter or big target is downloaded anywhere in this project: a test or a kit case
writes a target (Qwen3, Llama or Laguna, 6 layers, H 32) and a drafter (z-lab, newer z-lab or Laguna)
with these functions and loads them as any released pair is loaded. Weights come from seeded draws, so a
file is byte-identical wherever torch's CPU generator is: norms near 1, matrices with unit-variance
outputs, the target's LM head `head_scale` times that (so its argmaxes are clear). Tensor names are
written out here from the spec, apart from checkpoint.py, so that the loader is checked against them.

Config files hold only the keys that matter, so that they do not change with the transformers version
(its defaults fill the rest at load).
"""
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

H, T_LAYERS = 32, 6            # hidden size and target layers of every tiny pair
FORMATS = ["zlab", "zlab-new", "laguna", "dflash2"]
DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}   # at H 32


# -----------------------------------------------------------------------------
# Targets

def target_config(family: str, vocab: int, max_pos: int, **extra) -> dict:
    """config.json of a tiny Qwen3, Llama or Laguna target (the Laguna one: hybrid sliding/full layers with
    a window of 5, per-layer head counts, MoE layers). `extra` adds or overrides keys."""
    common = dict(vocab_size=vocab, hidden_size=H, intermediate_size=64, num_hidden_layers=T_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=max_pos,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if family in ("qwen3", "llama"):
        return {"model_type": family, "architectures": [{"qwen3": "Qwen3", "llama": "Llama"}[family] + "ForCausalLM"],
                **common, **extra}
    return {"model_type": "laguna", "architectures": ["LagunaForCausalLM"], **common, "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention"] * 3, "num_attention_heads_per_layer": [4, 2] * 3,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, **extra}


def seeded(shape, name: str, generator, head_scale: float = 4.0) -> torch.Tensor:
    """Norms near 1, matrices with unit-variance outputs; the target's LM head head_scale times that; a
    DFlash2 convolution's base taps near the identity (tap 0 near 1, the others near 0)."""
    if len(shape) == 1:
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    if name.endswith("base_kernel"):   # (2, C, H)
        identity = torch.zeros(shape)
        identity[:, 0] = 1.0
        return identity + 0.1 * torch.randn(shape, generator=generator)
    scale = head_scale if name == "lm_head.weight" else 1.0
    return torch.randn(shape, generator=generator) * scale / shape[-1] ** 0.5


def write_target(directory: Path, family: str, seed: int, vocab: int, max_pos: int, head_scale: float = 4.0,
                 **extra) -> Path:
    """A tiny target: config.json and model.safetensors, each tensor drawn in name order."""
    from transformers import AutoConfig, AutoModelForCausalLM
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(target_config(family, vocab, max_pos, **extra), indent=1,
                                                      sort_keys=True))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    g = torch.Generator().manual_seed(seed)
    tensors = {name: seeded(t.shape, name, g, head_scale) if t.is_floating_point() else t.clone()
               for name, t in sorted(model.state_dict().items())}
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


# -----------------------------------------------------------------------------
# Drafters

def drafter_config(fmt: str, block_size: int, layer_ids, vocab: int, num_layers: int = 2, window: int = 4,
                   hidden: int = H, head_dim: int = 8, mask_token_id: int | None = None, causal: bool | None = None,
                   rope_by_type: dict | None = None) -> dict:
    """config.json of a drafter in a released layout: "zlab" (Qwen3-8B-DFlash-b16: top-level block_size and
    rope_theta, full layers), "zlab-new" (the Qwen3.5-era layout: block_size in dflash_config,
    rope_parameters, sliding and full layers alternating, window `window`) or "laguna" (Laguna-XS DFlash:
    every layer causal and sliding). layer_ids None leaves target_layer_ids out (the default ids); the
    mask id defaults to the last vocabulary row; causal sets dflash_config.causal (zlab-new); rope_by_type
    gives one RoPE base per layer type (zlab-new). "dflash2" is z-lab's DFlash2DraftModel layout (spec §9):
    every layer sliding and bidirectional (top-level is_causal false), the convolution and selector sizes in
    dflash_config."""
    arch = dict(hidden_size=hidden, intermediate_size=48, num_hidden_layers=num_layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-6, vocab_size=vocab)
    nested = {"mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id}
    if layer_ids is not None:
        nested["target_layer_ids"] = list(layer_ids)
    if fmt == "zlab":
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **arch, "block_size": block_size,
                "rope_theta": 1000000.0, "num_target_layers": T_LAYERS, "layer_types": ["full_attention"] * num_layers,
                "dflash_config": nested}
    if fmt == "zlab-new":
        rope = {"rope_type": "default", "rope_theta": 10000000.0}
        if rope_by_type is not None:
            rope = {kind: {"rope_type": "default", "rope_theta": theta} for kind, theta in rope_by_type.items()}
        override = {} if causal is None else {"causal": causal}
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **arch, "rope_parameters": rope,
                "layer_types": ["sliding_attention", "full_attention"] * (num_layers // 2) +
                               ["sliding_attention"] * (num_layers % 2),
                "sliding_window": window, "dflash_config": {"block_size": block_size, **override, **nested}}
    if fmt == "dflash2":
        return {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", **arch, "is_causal": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0}, "num_target_layers": T_LAYERS,
                "layer_types": ["sliding_attention"] * num_layers, "sliding_window": window, "use_sliding_window": True,
                "dflash_config": {"block_size": block_size, **DFLASH2, **nested}}
    assert fmt == "laguna", fmt
    return {"architectures": ["DFlashLagunaForCausalLM"], "model_type": "laguna", **arch, "gating": "per-head",
            "layer_types": ["sliding_attention"] * num_layers, "sliding_window": window,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "dflash_config": {"block_size": block_size, "num_target_layers": T_LAYERS, "causal": True, **nested}}


def drafter_tensor_shapes(raw: dict, n: int) -> dict[str, tuple]:
    """The tensor names and shapes of a drafter checkpoint with n captured layers, as released (spec §6):
    fc, hidden_norm and norm, and per layer the two norms, attention (q/k/v_proj apart in a z-lab file; one
    fused qkv_proj and the gate g_proj in a Laguna file), q/k norms and the SwiGLU MLP; Laguna adds one
    aux_hidden_norms.{i} per captured layer; DFlash2 adds per layer the two convolutions' base_kernel (2, C, H)
    and kernel_projection (2·C·G, H), and the candidate selector's hidden_projection (r, H) and its two
    codebooks (V, r), stored without a `.weight` suffix."""
    laguna = any("Laguna" in arch for arch in raw["architectures"])
    dflash2 = "DFlash2DraftModel" in raw["architectures"]
    H, heads, kv_heads, d = raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    inter = raw["intermediate_size"]
    shapes = {"fc.weight": (H, n * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for l in range(raw["num_hidden_layers"]):
        p = f"layers.{l}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if laguna:
            shapes[p + "self_attn.qkv_proj.weight"] = ((heads + 2 * kv_heads) * d, H)
            shapes[p + "self_attn.g_proj.weight"] = (heads, H)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (heads * d, H)
            shapes[p + "self_attn.k_proj.weight"] = (kv_heads * d, H)
            shapes[p + "self_attn.v_proj.weight"] = (kv_heads * d, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, heads * d)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, H)
        shapes[p + "mlp.up_proj.weight"] = (inter, H)
        shapes[p + "mlp.down_proj.weight"] = (H, inter)
        if dflash2:
            sizes = raw["dflash_config"]
            C, G = sizes["conv_kernel_size"], H // sizes["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                shapes[p + conv + ".base_kernel"] = (2, C, H)
                shapes[p + conv + ".kernel_projection.weight"] = (2 * C * G, H)
    if laguna:
        for i in range(n):
            shapes[f"aux_hidden_norms.{i}.weight"] = (H,)
    if dflash2:
        r, V = raw["dflash_config"]["selector_rank"], raw["vocab_size"]
        shapes["candidate_selector.hidden_projection.weight"] = (r, H)
        shapes["candidate_selector.predecessor_codebook"] = (V, r)
        shapes["candidate_selector.successor_codebook"] = (V, r)
    return shapes


def write_drafter(directory: Path, raw: dict, seed: int, n: int, sharded: bool = False) -> Path:
    """A drafter with n captured layers: config.json and model.safetensors (or two shards and their index),
    each tensor drawn in name order."""
    directory = Path(directory)
    g = torch.Generator().manual_seed(seed)
    tensors = {name: seeded(shape, name, g) for name, shape in sorted(drafter_tensor_shapes(raw, n).items())}
    directory.mkdir(parents=True, exist_ok=True)
    if sharded:
        names = sorted(tensors)
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, part in halves.items():
            save_file({k: tensors[k] for k in part}, directory / file, metadata={"format": "pt"})
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: f for f, part in halves.items() for k in part}}))
    else:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(raw, indent=1, sort_keys=True))
    return directory
