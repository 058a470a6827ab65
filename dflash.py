"""DFlash speculative decoding: the readable reference.

A block drafter, conditioned on hidden states captured from the target, proposes a whole block in one
forward pass; the target verifies it in one pass and keeps the longest prefix that matches its own choice,
so greedy output is token-identical to the target's greedy decode. This is the clean reference: plain
PyTorch, one generate loop, deliberately simple, not fast (`fastpath.py` is the same math, fast). The math
comes first, in the order a step runs it; loading, validation and transformers glue follow, then the CLI.

    $ python dflash.py        # SmolLM2-135M-Instruct with the drafter shipped in drafter/
    $ python dflash.py --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --prompt "Hi"

Shapes: P prompt, S context (tokens the drafter has seen), B block, K drafts per step, W rows of a
draft block (B, or K+1), N any count of rows or positions, H hidden, n captured target layers, V vocab,
h/hk query/key heads, d head_dim; `...` is any leading batch shape (none when decoding, sequences when
training).
"""
import argparse
import functools
import inspect
import json
import re
import sys
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import huggingface_hub
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from transformers import AutoModelForCausalLM, DynamicCache

import offline


class DFlashError(ValueError):
    """Bad input: a checkpoint, config or request that cannot be run. Names the field and value."""


def require(ok: bool, message: str):
    if not ok:   # fail early, with a message that names the field and its value
        raise DFlashError(message)


def require_seed(seed):
    """--seed within what a torch Generator takes, with room for the seed + i a run derives from it."""
    require(seed is None or 0 <= seed < 2 ** 63, f"--seed = {seed} must be in 0..2^63-1")


# -----------------------------------------------------------------------------
# Drafter config: every checkpoint format resolved at load into one description (spec §6)
@dataclass
class DraftConfig:
    hidden_size: int                 # H, must equal the target's
    intermediate_size: int           # SwiGLU width
    num_layers: int                  # L drafter layers
    num_heads: int                   # h query heads (the same in every layer)
    num_kv_heads: int                # hk key/value heads (GQA)
    head_dim: int                    # d, from config or H / h
    rms_norm_eps: float
    block_size: int                  # B
    mask_token_id: int               # m, a row of the target's embedding table
    target_layer_ids: list[int]      # 0-based target layers whose outputs are captured
    rope_thetas: list[float]         # per layer: RoPE base
    causal: list[bool]               # per layer: a block row sees only keys at or before its position
    windows: list[int | None]        # per layer: keys < this far from the query (none after it if causal); None: all
    gated: bool = False              # per-head softplus gate g_proj before o_proj (Laguna)
    capture_norms: bool = False      # an RMSNorm per captured layer before fc (Laguna's aux_hidden_norms)
    norm_context: bool = False       # each layer's input norm applied to the context before k/v (Laguna)
    checkpoint_format: str = "zlab"  # tensor names on disk: "zlab" (q/k/v_proj) or "laguna" (qkv_proj)


def default_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """Spread n captured layers evenly from layer 1 to layer T-3 (spec §1); one layer sits at T // 2."""
    T = num_target_layers
    return [T // 2] if n == 1 else [round(1 + i * (T - 4) / (n - 1)) for i in range(n)]


# -----------------------------------------------------------------------------
# Drafter modules: a Qwen3-style pre-norm decoder with no embeddings and no LM head
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))   # at least fp32 inside the norm
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_table(positions, theta: float, d: int, dtype):
    """RoPE's cos and sin at positions (..., N), (..., N, 1, d) each, from float64 angles, exact at any
    position. HF's rotary embeddings (z-lab's drafters) and the engines take fp32 angles: their cos and
    sin differ from these by up to about 3e-4 at position 4k and 3e-3 at 40k, a difference a port compared
    in fp32 at long context sees."""
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float64) / d)  # (d/2,)
    angles = positions.double()[..., None] * inv_freq                                   # (..., N, d/2)
    angles = torch.cat([angles, angles], -1)[..., None, :]                              # (..., N, 1, d)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope(x, table):
    """Rotate-half RoPE of x (..., N, heads, d) by the rope_table of its positions."""
    (cos, sin), d = table, x.shape[-1]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1) * sin


def gate(logits, o):
    """Laguna's per-head output gate: o (..., W, h, d) times softplus(logits (..., W, h)), in ≥ fp32."""
    return o * F.softplus(logits.to(torch.promote_types(logits.dtype, torch.float32))).to(o.dtype)[..., None]


def attend(q, keys, values, mask):
    """Scaled dot-product attention of queries q (..., h, W, d) over keys, values (..., hk, S+W, d): the
    context's and the rows' own, each K/V head serving h/hk query heads -> (..., h, W, d). mask: (..., W, S+W)
    bool, the keys each row sees, or None for all; or a PackedMask of the same rule (training's packed
    forward on CUDA, after generate below)."""
    if isinstance(mask, PackedMask):
        return attend_packed(q, keys, values, mask)
    # Each K/V head repeated for its query heads. SDPA's own enable_gqa runs only its math kernel under a
    # mask, which on CUDA upcasts to fp32 and writes out the scores; repeated, a masked call can take
    # memory-efficient attention
    g = q.shape[-3] // keys.shape[-3]
    keys, values = keys.repeat_interleave(g, -3), values.repeat_interleave(g, -3)      # (..., h, S, d)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class DraftAttention(nn.Module):
    """KV injection: block rows attend to the context's keys and values and their own, all from one qkv_proj."""

    def __init__(self, cfg: DraftConfig, layer: int):
        super().__init__()
        H, h, hk, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_kv_heads, self.head_dim, self.rope_theta = hk, d, cfg.rope_thetas[layer]
        self.qkv_proj = nn.Linear(H, (h + 2 * hk) * d, bias=False)
        self.heads, self.kv_rows = [h, hk, hk], slice(h * d, (h + 2 * hk) * d)   # qkv_proj's heads; its k/v rows
        self.g_proj = nn.Linear(H, h, bias=False) if cfg.gated else None
        self.o_proj = nn.Linear(h * d, H, bias=False)
        self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, kv, table):
        """k/v rows (..., N, 2·hk·d), their rope table -> keys (k_norm, RoPE), values (..., hk, N, d)."""
        k, v = kv.unflatten(-1, (2, self.num_kv_heads, self.head_dim)).unbind(-3)      # (..., N, hk, d)
        return rope(self.k_norm(k), table).transpose(-3, -2), v.transpose(-3, -2)

    def forward(self, u, table, context, mask):
        """Rows u (..., W, H) with their rope table, context (keys, values) (..., hk, S, d) -> (..., W, H)."""
        q, k, v = self.qkv_proj(u).unflatten(-1, (-1, self.head_dim)).split(self.heads, -2)   # (..., W, h|hk, d)
        q, k = rope(self.q_norm(q), table), rope(self.k_norm(k), table)
        keys = torch.cat([context[0], k.transpose(-3, -2)], -2)                        # (..., hk, S+W, d)
        values = torch.cat([context[1], v.transpose(-3, -2)], -2)                      # (..., hk, S+W, d)
        o = attend(q.transpose(-3, -2), keys, values, mask).transpose(-3, -2)          # (..., W, h, d)
        return self.o_proj((o if self.g_proj is None else gate(self.g_proj(u), o)).flatten(-2))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """One pre-norm decoder layer over the block, the context injected as extra keys and values."""

    def __init__(self, cfg: DraftConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)
        # Laguna normalises the context with this layer's own input norm before k/v; z-lab does not (spec §3).
        self.context_norm = self.input_layernorm if cfg.norm_context else nn.Identity()
        self.causal, self.window = cfg.causal[layer], cfg.windows[layer]   # this layer's mask rule

    def context_kv(self, c, tables):
        """KV injection: context rows c (..., S, H), their rope tables -> keys, values (..., hk, S, d)."""
        attn = self.self_attn
        kv = F.linear(self.context_norm(c), attn.qkv_proj.weight[attn.kv_rows])       # (..., S, 2·hk·d)
        return attn.keys_values(kv, tables[attn.rope_theta])

    def forward(self, x, tables, context, mask):
        x = x + self.self_attn(self.input_layernorm(x), tables[self.self_attn.rope_theta], context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """No embeddings, no LM head: the target's serve. Parameter names are the checkpoint's, except that
    z-lab's q_proj/k_proj/v_proj are one qkv_proj, fused at load (checkpoint_tensors maps them back)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config, n, H, eps = cfg, len(cfg.target_layer_ids), cfg.hidden_size, cfg.rms_norm_eps
        # Laguna normalises each captured layer on its own before fc (spec §2); z-lab does not.
        self.aux_hidden_norms = nn.ModuleList(RMSNorm(H, eps) for _ in range(n)) if cfg.capture_norms else None
        self.fc, self.hidden_norm = nn.Linear(n * H, H, bias=False), RMSNorm(H, eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, l) for l in range(cfg.num_layers))
        self.norm = RMSNorm(H, eps)

    def project_context(self, features):
        """Captured features (..., S, n·H) -> context c (..., S, H), the same for every layer."""
        if self.aux_hidden_norms is not None:
            chunks = features.chunk(len(self.aux_hidden_norms), dim=-1)                 # n × (..., S, H)
            features = torch.cat([norm(f) for norm, f in zip(self.aux_hidden_norms, chunks)], -1)
        return self.hidden_norm(self.fc(features))

    def rope_tables(self, positions, dtype) -> dict:
        """A rope_table at positions (..., N) for each RoPE base the layers use."""
        return {t: rope_table(positions, t, self.config.head_dim, dtype) for t in set(self.config.rope_thetas)}

    def forward(self, x, tables, context, masks):
        """Block embeddings x (..., W, H) with the rope_tables of their positions, each layer's context and
        mask -> (..., W, H). The caller makes the tables: made inside a compiled forward, inductor would
        recompute their float64 cos, sin and pow in every kernel that reads them, for every element of
        q and k, forward and backward."""
        for layer, layer_context, mask in zip(self.layers, context, masks):
            x = layer(x, tables, layer_context, mask)
        return self.norm(x)


# -----------------------------------------------------------------------------
# Target capture: layer outputs taken during the target's own forward
class Capture:
    """Hooks on the captured target layers until close(): each forward leaves the residual stream leaving
    layer i (un-normed, before the final norm) in outputs[i]: HF's hidden_states[i + 1], except for the
    last layer, whose hidden_states entry HF takes after the final norm."""

    def __init__(self, target, layer_ids: list[int]):
        self.layer_ids, self.outputs, layers = list(layer_ids), {}, decoder_layers(target)
        self.hooks = [layers[i].register_forward_hook(functools.partial(self.store, i)) for i in self.layer_ids]

    def store(self, i, module, args, out):
        self.outputs[i] = out[0] if isinstance(out, tuple) else out

    def features(self):
        """(..., N, n·H): the last forward's captured layers side by side, in ascending id order."""
        return torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1) if self.layer_ids else None

    def close(self):
        for hook in self.hooks:
            hook.remove()


def target_forward(target, ids, start: int, cache, capture: Capture):
    """The target on ids (N,) at positions start.., appending to its cache -> logits (N, V), features (N, n·H)."""
    positions = torch.arange(start, start + len(ids), device=ids.device)[None]          # (1, N)
    with sdpa_kernel(TARGET_ATTENTION):
        out = target(input_ids=ids[None], position_ids=positions, use_cache=True, **{cache_kwarg(type(target)): cache})
    return out.logits[0], capture.features()[0] if capture.layer_ids else None         # (N, V), (N, n·H)


# -----------------------------------------------------------------------------
# Drafter block: cache the context's K/V, decode one block
@dataclass
class DraftContext:
    """Per drafter layer, context keys (after k_norm and RoPE) and values: (hk, S, d) each."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.keys[0].shape[1]

    @staticmethod
    def empty(drafter: Drafter, device) -> "DraftContext":
        cfg, dtype = drafter.config, drafter.fc.weight.dtype
        empty = lambda: torch.empty(cfg.num_kv_heads, 0, cfg.head_dim, dtype=dtype, device=device)
        return DraftContext([empty() for _ in drafter.layers], [empty() for _ in drafter.layers])


def append_context(drafter: Drafter, ctx: DraftContext, c):
    """KV injection: new context rows c (N, H) at positions S.. enter every layer's K/V."""
    tables = drafter.rope_tables(torch.arange(ctx.length, ctx.length + len(c), device=c.device), c.dtype)
    for l, layer in enumerate(drafter.layers):
        k, v = layer.context_kv(c, tables)                                              # (hk, N, d)
        ctx.keys[l] = torch.cat([ctx.keys[l], k], dim=1)                                # (hk, S+N, d)
        ctx.values[l] = torch.cat([ctx.values[l], v], dim=1)                            # (hk, S+N, d)


def attention_mask(q_pos, k_pos, causal: bool, window: int | None):
    """Which keys each query sees: (..., Nq), (..., Nk) absolute positions -> (..., Nq, Nk) bool, or None for
    all. A causal window keeps the `window` keys ending at the query; a window that is not causal keeps the
    keys less than `window` positions away on either side (2·window − 1 in all)."""
    if not causal and window is None:
        return None
    return visible_at(q_pos[..., :, None] - k_pos[..., None, :], causal, window)     # (..., Nq, Nk)


def visible_at(delta, causal: bool, window):
    """A layer's rule on query position minus key position (any shape) -> whether the key is seen. The
    window is an int, a 0-dim tensor (training's packed rule) or None."""
    visible = delta >= 0 if causal else torch.ones_like(delta, dtype=torch.bool)
    return visible if window is None else visible & (delta < window) & (delta > -window)


def draft_block(drafter: Drafter, ctx: DraftContext, block_embeds):
    """Embeddings (W, H) of [bonus, m, ..., m] at S..S+W-1, attending to the context and the block -> (W, H)."""
    key_positions = torch.arange(ctx.length + len(block_embeds), device=block_embeds.device)   # (S+W,)
    positions = key_positions[ctx.length:]                                              # (W,)
    masks = [attention_mask(positions, key_positions, layer.causal, layer.window) for layer in drafter.layers]
    tables = drafter.rope_tables(positions, block_embeds.dtype)
    return drafter(block_embeds, tables, list(zip(ctx.keys, ctx.values)), masks)


def propose(drafter: Drafter, ctx: DraftContext, block, target, count: int):
    """Greedy drafts for block ids (W,) = [bonus, m, ..., m]: the target's LM head argmax of rows 1..count,
    no shift. Every row of the block is computed (its rows attend to each other); only the `count` drafts
    to verify go through the head, which costs by the row (V columns each)."""
    hidden = draft_block(drafter, ctx, target.get_input_embeddings()(block))            # (W, H)
    return target.get_output_embeddings()(hidden[1:1 + count]).argmax(-1)              # (count,)


# -----------------------------------------------------------------------------
# Verification: greedy, or lossless rejection sampling
@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0: greedy, an exact argmax
    top_p: float = 1.0         # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0             # keep the k most likely tokens; 0 keeps all

    def __post_init__(self):
        require(self.temperature >= 0, f"--temperature = {self.temperature} must be ≥ 0")
        require(0 < self.top_p <= 1, f"--top-p = {self.top_p} must be in (0, 1]")
        require(self.top_k >= 0, f"--top-k = {self.top_k} must be ≥ 0")


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
    """Accept a prefix of the drafts (k,) against target logits (k+1, V), row i the target's distribution where
    d_{i+1} stands -> (accepted a, next token). Greedy: d_i is accepted while it is the target's argmax; the next
    token is row a's argmax. Sampling is rejection sampling with the one-hot proposal δ(d_i): accept d_i with
    probability p(d_i); at the first rejection draw from p with d_i removed, renormalised; if all pass, from p_k.
    Exact: P(x) = p(d)·[x = d] + (1 − p(d))·p(x)[x ≠ d]/(1 − p(d)) = p(x), whatever the drafter proposed.
    uniforms (≥ k+1,): uniforms[i] decides d_{i+1}, uniforms[-1] the draw."""
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
    interrupted: bool = False                # stopped by Ctrl-C (dflash.Interrupted), not by a stop or the limit

    def commit(self, drafts: list[int], accepted: int, new_tokens: list[int], stops) -> list[int]:
        """Record a round and append its tokens, trimmed at the first stop written; returns those appended.
        The round's acceptance length is what verification accepted, drafts past a stop included: it
        measures the drafter, not the text kept."""
        self.acceptance_lengths.append(accepted + 1)
        self.rounds.append({"draft": drafts, "accepted": accepted})
        for i in range(len(drafts)):
            self.position_drafted[i] += 1
            self.position_accepted[i] += i < accepted
        stop_at = next((i for i, token in enumerate(new_tokens) if token in stops), len(new_tokens) - 1)
        self.tokens += new_tokens[:stop_at + 1]
        return new_tokens[:stop_at + 1]

    @property
    def tau(self) -> float | None:   # mean tokens committed per verification round, bonus included
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else None


def request_limits(target, drafter=None) -> dict:
    """What a request is checked against: the target's embedding rows and positions, the drafter's block."""
    return dict(vocab_rows=target.get_input_embeddings().weight.shape[0],
                max_positions=target.config.get_text_config().max_position_embeddings,
                block_size=None if drafter is None else drafter.config.block_size)


def check_request(prompt_ids, max_new_tokens, num_drafts, *, vocab_rows, max_positions, block_size=None):
    """Refuse a request that cannot run, naming the CLI flag that sets each value (block_size None: no drafter)."""
    require(len(prompt_ids) > 0, "prompt: empty (--prompt or --prompt-ids needs at least one token)")
    outside = [t for t in prompt_ids if not 0 <= t < vocab_rows]
    require(not outside, f"--prompt-ids: {outside[:3]} outside the target's vocabulary 0..{vocab_rows - 1}")
    require(max_new_tokens >= 1, f"--max-new-tokens = {max_new_tokens} must be at least 1")
    require(len(prompt_ids) + max_new_tokens <= max_positions, f"prompt + --max-new-tokens = {len(prompt_ids)} + "
            f"{max_new_tokens} exceeds the target's max_position_embeddings {max_positions}")
    if block_size is not None:
        require(1 <= num_drafts < block_size, f"--num-drafts = {num_drafts} must be in 1..{block_size - 1} "
                f"(the drafter's block_size is {block_size})")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during generate: `generation` holds every round committed before it, marked interrupted."""
    def __init__(self, generation: "Generation"):
        super().__init__("interrupted")
        self.generation = generation


@torch.inference_mode()
def generate(target, drafter, prompt_ids: list[int], max_new_tokens: int, *, num_drafts: int | None = None,
             full_block: bool = True, stop_ids=(), on_tokens=None, sampling: Sampling = Sampling(),
             seed: int | None = None) -> Generation:
    """DFlash decoding: greedy output equals the target's greedy decode, sampled tokens have its distribution.
    drafter=None runs the target alone through this loop (K = 0); full_block computes all B drafter rows (z-lab),
    else K+1; on_tokens(list[int]) gets each round's tokens; seed fixes the K+1 uniforms of each verification."""
    if drafter is None:
        K = 0
    else:
        K = drafter.config.block_size - 1 if num_drafts is None else num_drafts
    check_request(prompt_ids, max_new_tokens, K, **request_limits(target, drafter))
    device, stops = target.get_input_embeddings().weight.device, set(stop_ids)
    on_tokens = on_tokens or (lambda tokens: None)
    generator = torch.Generator(device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    uniforms = lambda: torch.rand(K + 1, generator=generator, device=device, dtype=torch.float64)  # (K+1,)

    with closing(Capture(target, [] if drafter is None else drafter.config.target_layer_ids)) as capture:
        # Prefill: target logits for the first token and captured features for the whole prompt. A plain
        # DynamicCache keeps every layer whole, so it crops; sliding layers get their window from the mask.
        cache, prompt = DynamicCache(), torch.tensor(prompt_ids, device=device)         # prompt (P,)
        logits, features = target_forward(target, prompt, 0, cache, capture)            # (P, V), (P, n·H)
        _, bonus = verify(prompt[:0], logits[-1:], sampling, uniforms())   # no drafts: argmax or a draw
        out = Generation(tokens=[bonus], position_accepted=[0] * K, position_drafted=[0] * K)
        on_tokens([bonus])
        if drafter is not None:
            ctx = DraftContext.empty(drafter, device)
            append_context(drafter, ctx, drafter.project_context(features))   # draft prefill: S = P
            width = drafter.config.block_size if full_block else K + 1
            mask_ids = torch.full((width - 1,), drafter.config.mask_token_id, device=device)   # (W-1,)

        start = len(prompt_ids)   # position of the bonus token; the target cache holds 0..start-1
        try:
            while bonus not in stops and len(out.tokens) < max_new_tokens:
                k = min(K, max_new_tokens - len(out.tokens) - 1)   # never draft past max_new_tokens
                bonus_id = torch.tensor([bonus], device=device)                             # (1,)
                drafts = torch.empty(0, dtype=torch.long, device=device)                    # (k,)
                if k > 0:
                    drafts = propose(drafter, ctx, torch.cat([bonus_id, mask_ids]), target, k)   # block (W,)

                logits, features = target_forward(target, torch.cat([bonus_id, drafts]), start, cache, capture)
                accepted, next_token = verify(drafts, logits, sampling, uniforms())         # logits (k+1, V)
                cache.crop(accepted - len(drafts))   # a count ≤ 0: the k − a rejected drafts' K/V go
                if drafter is not None:   # the bonus and the accepted rows (a+1, n·H): the context lags by one
                    append_context(drafter, ctx, drafter.project_context(features[:accepted + 1]))
                start += accepted + 1

                written = out.commit(drafts.tolist(), accepted, drafts[:accepted].tolist() + [next_token], stops)
                bonus = written[-1]
                on_tokens(written)
        except KeyboardInterrupt:   # Ctrl-C: what was committed comes back with the exception
            out.interrupted = True
            raise Interrupted(out) from None
    return out


# -----------------------------------------------------------------------------
# Training's packed attention: the draft layers' rule, with the context's unseen tiles skipped
@functools.cache
def compiled_flex_attention():
    """flex attention fused by Triton, compiled on first use (torch.compile at import would cost every
    import of this file a second or two)."""
    return torch.compile(flex_attention)


class PackedMask(NamedTuple):
    """Training's packed forward on CUDA: W query rows in blocks of B, over keys [S context keys | the
    W rows themselves]. Each row sees context keys by `context`, a flex attention BlockMask over the
    context alone (its unseen tiles skipped), and the rows of its own block by `own` (B, B) bool, the
    same for every block: the layer's causal/window rule within a block."""
    context: BlockMask
    own: torch.Tensor


def attend_packed(q, keys, values, mask: PackedMask):
    """attend under a PackedMask, in two parts joined by their log-sum-exps: the context through flex
    attention (only the tiles some row sees, the K/V heads shared in the kernel) and each block's own B × B
    rows as small dense products. Kept out of the flex call, the own rows add no partly seen tiles to it
    (in it, each 128-row tile of 8 blocks of 16 would meet one or two tiles of the rows' keys, 1/8 seen,
    each applying the rule)."""
    (h, W, d), hk, B = q.shape[-3:], keys.shape[-3], mask.own.shape[0]
    S = keys.shape[-2] - W                                                             # context keys
    # a compiled drafter traces flex attention into its own graph; eager calls on CUDA take the compiled
    # one (inductor's CPU flex attention returns no log-sum-exp: elsewhere the unfused one)
    flex = compiled_flex_attention() if q.is_cuda and not torch.compiler.is_compiling() else flex_attention
    out_context, aux = flex(q, keys[..., :S, :], values[..., :S, :], block_mask=mask.context, enable_gqa=True,
                            return_aux=AuxRequest(lse=True))                           # (..., h, W, d), lse (..., h, W)
    qb = q.unflatten(-3, (hk, h // hk)).unflatten(-2, (W // B, B))                     # (..., hk, g, W/B, B, d)
    kb, vb = (t[..., S:, :].unflatten(-2, (W // B, B)).unsqueeze(-4) for t in (keys, values))  # (..., hk, 1, W/B, B, d)
    exact = aux.lse.dtype                                                              # ≥ fp32, as flex's scores
    scores = qb.to(exact) @ kb.to(exact).transpose(-1, -2) * d ** -0.5               # (..., hk, g, W/B, B, B)
    scores = scores.masked_fill(~mask.own, float("-inf"))
    lse_own = scores.logsumexp(-1)                                                     # (..., hk, g, W/B, B)
    out_own = (scores - lse_own[..., None]).exp().to(vb.dtype) @ vb                    # (..., hk, g, W/B, B, d)
    out_own = out_own.flatten(-3, -2).flatten(-4, -3)                                  # (..., h, W, d)
    lse_own = lse_own.flatten(-2).flatten(-3, -2)                                      # (..., h, W)
    lse = torch.logaddexp(aux.lse, lse_own)   # (..., h, W), finite: every row sees itself (a window is ≥ 1)
    out = out_context * (aux.lse - lse).exp()[..., None] + out_own * (lse_own - lse).exp()[..., None]
    return out.to(q.dtype)


# -----------------------------------------------------------------------------
# Loading and validation: checkpoints, config.json, transformers glue
def read_file(path: Path, what: str, reader=lambda p: json.loads(p.read_text())):
    """reader(path), JSON by default; a missing or unreadable file ends in one line naming it."""
    try:
        return reader(path)
    except FileNotFoundError:
        raise DFlashError(f"{what}: {path} not found") from None
    except Exception as err:   # JSON, safetensors and OS errors alike
        raise DFlashError(f"{what}: {path} is unreadable ({err})") from None


# Checkpoints a same-position DFlash reader would load wrong, silently: each is refused, naming why (spec §6).
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
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
    dflash2 = [k for k in DFLASH2_KEYS if k in nested]
    what = f"architectures {architectures}" if "DFlash2DraftModel" in architectures else f"dflash_config {dflash2}"
    require("DFlash2DraftModel" not in architectures and not dflash2, f"draft config: a DFlash2 checkpoint ({what}) "
            "is not supported yet: its convolution and selector weights have no place in a DFlash drafter")
    known = all(a == "DFlashDraftModel" or "Laguna" in a for a in architectures)
    require(bool(architectures) and known, f"draft config: 'architectures' = {architectures} is not a DFlash "
            "drafter (DFlashDraftModel, or a Laguna DFlash drafter); refusing to guess its layout")
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
    laguna = any("Laguna" in arch for arch in raw.get("architectures") or [])   # spec §6: no new flag
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
        norm_context=laguna, checkpoint_format="laguna" if laguna else "zlab")


def checkpoint_tensors(drafter: Drafter) -> dict[str, torch.Tensor]:
    """The drafter's tensors under its checkpoint format's names: a z-lab file keeps q/k/v_proj apart."""
    tensors = dict(drafter.named_parameters())   # the shared Laguna context norm once, as input_layernorm
    for l, layer in enumerate(drafter.layers if drafter.config.checkpoint_format == "zlab" else []):
        prefix, rows = f"layers.{l}.self_attn.", layer.self_attn.kv_rows
        q, k, v = tensors.pop(prefix + "qkv_proj.weight").split([rows.start] + [(rows.stop - rows.start) // 2] * 2)
        tensors |= {prefix + "q_proj.weight": q, prefix + "k_proj.weight": k, prefix + "v_proj.weight": v}
    return tensors


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
    require(0 <= cfg.mask_token_id < rows, f"draft config: 'mask_token_id' = {cfg.mask_token_id} is outside "
            f"the target's {rows} embedding rows")

    drafter = Drafter(cfg)
    expected = checkpoint_tensors(drafter)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    require(not missing, f"draft weights: {len(missing)} tensors missing, e.g. {missing[:3]}" +
            (f"; {len(unexpected)} unexpected, e.g. {unexpected[:3]} (renamed?)" if unexpected else ""))
    require(not unexpected, f"draft weights: {len(unexpected)} unexpected tensors, e.g. {unexpected[:3]}")
    for name, tensor in tensors.items():
        require(tensor.shape == expected[name].shape, f"draft weights: '{name}' has shape "
                f"{tuple(tensor.shape)}, config implies {tuple(expected[name].shape)}")
        bad = int((~torch.isfinite(tensor)).sum())
        require(bad == 0, f"draft weights: '{name}' has {bad} NaN or Inf values")
    for l in range(cfg.num_layers if cfg.checkpoint_format == "zlab" else 0):   # stack q/k/v into qkv_proj
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


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The target's decoder stack: the ModuleList with one entry per hidden layer."""
    num_layers = target.config.get_text_config().num_hidden_layers
    layers = next((m for m in target.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers), None)
    require(layers is not None, f"target: no decoder stack of {num_layers} layers found")
    return layers


# The target's SDPA kernels, cuDNN's left out: it plans every new sequence length on the host, about 1.5 ms
# per layer with a mask on an H200, and decoding changes the length every round.
TARGET_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@functools.cache
def cache_kwarg(model_class) -> str:
    """The keyword a model's forward takes its cache by, looked up once per class (5.2x renamed it)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


# -----------------------------------------------------------------------------
# CLI
# On CPU a wide verify costs well over a 1-row step, and only the drafts to verify go through the LM head,
# so fewer drafts cost less. The default pair drafts fastest at K = 6 and 3 (39.5 and 40.2 tokens/s, against
# 36.9 at K = 7, 31.3 at K = 15 and 29.5 for the target alone); K = 6 keeps the higher τ (3.17 against 2.70).
# So the CLI drafts at most this many there unless --num-drafts says otherwise (README, "How well it drafts").
CPU_NUM_DRAFTS = 6


def default_num_drafts(block_size: int, device: str) -> int:
    """K when none is asked for: block_size - 1, or at most CPU_NUM_DRAFTS on CPU."""
    return min(CPU_NUM_DRAFTS, block_size - 1) if torch.device(device).type == "cpu" else block_size - 1


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def device_and_dtype(device: str | None, dtype: str | None) -> tuple[str, torch.dtype]:
    """The CLIs' defaults: cuda if available, else cpu; bfloat16 on CUDA, float32 elsewhere."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise DFlashError(f"--device = {device!r} is not a device torch knows (cpu, cuda, cuda:N, ...)") from None
    require(kind != "cuda" or torch.cuda.is_available(), f"--device = {device!r}: CUDA is not available here")
    return device, DTYPES[dtype] if dtype else torch.bfloat16 if device.startswith("cuda") else torch.float32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="DFlash speculative decoding (lossless: greedy or sampled).")
    p.add_argument("--target", help="target model: local dir or hub id (default: the SmolLM2 pair shipped here)")
    p.add_argument("--draft", help="DFlash drafter checkpoint: local dir or hub id")
    p.add_argument("--prompt", default="Write a short poem about the sea.", help="prompt text")
    p.add_argument("--prompt-ids", help="comma-separated token ids, instead of --prompt")
    p.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--num-drafts", type=int, help=f"drafts K per step (default block_size - 1; on CPU at most "
                   f"{CPU_NUM_DRAFTS}, where a wider verify costs more than it gains)")
    p.add_argument("--compute-width", choices=["block", "drafts"], default="block", help="drafter rows: B or K+1")
    p.add_argument("--target-only", action="store_true", help="decode with the target alone, same loop")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy; > 0 samples, losslessly")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 keeps all")
    p.add_argument("--seed", type=int, help="seed of the sampling uniforms, for reproducible runs")
    p.add_argument("--dtype", choices=list(DTYPES), help="default float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--device", help="default cuda if available, else cpu")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of text and stats")
    return p.parse_args(argv)


def main(argv=None, generate_fn=None):
    """The CLI; `generate_fn` swaps in another implementation with generate's signature. Every request check
    that needs only the configs runs before the weights load; Ctrl-C prints the stats so far, exit code 130."""
    args = parse_args(argv)
    transformers.utils.logging.disable_progress_bar()
    device, dtype = device_and_dtype(args.device, args.dtype)
    sampling = Sampling(args.temperature, args.top_p, args.top_k)
    require_seed(args.seed)
    require(args.draft is None or args.target is not None, f"--draft = {args.draft!r} needs --target")
    require(args.target is None or args.draft is not None or args.target_only,
            f"--target = {args.target!r} needs --draft (or --target-only)")
    ids = None if args.prompt_ids is None else [t.strip() for t in args.prompt_ids.split(",") if t.strip()]
    require(all(t.lstrip("-").isdigit() for t in ids or []),
            f"--prompt-ids = {args.prompt_ids!r} must be comma-separated integers")
    target_path, draft_path = (args.target, args.draft) if args.target else offline.default_pair()
    if args.target is None:
        print(f"default pair: SmolLM2-135M-Instruct ({target_path}) with {draft_path}", file=sys.stderr)
    tcfg = target_config(str(target_path))
    draft_dir = None if args.target_only else checkpoint_dir(str(draft_path), "--draft")
    block_size = None if args.target_only else config_block_size(read_file(draft_dir / "config.json", "draft config"))
    tokenizer = offline.load_tokenizer(str(target_path))
    require(ids is not None or tokenizer is not None, f"--target '{target_path}' has no tokenizer: pass --prompt-ids")
    prompt_ids = [int(t) for t in ids] if ids is not None else offline.encode_prompt(tokenizer, args.prompt,
                                                                                      not args.no_chat)
    K = 0 if block_size is None else args.num_drafts if args.num_drafts is not None else \
        default_num_drafts(block_size, device)
    check_request(prompt_ids, args.max_new_tokens, K, vocab_rows=tcfg.vocab_size,
                  max_positions=tcfg.max_position_embeddings, block_size=block_size)

    target = load_target(str(target_path), dtype, device)
    drafter = None if args.target_only else load_drafter(str(draft_dir), target, dtype, device)
    t0, generate_fn = time.perf_counter(), generate_fn or generate
    printer = None if args.json else offline.printer(tokenizer)
    try:
        gen = generate_fn(target, drafter, prompt_ids, args.max_new_tokens, num_drafts=K or None,
                          full_block=args.compute_width == "block", stop_ids=offline.stop_token_ids(target, tokenizer),
                          on_tokens=printer, sampling=sampling, seed=args.seed)
    except Interrupted as stop:
        gen = stop.generation
        if printer is not None:   # tokens committed after the last print
            printer(gen.tokens[len(printer.seen):])
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if args.json:
        text = tokenizer.decode(gen.tokens, skip_special_tokens=True) if tokenizer is not None else None
        print(json.dumps({"tokens": gen.tokens, "text": text, "acceptance_lengths": gen.acceptance_lengths,
                          "tau": gen.tau, "rounds": gen.rounds, "interrupted": gen.interrupted}))
    else:
        print("\n" + offline.stats_table(gen, seconds))
    if gen.interrupted:
        raise SystemExit(130)


def run_cli(main_fn, **kwargs):
    """Run a CLI entry point: bad input ends with one line on stderr and exit code 2, no traceback;
    Ctrl-C outside a generation (which prints its own partial result) ends with one line and 130."""
    try:
        main_fn(**kwargs)
    except (DFlashError, offline.PackageError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run_cli(main)
