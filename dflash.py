"""DFlash speculative decoding: the readable reference.

A block drafter, conditioned on hidden states captured from the target, proposes a whole block in one
forward pass; the target verifies it in one pass and keeps the longest prefix that matches its own choice,
so greedy output is the target's greedy decode. This file is the algorithm and nothing else, in the order a
step runs it: config, drafter modules, target capture, drafter block, verification, `generate`; plain
PyTorch, not fast (`fastpath.py` is the same math, fast), importing no other file of the project.

    $ python dflash.py        # SmolLM2-135M-Instruct with the drafter shipped in drafter/
    $ python dflash.py --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --prompt "Hi"

Shapes: P prompt, S context (tokens the drafter has seen), B block, K drafts per step, W rows of a draft
block (B, or K+1), N any count of rows, H hidden, n captured target layers, V vocab, h/hk query/key heads,
d head_dim, C/G/r/k DFlash2's taps, tap groups, selector rank and candidates; `...` any leading shape.
"""
if __name__ == "__main__":   # a Ctrl-C while torch and transformers import ends as the CLI's own: exit 130
    import signal
    import sys
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import functools
import inspect
from contextlib import closing
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache


class DFlashError(ValueError):
    """Bad input: a checkpoint, config or request that cannot be run. Names the field and value."""


def require(ok: bool, message: str):
    if not ok:   # fail early, with a message that names the field and its value
        raise DFlashError(message)


# -----------------------------------------------------------------------------
# Drafter config: every checkpoint format resolved at load into one description (docs/checkpoints.md)
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
    conv_kernel_size: int = 0        # C taps of the convolution around each sublayer (DFlash2); 0: none
    conv_group_size: int = 16        # g channels that share one dynamic tap
    selector_rank: int = 0           # r of the candidate selector's pair term (DFlash2); 0: drafts are the argmax
    selector_top_k: int = 16         # k candidates the selector walks among
    vocab_size: int = 0              # V rows of the selector's codebooks: the target's vocabulary
    input_embedding_scale: float = 1.0   # block embeddings: the target's embedding rows times this
    output_multiplier: float = 1.0       # draft logits: the target's LM head times this,
    final_logit_softcapping: float | None = None   # then s·tanh(l / s)


def default_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """Spread n captured layers evenly from layer 1 to layer T-3 (z-lab's build_target_layer_ids); one layer sits at T // 2."""
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
    """RoPE's cos and sin at positions (..., N), (..., N, 1, d) each, from float64 angles, exact at any position
    (HF's and the engines' fp32 angles differ by up to about 3e-4 at position 4k and 3e-3 at 40k)."""
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
    bool, the keys each row sees, or None for all. Training passes its own in its place (Drafter.forward)."""
    # K/V repeated per query head: masked, SDPA's own GQA runs only its math kernel, this one can run fused
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

    def forward(self, u, table, context, mask, attend=attend):
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


def convolve(x, taps, base, block: int):
    """DFlash2's grouped dynamic causal convolution of rows x (..., W, H) in blocks of `block`, each from zeros:
    out[t, c] = Σ_o (base[o, c] + taps[t, o, c // g]) · x[t − o, c], taps (..., W, C, G), base (C, H), g = H / G."""
    C, g = base.shape[0], x.shape[-1] // taps.shape[-1]
    rows = x.unflatten(-2, (-1, block))                                                 # (..., W/B, B, H)
    taps = taps.repeat_interleave(g, -1).unflatten(-3, (-1, block))                     # (..., W/B, B, C, H)
    earlier = lambda o: F.pad(rows, (0, 0, o, 0))[..., :block, :]                       # x[t − o], 0 before the block
    return sum((base[o].to(x.dtype) + taps[..., o, :]) * earlier(o) for o in range(C)).flatten(-3, -2)   # (..., W, H)


class GroupedDynamicCausalConv(nn.Module):
    """DFlash2, around a sublayer: its normed input a goes through a convolution, the sublayer, and a second
    convolution, both taps from a: over the block's rows only, never the context (which enters K/V as it is)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        H, C, self.groups = cfg.hidden_size, cfg.conv_kernel_size, cfg.hidden_size // cfg.conv_group_size
        # made as the identity (tap 0 is 1, the rest and the dynamic taps 0): a DFlash layer's output
        self.base_kernel = nn.Parameter(F.pad(torch.ones(2, 1, H), (0, 0, 0, C - 1)))    # (2, C, H): before, after
        self.kernel_projection = nn.Linear(H, 2 * C * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def forward(self, a, sublayer, block: int):
        """a (..., W, H), a sublayer's normed input; sublayer (..., W, H) -> (..., W, H)."""
        taps = self.kernel_projection(a).unflatten(-1, (2, -1, self.groups))            # (..., W, 2, C, G)
        z = sublayer(convolve(a, taps[..., 0, :, :], self.base_kernel[0], block))
        return convolve(z, taps[..., 1, :, :], self.base_kernel[1], block)


def around(conv, a, sublayer, block: int):
    """A sublayer on its normed input a, inside the layer's DFlash2 convolutions where it has them."""
    return sublayer(a) if conv is None else conv(a, sublayer, block)


class DraftLayer(nn.Module):
    """One pre-norm decoder layer over the block, the context injected as extra keys and values."""

    def __init__(self, cfg: DraftConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)
        # Laguna normalises the context with this layer's own input norm before k/v; z-lab does not (docs/checkpoints.md).
        self.context_norm = self.input_layernorm if cfg.norm_context else nn.Identity()
        self.causal, self.window = cfg.causal[layer], cfg.windows[layer]   # this layer's mask rule
        convolved = cfg.conv_kernel_size > 0   # DFlash2 convolves around the attention and the MLP (z-lab's DFlash2DraftModel)
        self.attention_conv, self.mlp_conv = (GroupedDynamicCausalConv(cfg), GroupedDynamicCausalConv(cfg)) \
            if convolved else (None, None)

    def context_kv(self, c, tables):
        """KV injection: context rows c (..., S, H), their rope tables -> keys, values (..., hk, S, d)."""
        attn = self.self_attn
        kv = F.linear(self.context_norm(c), attn.qkv_proj.weight[attn.kv_rows])       # (..., S, 2·hk·d)
        return attn.keys_values(kv, tables[attn.rope_theta])

    def forward(self, x, tables, context, mask, block: int, attend=attend):
        attention = lambda u: self.self_attn(u, tables[self.self_attn.rope_theta], context, mask, attend)
        x = x + around(self.attention_conv, self.input_layernorm(x), attention, block)
        return x + around(self.mlp_conv, self.post_attention_layernorm(x), self.mlp, block)


class CandidateSelector(nn.Module):
    """DFlash2's draft walk, left to right from the anchor: each row's k likeliest tokens scored by their logit
    plus a low-rank term with the token picked before; the argmax at T = 0, else drawn from softmax(scores / T)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))   # (V, r)
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))     # (V, r)

    def forward(self, hidden, logits, anchor, temperature: float, uniforms):
        """Final-normed draft rows hidden (N, H), their logits (N, V), the anchor id, a uniform per row for
        T > 0 -> drafts (N,), candidates (N, k), and q (N, k) each draft was drawn from (None at T = 0)."""
        unary, candidates = logits.topk(self.top_k, dim=-1)                            # (N, k)
        u = self.hidden_projection(hidden)                                              # (N, r)
        previous, drafts, qs = anchor.reshape(1), [], []                              # (1,), indices kept on the device
        for t in range(len(hidden)):
            scores = self.scores(unary[t], candidates[t], previous, u[t])              # (k,)
            if temperature == 0:
                pick = scores.argmax().reshape(1)
            else:
                qs.append((scores.to(torch.promote_types(scores.dtype, torch.float32)) / temperature).softmax(-1))
                pick = sample(qs[-1], uniforms[t]).reshape(1)
            previous = candidates[t][pick]                                              # (1,)
            drafts.append(previous)
        return torch.cat(drafts), candidates, torch.stack(qs) if qs else None

    def scores(self, unary, candidates, previous, u):
        """A row's candidates (k,) scored: their logits plus Σ_r A[previous, r] · u[r] · B[candidate, r]."""
        return unary + self.successor_codebook[candidates] @ (self.predecessor_codebook[previous][0] * u)


class Drafter(nn.Module):
    """No embeddings, no LM head: the target's serve. Parameter names are the checkpoint's, except that
    z-lab's q_proj/k_proj/v_proj are one qkv_proj, fused at load (loading.py maps them back)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config, n, H, eps = cfg, len(cfg.target_layer_ids), cfg.hidden_size, cfg.rms_norm_eps
        # Laguna normalises each captured layer on its own before fc (docs/checkpoints.md); z-lab does not.
        self.aux_hidden_norms = nn.ModuleList(RMSNorm(H, eps) for _ in range(n)) if cfg.capture_norms else None
        self.fc, self.hidden_norm = nn.Linear(n * H, H, bias=False), RMSNorm(H, eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, l) for l in range(cfg.num_layers))
        self.norm = RMSNorm(H, eps)
        self.candidate_selector = CandidateSelector(cfg) if cfg.selector_rank else None   # DFlash2

    def project_context(self, features):
        """Captured features (..., S, n·H) -> context c (..., S, H), the same for every layer."""
        if self.aux_hidden_norms is not None:
            chunks = features.chunk(len(self.aux_hidden_norms), dim=-1)                 # n × (..., S, H)
            features = torch.cat([norm(f) for norm, f in zip(self.aux_hidden_norms, chunks)], -1)
        return self.hidden_norm(self.fc(features))

    def rope_tables(self, positions, dtype) -> dict:
        """A rope_table at positions (..., N) for each RoPE base the layers use."""
        return {t: rope_table(positions, t, self.config.head_dim, dtype) for t in set(self.config.rope_thetas)}

    def forward(self, x, tables, context, masks, block: int, attend=attend):
        """Block embeddings x (..., W, H) in blocks of `block` rows, the rope_tables of their positions (made by
        the caller: compiled here, inductor would redo their float64 math per kernel), context and masks;
        `attend(q, keys, values, mask)` is the attention (training's packed forward brings its own)."""
        for layer, layer_context, mask in zip(self.layers, context, masks):
            x = layer(x, tables, layer_context, mask, block, attend)
        return self.norm(x)

    def draft_logits(self, hidden, head):
        """Final-normed rows (..., N, H) through the target's LM head -> logits (..., N, V), times
        output_multiplier and softcapped where the config says so."""
        logits, cap = head(hidden) * self.config.output_multiplier, self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits


# -----------------------------------------------------------------------------
# Target capture: layer outputs taken during the target's own forward

# The target's SDPA kernels, cuDNN's left out: it plans each new length on the host (1.5 ms a layer, H200).
TARGET_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decoder_layers(target: nn.Module) -> nn.ModuleList:   # the ModuleList with one entry per hidden layer
    num_layers = target.config.get_text_config().num_hidden_layers
    layers = next((m for m in target.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers), None)
    require(layers is not None, f"target: no decoder stack of {num_layers} layers found")
    return layers


@functools.cache
def cache_kwarg(model_class) -> str:
    """The keyword a model's forward takes its cache by, looked up once per class (5.2x renamed it)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class Capture:
    """Hooks on the captured target layers until close(): a forward leaves the residual stream leaving layer
    i (before the final norm: HF's hidden_states[i + 1], but for the last layer) in outputs[i]."""

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
    all. A causal window keeps the `window` keys ending at the query, else those less than `window` away."""
    if not causal and window is None:
        return None
    return visible_at(q_pos[..., :, None] - k_pos[..., None, :], causal, window)     # (..., Nq, Nk)


def visible_at(delta, causal: bool, window):
    """A layer's rule on query minus key position (any shape) -> whether the key is seen; window an int, a
    0-dim tensor (training's packed rule) or None."""
    visible = delta >= 0 if causal else torch.ones_like(delta, dtype=torch.bool)
    return visible if window is None else visible & (delta < window) & (delta > -window)


def draft_block(drafter: Drafter, ctx: DraftContext, block_embeds):
    """Embeddings (W, H) of [bonus, m, ..., m] at S..S+W-1, attending to the context and the block -> (W, H)."""
    key_positions = torch.arange(ctx.length + len(block_embeds), device=block_embeds.device)   # (S+W,)
    positions = key_positions[ctx.length:]                                              # (W,)
    masks = [attention_mask(positions, key_positions, layer.causal, layer.window) for layer in drafter.layers]
    tables = drafter.rope_tables(positions, block_embeds.dtype)
    return drafter(block_embeds, tables, list(zip(ctx.keys, ctx.values)), masks, block=len(block_embeds))


def embed_block(drafter: Drafter, block, target):
    """Block ids (W,) = [bonus, m, ..., m] -> the target's embedding rows times input_embedding_scale (W, H)."""
    return F.embedding(block, target.get_input_embeddings().weight) * drafter.config.input_embedding_scale


def read_drafts(drafter: Drafter, hidden, target, anchor, sampling, uniforms):
    """The draft rows (N, H) after the bonus -> drafts (N,) and q (N, V) each was drawn from, or None for the
    argmax (q one-hot). DFlash2 walks its candidates from the anchor (drawn at T > 0); DFlash proposes its
    argmax, or draws from its own processed p with sampling.drafts "sampled". uniforms (N,): one a draw."""
    logits = drafter.draft_logits(hidden, target.get_output_embeddings())              # (N, V)
    if drafter.candidate_selector is not None:
        drafts, candidates, q = drafter.candidate_selector(hidden, logits, anchor, sampling.temperature, uniforms)
        return drafts, None if q is None else torch.zeros_like(logits, dtype=q.dtype).scatter(-1, candidates, q)
    if sampling.temperature == 0 or sampling.drafts == "argmax":
        return logits.argmax(-1), None                                                  # (N,)
    q = target_probs(logits, sampling)                                                  # (N, V)
    return sample(q, uniforms[:len(q)]), q                                              # one draw a row


def propose(drafter: Drafter, ctx: DraftContext, block, target, count: int, sampling, uniforms):
    """Drafts (count,) and their q (read_drafts) for block ids (W,) = [bonus, m, ..., m], from rows 1..count,
    no shift: every row is computed (they attend to each other), only the drafts go through the head."""
    hidden = draft_block(drafter, ctx, embed_block(drafter, block, target))            # (W, H)
    return read_drafts(drafter, hidden[1:1 + count], target, block[0], sampling, uniforms)


# -----------------------------------------------------------------------------
# Verification: greedy, or lossless rejection sampling
@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0: greedy, an exact argmax
    top_p: float = 1.0         # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0             # keep the k most likely tokens; 0 keeps all
    drafts: str = "sampled"    # a DFlash drafter's proposals at T > 0: drawn from its own p, or its "argmax"

    def __post_init__(self):
        require(self.temperature >= 0, f"--temperature = {self.temperature} must be ≥ 0")
        require(0 < self.top_p <= 1, f"--top-p = {self.top_p} must be in (0, 1]")
        require(self.top_k >= 0, f"--top-k = {self.top_k} must be ≥ 0")
        require(self.drafts in ("argmax", "sampled"), f"--drafts = {self.drafts!r} must be argmax or sampled")


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


def residual(p, q):
    """Where a rejected draft's mass goes: max(p − q, 0) (`sample` renormalises), or p where that is all 0."""
    rest = (p - q).clamp(min=0)                                                                     # (V,)
    return torch.where(rest.sum() > 0, rest, p)


def sample(dist, u):
    """Inverse-CDF draws from distributions (..., V) that need not sum to 1, a uniform in [0, 1) each: u (...)."""
    cdf = dist.cumsum(-1)                                                                             # (..., V)
    return torch.searchsorted(cdf, u[..., None] * cdf[..., -1:], right=True)[..., 0].clamp(max=dist.shape[-1] - 1)


def verify(drafts, logits, sampling: Sampling, uniforms, draft_probs=None) -> tuple[int, int]:
    """Accept a prefix of the drafts (k,) against target logits (k+1, V), row i the target's distribution where
    d_{i+1} stands -> (accepted a, next token). Greedy: d_i is accepted while it is row i's argmax; the next is
    row a's. Sampling is rejection sampling with the drafts' q (draft_probs (k, V); None: one-hot): accept d_i
    with probability min(1, p(d_i) / q(d_i)); at the first rejection draw from max(p − q, 0) renormalised; if
    all pass, from p_k. Exact for any q: min(p, q) + max(p − q, 0) = p. uniforms: [i] decides d_{i+1}, [-1] draws."""
    k = len(drafts)
    if sampling.temperature == 0:
        target_tokens = logits.argmax(-1)                                                         # (k+1,)
        matches = (drafts == target_tokens[:-1]).long()                                           # (k,)
        accepted = int(matches.cumprod(0).sum())   # cumprod zeroes everything after the first miss
        return accepted, int(target_tokens[accepted])
    probs = target_probs(logits, sampling)                                                        # (k+1, V)
    if draft_probs is None:   # the argmax proposal: q one-hot at each draft
        draft_probs = torch.zeros_like(probs[:-1]).scatter(-1, drafts[:, None], 1.0)              # (k, V)
    p_draft = probs[:-1].gather(-1, drafts[:, None])[:, 0]                                        # (k,)
    q_draft = draft_probs.gather(-1, drafts[:, None])[:, 0].to(p_draft.dtype)                     # (k,)
    matches = (uniforms[:k] * q_draft < p_draft).long()       # accept d_i with probability min(1, p / q)
    accepted = int(matches.cumprod(0).sum())
    dist = residual(probs[accepted], draft_probs[accepted].to(probs.dtype)) if accepted < k else probs[accepted]
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
        """Record a round and append its tokens, trimmed at the first stop written; returns those appended. Its
        acceptance length counts drafts past a stop too: it measures the drafter, not the text kept."""
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


def request_limits(target, drafter=None) -> dict:   # the target's embedding rows and positions, the block
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


class Interrupted(KeyboardInterrupt):   # Ctrl-C in generate: `generation` holds every round committed before it
    def __init__(self, generation: "Generation"):
        super().__init__("interrupted")
        self.generation = generation


@torch.inference_mode()
def generate(target, drafter, prompt_ids: list[int], max_new_tokens: int, *, num_drafts: int | None = None,
             full_block: bool = True, stop_ids=(), on_tokens=None, sampling: Sampling = Sampling(),
             seed: int | None = None) -> Generation:
    """DFlash decoding: greedy output equals the target's greedy decode, sampled tokens have its distribution.
    drafter=None runs the target alone (K = 0); full_block computes all B drafter rows (z-lab), else K+1;
    on_tokens(list[int]) gets each round's tokens; seed fixes the uniforms: a round's K draws of its drafts
    (T > 0 with DFlash2, or sampling.drafts "sampled"), then the K+1 of its verification."""
    K = 0 if drafter is None else drafter.config.block_size - 1 if num_drafts is None else num_drafts
    check_request(prompt_ids, max_new_tokens, K, **request_limits(target, drafter))
    device, stops = target.get_input_embeddings().weight.device, set(stop_ids)
    on_tokens = on_tokens or (lambda tokens: None)
    generator = torch.Generator(device)
    generator.seed() if seed is None else generator.manual_seed(seed)
    uniforms = lambda n: torch.rand(n, generator=generator, device=device, dtype=torch.float64)   # (n,)
    draws_drafts = drafter is not None and sampling.temperature > 0 and \
        (drafter.candidate_selector is not None or sampling.drafts == "sampled")

    with closing(Capture(target, [] if drafter is None else drafter.config.target_layer_ids)) as capture:
        # Prefill. A plain DynamicCache keeps layers whole, so it crops; sliding layers take their window from the mask
        cache, prompt = DynamicCache(), torch.tensor(prompt_ids, device=device)         # prompt (P,)
        logits, features = target_forward(target, prompt, 0, cache, capture)            # (P, V), (P, n·H)
        _, bonus = verify(prompt[:0], logits[-1:], sampling, uniforms(K + 1))   # no drafts: argmax or a draw
        out = Generation(tokens=[bonus], position_accepted=[0] * K, position_drafted=[0] * K)
        try:   # Ctrl-C from here on: what was committed comes back with the exception
            on_tokens([bonus])
            if drafter is not None:
                ctx = DraftContext.empty(drafter, device)
                append_context(drafter, ctx, drafter.project_context(features))   # draft prefill: S = P
                width = drafter.config.block_size if full_block else K + 1
                mask_ids = torch.full((width - 1,), drafter.config.mask_token_id, device=device)   # (W-1,)

            start = len(prompt_ids)   # position of the bonus token; the target cache holds 0..start-1
            while bonus not in stops and len(out.tokens) < max_new_tokens:
                k = min(K, max_new_tokens - len(out.tokens) - 1)   # never draft past max_new_tokens
                bonus_id = torch.tensor([bonus], device=device)                             # (1,)
                drafts, q = torch.empty(0, dtype=torch.long, device=device), None           # (k,), (k, V)
                draft_uniforms = uniforms(K) if draws_drafts else None                      # (K,)
                if k > 0:
                    drafts, q = propose(drafter, ctx, torch.cat([bonus_id, mask_ids]), target, k, sampling,
                                        draft_uniforms)                                     # block (W,)

                logits, features = target_forward(target, torch.cat([bonus_id, drafts]), start, cache, capture)
                accepted, next_token = verify(drafts, logits, sampling, uniforms(K + 1), q)  # logits (k+1, V)
                cache.crop(accepted - len(drafts))   # a count ≤ 0: the k − a rejected drafts' K/V go
                if drafter is not None:   # the bonus and the accepted rows (a+1, n·H): the context lags by one
                    append_context(drafter, ctx, drafter.project_context(features[:accepted + 1]))
                start += accepted + 1

                written = out.commit(drafts.tolist(), accepted, drafts[:accepted].tolist() + [next_token], stops)
                bonus = written[-1]
                on_tokens(written)
        except KeyboardInterrupt:
            out.interrupted = True
            raise Interrupted(out) from None
    return out


if __name__ == "__main__":   # the demo program, dflash_reference/demo.py, decoding through this file
    import runpy
    runpy.run_module("dflash_reference.demo", {"DECODER": "dflash"}, "__main__")
