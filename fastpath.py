"""DFlash speculative decoding: the fast path.

The same math as `dflash.py`, token for token, arranged for a GPU, in dflash.py's order and with its
names. Every difference from dflash.py:
  - static state: one `Buffers` holds every tensor a generation writes (the target's K/V, the
    drafter's context K/V after k_norm and RoPE, the step's ids, counters and result), allocated
    once per `Decoder`, sized by a capacity of C positions;
  - fixed shapes: a draft block always has W rows and a verify always K+1; positions and the
    number of drafts that may be accepted are device counters. Rows past the accepted ones are
    written too; masks hide them and the next step overwrites them;
  - fused weights: the drafter's [gate; up] is one matmul, the modules' own weights becoming views of
    the fused matrix; every layer's context k/v rows are stacked into one matrix, with Laguna's
    input-norm weight folded into it (the shared 1/rms is applied in fp32); a Decoder checks before
    each request that the target's and drafter's weights are the ones it fused;
  - the target: dense Llama/Qwen3 stacks run here (`DenseTarget`: fused [q; k; v] and [gate; up],
    K/V in the static buffers, verify rows past the model's last position rotated as that position);
    any other target (Laguna's MoE, sliding windows, biases) runs its own forward over transformers'
    static cache (`ModelTarget`), whose capture hooks are registered once per Decoder and removed by
    `close()`; targets that cache compressed keys and values (MLA) are refused;
  - attention by buffer slot (`attend_upto`, kernels.py: a query sees one range of slots, up to its own
    in the target, the committed context and the block in the drafter, whose block k/v are written into
    the context buffers at the block's slots), with grouped heads (K/V never repeated), where dflash.py
    calls SDPA over the committed positions only. On CUDA it is a Triton kernel that reads K/V only
    over that range, scores and softmax in fp32 registers; elsewhere its twin `attend`, a masked
    softmax over all buffer slots, scores in the working dtype and softmax in at least fp32 (float64
    stays float64, as dflash.py's SDPA keeps it);
  - a target layer's heads: on CUDA one Triton kernel takes the [q; k; v] rows to rotated q and the
    K/V slots (`heads_into_place`: Qwen3's q/k norms, RoPE, the writes); elsewhere the model's modules;
  - prefill: eager, PREFILL_CHUNK positions at a time (so attention scores stay chunk × C);
  - compiled steps: on CUDA the draft part and the verify part (capture, acceptance, context
    append) are each compiled with fullgraph=True and captured as a CUDA graph on first use. A
    target whose step cannot be traced as one graph or captured (an MoE routed on the host) runs the
    same step eagerly with the same buffers, and a message says so;
  - one host read per step, the accepted tokens; sampling's uniforms are drawn outside the graphs, and the
    drafts' distribution q, where drafts are drawn (at T > 0 DFlash2's, or DFlash's with drafts "sampled"),
    waits in a static buffer for verify;
  - draws and DFlash2's walk by kernels.py, Triton kernels on CUDA and dflash.py's own functions
    elsewhere: inverse-CDF draws of every row at once (`sample`); the candidates (`topk`), every row's
    scores given each candidate before it, then the picks (`candidate_walk`). DFlash2's convolutions run
    as dflash.py's own modules inside the draft part.
On CPU the same code runs eagerly, without graphs, so the reference-equality tests run anywhere.

    $ python fastpath.py --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --prompt "Hi"

Shapes as in dflash.py, plus C the buffer capacity in positions and g = h / hk query heads per K/V head.
"""

from __future__ import annotations

if __name__ == "__main__":   # a Ctrl-C while torch and transformers import ends as the CLI's own: exit 130
    import signal
    import sys
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import sys
from contextlib import closing
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import dflash
from dflash import Drafter, Generation, Sampling, rope
from dflash_reference.kernels import attend_upto, candidate_walk, heads_into_place, sample


# -----------------------------------------------------------------------------
# Static state: every tensor of one generation, allocated once

@dataclass
class Buffers:
    start: torch.Tensor          # ()          position of the bonus token = committed length - 1
    max_accept: torch.Tensor     # ()          drafts that may be accepted this step (k ≤ K)
    uniforms: torch.Tensor       # (K+1,)      float64 uniforms of this step's sampling, drawn outside graphs
    verify_ids: torch.Tensor     # (K+1,)      [bonus, d_1..d_K], the verify input
    result: torch.Tensor         # (2K+2,)     [a, d_1..d_a, t_a, padding (K+1 in all), d_1..d_K]
    # One tensor per layer, not one (L, ...) tensor: a compiled in-place write into a slice of a larger
    # buffer is lowered to a copy of the whole buffer, per layer.
    target_keys: list[torch.Tensor]    # T × (hk, C, d)  the target's keys after its norms and RoPE
    target_values: list[torch.Tensor]  # T × (hk, C, d)
    ctx_keys: list[torch.Tensor]       # L × (hk, C+W, d) the drafter's context keys after k_norm and RoPE;
    ctx_values: list[torch.Tensor]     # L × (hk, C+W, d) while a block drafts, its own k/v at its slots
    draft_uniforms: torch.Tensor | None = None   # (K,)   float64 uniforms of the drafts' draws, where drafts are drawn
    draft_probs: torch.Tensor | None = None      # (K, V) the q each draft was drawn from, there

    def tensors(self) -> list[torch.Tensor]:
        drawn = [] if self.draft_probs is None else [self.draft_uniforms, self.draft_probs]
        return [self.start, self.max_accept, self.uniforms, self.verify_ids, self.result, *self.target_keys,
                *self.target_values, *self.ctx_keys, *self.ctx_values, *drawn]


def zeros(count: int, shape, like: torch.Tensor) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(count)]


# -----------------------------------------------------------------------------
# Fused modules: projections that read the same input become one matmul

def fused_weight(linears: list[nn.Linear]) -> torch.Tensor:
    """One (ΣN, H) matrix for bias-free linears that read the same input, so that they cost one
    matmul. Each linear's weight is re-pointed (`.data`, the same Parameter) at its rows of that
    matrix, so no weight is stored twice; once fused, the weights sit back to back in one storage
    and a later call views them as the matrix again."""
    weights = [m.weight for m in linears]
    first, rows = weights[0], sum(w.shape[0] for w in weights)
    back_to_back = all(w.is_contiguous() and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                       for w in weights) and \
        all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(weights, weights[1:]))
    if back_to_back:
        return first.detach().as_strided((rows, first.shape[1]), (first.shape[1], 1))
    # ordinary tensors, as the weights are: the model may be trained later; weights made under inference
    # mode stay inference tensors (a Parameter given an ordinary tensor there would half become one)
    with torch.inference_mode(any(w.is_inference() for w in weights)), torch.no_grad():
        fused = torch.cat([w.detach() for w in weights])                                # (ΣN, H)
        offset = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = fused[offset:offset + n]
            offset += n
    return fused


class UnitRMSNorm(nn.Module):
    """RMSNorm without its weight (folded into the next matmul): the shared 1/rms, in ≥ fp32."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


@dataclass
class FusedDrafter:
    module: Drafter
    gate_up: list[torch.Tensor]  # per layer (2·I, H)  [gate; up], views of the modules' weights
    context_kv: torch.Tensor     # (L·2·hk·d, H)       every layer's k/v rows, input-norm weight folded in
    context_norm: nn.Module      # what is left of the context's input norm: 1/rms (Laguna), else identity


def weight_state(module: nn.Module) -> list[tuple[int, int | None]]:
    """Each parameter's address and version counter: an in-place write advances the counter
    (load_state_dict, an optimizer step), a new tensor moves the address (load_state_dict(assign=True),
    `.data =`, `.to()`). A write through `.data` in place (`p.data.copy_(...)`, as an EMA does) bypasses
    autograd and advances neither: build a new Decoder after one. An inference tensor has no counter
    (None): it cannot be written in place outside inference mode."""
    return [(p.data_ptr(), None if p.is_inference() else p._version) for p in module.parameters()]


def fuse_drafter(drafter: Drafter) -> FusedDrafter:
    """Fuse [gate; up] per layer and stack every layer's context k/v rows; where the layers normalise
    the context (Laguna) scale those columns by the norm weight: W·(w ⊙ c/rms(c)) = (W·diag(w))·(c/rms(c))."""
    cfg, rows = drafter.config, []
    for layer in drafter.layers:
        with torch.inference_mode(False), torch.no_grad():
            w = layer.self_attn.qkv_proj.weight[layer.self_attn.kv_rows]                 # (2·hk·d, H)
            rows.append(w * layer.input_layernorm.weight[None] if cfg.norm_context else w)
    gate_up = [fused_weight([layer.mlp.gate_proj, layer.mlp.up_proj]) for layer in drafter.layers]
    context_norm = UnitRMSNorm(cfg.rms_norm_eps) if cfg.norm_context else nn.Identity()
    return FusedDrafter(drafter, gate_up, torch.cat(rows), context_norm)


# -----------------------------------------------------------------------------
# Target capture: the target's forward at device positions, into static K/V, with its features

def dense_layer(layer, apply_rotary, qkv, gate_up, keys, values, x, cos, sin, slots):
    """One Llama/Qwen3 decoder layer of `DenseTarget.rows`: x (Bt, N, H) -> x after the layer, its K/V
    written into keys/values (Bt, hk, C, d) at each row's buffer slots (Bt, N); a query at slot s sees
    its row's slots 0..s (`attend_upto`). The model's own norms, RoPE (`apply_rotary`),
    o/down projections and SiLU; [q; k; v] and [gate; up] as the fused matrices qkv and gate_up.
    Everything a layer owns comes in as an argument, so one compiled copy serves every layer."""
    attn = layer.self_attn
    q = heads_into_place(attn, apply_rotary, layer.input_layernorm(x) @ qkv.T, keys, values, cos, sin, slots)
    o = attend_upto(q, keys, values, slots, attn.scaling)                               # (Bt, N, h·d)
    x = x + attn.o_proj(o)
    gate, up = (layer.post_attention_layernorm(x) @ gate_up.T).chunk(2, dim=-1)
    return x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)                         # (Bt, N, H)


def stored(t):
    """t as a buffer computed once under torch.compile (eager: t itself). There a cheap value that
    several Triton kernel calls read, such as the slots or the RoPE tables, is otherwise recomputed
    into a fresh buffer for every call: 3.5 kernels per target layer (inductor's `copy_input`). A view
    with explicit strides needs storage, so inductor realizes t once, whatever its size; asking for a
    stride order instead skips tensors of one element, the 1-row step's slots. Pass fresh values or
    views at offset 0: torch 2.11's inductor (2.13 keeps it) drops a view's storage offset here (the
    positions' last slot, `positions[-1].expand(W)`, read as their first)."""
    return t.as_strided(t.size(), t.stride()) if torch.compiler.is_compiling() else t


class DenseTarget:
    """A Llama/Qwen3 decoder stack run here: one [q;k;v] and one [gate;up] matmul per layer, K/V in
    static per-layer (Bt, hk, C, d) buffers (Bt = 1 for a Decoder; distill.BatchDecoder decodes many
    rows), attention by `attend`. Embedding, norms, rotary embedding, o/down projections and LM head
    are the model's own modules, so the math is the model's."""

    @staticmethod
    def supports(target) -> bool:
        cfg = target.config
        if cfg.model_type not in ("llama", "qwen3"):
            return False
        attn, mlp = target.model.layers[0].self_attn, target.model.layers[0].mlp
        plain = all(type(m) is nn.Linear for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj))
        return (plain and cfg.hidden_act == "silu"
                and not getattr(cfg, "attention_bias", False) and not getattr(cfg, "mlp_bias", False)
                and getattr(cfg, "pretraining_tp", 1) == 1
                and all(t == "full_attention" for t in getattr(cfg, "layer_types", None) or []))

    def __init__(self, target, layer_ids: list[int], capacity: int, batch_size: int = 1):
        self.target, self.layer_ids = target, layer_ids
        self.layers = target.model.layers
        self.qkv = [fused_weight([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.layers]
        self.gate_up = [fused_weight([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers]
        attn = self.layers[0].self_attn
        self.head_dim, self.num_kv_heads = attn.head_dim, target.config.num_key_value_heads
        self.apply_rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb   # the model's own RoPE
        self.last_position = target.config.max_position_embeddings - 1
        shape = (batch_size, self.num_kv_heads, capacity, self.head_dim)
        self.batch_keys = zeros(len(self.layers), shape, self.qkv[0])                   # T × (Bt, hk, C, d)
        self.batch_values = zeros(len(self.layers), shape, self.qkv[0])
        self.keys = [k[0] for k in self.batch_keys]                                     # T × (hk, C, d) of row 0
        self.values = [v[0] for v in self.batch_values]

    def forward(self, ids, positions):
        """One sequence, as the Decoder runs it: ids (N,) at positions (N,), its K/V written at those
        positions, each seeing the positions up to its own -> logits (N, V), captured features (N, n·H)."""
        hidden, features = self.rows(ids[None], positions[None])
        return self.target.lm_head(hidden[0]), None if features is None else features[0]

    def rows(self, ids, slots, layer_fn=None):
        """Bt rows at once, the first Bt of the buffers, each a sequence whose buffer slot is its
        position: ids (Bt, N) at slots (Bt, N), their K/V written there; a query at slot s sees its
        row's slots 0..s -> final-normed hidden states (Bt, N, H) and captured features (Bt, N, n·H).
        `layer_fn` runs each layer (default `dense_layer`; distill.BatchDecoder passes a compiled one)."""
        model, layer_fn, Bt = self.target.model, layer_fn or dense_layer, len(ids)
        x = model.embed_tokens(ids)                                                     # (Bt, N, H)
        # rows past the model's last position (a verify's, near the end of a request, that cannot be
        # accepted) rotate as that position: a RoPE that rescales for longer inputs (dynamic) would
        # otherwise rotate every row of the forward anew
        cos, sin = model.rotary_emb(x, slots.clamp(max=self.last_position))            # (Bt, N, d)
        slots, cos, sin = stored(slots), stored(cos), stored(sin)   # once, not once per kernel call
        captured = {}
        for l, layer in enumerate(self.layers):
            x = layer_fn(layer, self.apply_rotary, self.qkv[l], self.gate_up[l], self.batch_keys[l][:Bt],
                         self.batch_values[l][:Bt], x, cos, sin, slots)                 # (Bt, N, H)
            captured[l] = x
        features = torch.cat([captured[i] for i in self.layer_ids], -1) if self.layer_ids else None
        return model.norm(x), features                                                  # (Bt, N, H), (Bt, N, n·H)

    def close(self):
        pass


class ModelTarget:
    """Any other target (Laguna's MoE, sliding windows, biases) through its own forward, over a static
    cache whose layers all hold C positions, so that rolling back is only moving a counter; sliding
    layers still get their window from the model's own mask."""

    def __init__(self, target, layer_ids: list[int], capacity: int):
        from transformers.cache_utils import Cache, StaticLayer
        self.target, tcfg, w = target, target.config.get_text_config(), target.get_input_embeddings().weight
        dflash.require(getattr(tcfg, "kv_lora_rank", None) is None, f"fastpath: {tcfg.model_type} targets attend "
                       "through compressed keys and values (MLA), whose cache shapes this static cache does not hold; "
                       "dflash.py runs them")
        self.cache = Cache(layers=[StaticLayer(max_cache_len=capacity) for _ in range(tcfg.num_hidden_layers)])
        head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
        kv_heads = getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads   # none given: no GQA
        self.cache.early_initialization(1, kv_heads, head_dim, w.dtype, w.device)
        self.keys = [layer.keys[0] for layer in self.cache.layers]                      # T × (hk, C, d) views
        self.values = [layer.values[0] for layer in self.cache.layers]
        self.capture = dflash.Capture(target, layer_ids)   # hooks registered once, not inside a compiled step
        self.cache_kwarg = dflash.cache_kwarg(type(target))
        self.last_position = tcfg.max_position_embeddings - 1

    def forward(self, ids, positions):
        """dflash.target_forward at device positions (N,) -> logits (N, V), features (N, n·H). Near the end
        of a request the verify's rows past the ones that can be accepted may run past the model's last
        position; they take that position's id (a model with learned positions has no row past it), and
        no row that can be accepted sees them."""
        for layer in self.cache.layers:   # each layer's write position: a device copy, no sync
            layer.cumulative_length.copy_(positions[0])
        out = self.target(input_ids=ids[None], position_ids=positions.clamp(max=self.last_position)[None],
                          use_cache=True, **{self.cache_kwarg: self.cache})
        return out.logits[0], self.capture.features()[0] if self.capture.layer_ids else None

    def close(self):
        self.capture.close()


# -----------------------------------------------------------------------------
# Drafter block: context K/V into the static buffers, one block over all C positions

def append_context(drafter: FusedDrafter, buf: Buffers, c, positions):
    """KV injection into the static buffers: context rows c (N, H) at `positions` (N,), all layers in
    one matmul. Rows past the accepted ones are written too; masks hide them, the next step overwrites."""
    cfg = drafter.module.config
    kv = (drafter.context_norm(c) @ drafter.context_kv.T).view(len(c), cfg.num_layers, 2, cfg.num_kv_heads,
                                                               cfg.head_dim)   # (N, L, 2, hk, d)
    tables = drafter.module.rope_tables(positions, c.dtype)
    for l, layer in enumerate(drafter.module.layers):
        k, v = layer.self_attn.keys_values(kv[:, l].flatten(-3), tables[layer.self_attn.rope_theta])   # (hk, N, d)
        buf.ctx_keys[l].index_copy_(1, positions, k)
        buf.ctx_values[l].index_copy_(1, positions, v)


def draft_layer(layer, gate_up, ctx_keys, ctx_values, x, table, positions, first, last):
    """One drafter layer of `draft_block`: block rows x (W, H) at `positions` (W,), their k/v written
    into the layer's context keys/values (hk, C+W, d) at those slots, each row seeing the slots
    first..last (W,; from 0 where first is None) -> x after the layer; [gate; up] as the fused gate_up."""
    attn, W, d = layer.self_attn, len(x), ctx_keys.shape[-1]

    def attention(u):                                                                   # (W, H) -> (W, H)
        q, k, v = (u @ attn.qkv_proj.weight.T).view(W, -1, d).split(attn.heads, 1)      # (W, h|hk, d)
        q, k = rope(attn.q_norm(q), table), rope(attn.k_norm(k), table)
        ctx_keys.index_copy_(1, positions, k.transpose(0, 1))                          # (hk, W, d) at the block's slots
        ctx_values.index_copy_(1, positions, v.transpose(0, 1))
        o = attend_upto(q[None], ctx_keys[None], ctx_values[None], last[None], d ** -0.5,
                        None if first is None else first[None]).view(W, -1, d)          # (W, h, d)
        if attn.g_proj is not None:
            o = dflash.gate(attn.g_proj(u), o)
        return attn.o_proj(o.reshape(W, -1))

    def mlp(u):                                                                         # (W, H) -> (W, H)
        gate, up = (u @ gate_up.T).chunk(2, dim=-1)
        return layer.mlp.down_proj(F.silu(gate) * up)

    x = x + dflash.around(layer.attention_conv, layer.input_layernorm(x), attention, W)   # DFlash2: convolved
    return x + dflash.around(layer.mlp_conv, layer.post_attention_layernorm(x), mlp, W)   # (W, H)


def visible_slots(positions, causal: bool, window: int | None):
    """dflash.attention_mask over the committed context and the block as one run of slots: the block
    (W rows at `positions`) sits right after the context, so each row sees one contiguous range of
    slots, first..last (W,) (first None: from 0)."""
    W = len(positions)
    last = positions if causal else positions[-1].expand(W)                             # (W,)
    if window is None:
        return None, last
    if not causal:   # a window on both sides
        last = torch.minimum(last, positions + window - 1)
    return (positions - window + 1).clamp(min=0), last


def draft_block(drafter: FusedDrafter, buf: Buffers, block_embeds):
    """dflash.draft_block over the static context: the block's k/v go into the context buffers at its
    slots start..start+W-1 (past the committed context, overwritten by the next append), and each row
    attends to a range of slots there."""
    W, device = len(block_embeds), block_embeds.device
    positions = buf.start + torch.arange(W, device=device)                             # (W,)
    x, tables = block_embeds, drafter.module.rope_tables(positions, block_embeds.dtype)   # x (W, H)
    for l, layer in enumerate(drafter.module.layers):
        first, last = visible_slots(positions, layer.causal, layer.window)
        x = draft_layer(layer, drafter.gate_up[l], buf.ctx_keys[l], buf.ctx_values[l], x,
                        tables[layer.self_attn.rope_theta], positions, first, last)     # (W, H)
    return drafter.module.norm(x)                                                       # (W, H)


def read_drafts(drafter: Drafter, hidden, target, anchor, sampling: Sampling, uniforms):
    """dflash.read_drafts with kernels' `candidate_walk` and `sample`, Triton kernels on CUDA: a DFlash2
    drafter's walk, or a DFlash drafter's drafts drawn from its p, all rows at once."""
    logits = drafter.draft_logits(hidden, target.get_output_embeddings())              # (N, V)
    if drafter.candidate_selector is not None:
        drafts, candidates, q = candidate_walk(drafter.candidate_selector, hidden, logits, anchor,
                                               sampling.temperature, uniforms)
        return drafts, None if q is None else torch.zeros_like(logits, dtype=q.dtype).scatter(-1, candidates, q)
    if sampling.temperature == 0 or sampling.drafts == "argmax":
        return logits.argmax(-1), None                                                  # (N,)
    q = dflash.target_probs(logits, sampling)                                           # (N, V)
    return sample(q, uniforms[:len(q)]), q


def propose(drafter: FusedDrafter, buf: Buffers, block, target, count: int, sampling: Sampling, uniforms):
    """dflash.propose over the static context: drafts (count,) and their q (count, V) or None."""
    hidden = draft_block(drafter, buf, dflash.embed_block(drafter.module, block, target))   # (W, H)
    return read_drafts(drafter.module, hidden[1:1 + count], target, block[0], sampling, uniforms)


# -----------------------------------------------------------------------------
# Verification on the device

def verify(drafts, logits, sampling: Sampling, uniforms, max_accept, draft_probs=None):
    """dflash.verify on the device with fixed shapes: drafts (K,), logits (K+1, V), their q (K, V) or None
    (one-hot). Acceptance is capped at `max_accept` drafts; returns (accepted, next token) as 0-d tensors,
    with no sync."""
    K = len(drafts)
    if sampling.temperature == 0:
        target_tokens = logits.argmax(-1)                                                 # (K+1,)
        matches = (drafts == target_tokens[:-1]).long()                                   # (K,)
        accepted = torch.minimum(matches.cumprod(0).sum(), max_accept)   # cumprod: zero after a miss
        return accepted, target_tokens.gather(0, accepted[None])[0]
    probs = dflash.target_probs(logits, sampling)                                         # (K+1, V)
    if draft_probs is None:   # the argmax proposal: q one-hot at each draft
        draft_probs = torch.zeros_like(probs[:-1]).scatter(-1, drafts[:, None], 1.0)      # (K, V)
    p_draft = probs[:-1].gather(-1, drafts[:, None])[:, 0]                                # (K,)
    q_draft = draft_probs.gather(-1, drafts[:, None])[:, 0].to(p_draft.dtype)             # (K,)
    run = (uniforms[:K] * q_draft < p_draft).long().cumprod(0).sum()   # accept d_i with probability min(1, p/q)
    accepted = torch.minimum(run, max_accept)
    row = probs.index_select(0, accepted[None])[0]                                        # (V,) p_a
    q_row = torch.cat([draft_probs, draft_probs.new_zeros(1, probs.shape[-1])]).index_select(0, accepted[None])[0]   # (V,) q_{a+1}
    dist = torch.where(run < max_accept, dflash.residual(row, q_row.to(row.dtype)), row)   # a draft was rejected
    return accepted, sample(dist, uniforms[-1])


# -----------------------------------------------------------------------------
# Generation: the loop of dflash.generate over a Decoder's buffers, one host read per step

PREFILL_CHUNK = 512   # prompt positions per prefill forward


def capacity_for(prompt_len: int, max_new_tokens: int, K: int) -> int:
    """Buffer positions a request needs (the last step verifies K+1 rows from P+max_new-2), rounded
    up to a multiple of 256 so that similar requests can share a Decoder and its graphs."""
    return -(-(prompt_len + max_new_tokens + K) // 256) * 256


def uncapturable(err: Exception) -> bool:
    """The failures of a step with data-dependent control flow, which then runs eagerly: dynamo cannot
    trace it as one graph, or it reads a device value on the host while a CUDA graph is captured."""
    capture_error = isinstance(err, RuntimeError) and "captur" in str(err)
    return isinstance(err, torch._dynamo.exc.Unsupported) or capture_error


class Decoder:
    """The static buffers, fused weights and (on CUDA) captured graphs of one target/drafter pair at one
    capacity, K, compute width and sampling setting. Callers hold it for as many requests as they like,
    and close() it to remove the target's capture hooks. The drafter's context k/v rows are copied when
    it is built (fuse_drafter): a drafter whose weights change afterwards needs a new Decoder, and
    generate() refuses to run with the old one."""

    def __init__(self, target, drafter: Drafter | None, capacity: int, num_drafts: int, full_block: bool = True,
                 sampling: Sampling = Sampling()):
        dflash.require(drafter is not None or num_drafts == 0, f"fastpath.Decoder: num_drafts = {num_drafts} "
                       "without a drafter (target-only decoding drafts nothing: 0)")
        self.target, self.drafter, self._sampling = target, drafter, sampling
        self.capacity, self.K = capacity, num_drafts
        self.device, K = target.get_input_embeddings().weight.device, num_drafts
        layer_ids = [] if drafter is None else drafter.config.target_layer_ids
        counter = lambda dtype=torch.long, n=(): torch.zeros(n, dtype=dtype, device=self.device)
        ctx_keys = ctx_values = []
        if drafter is not None:
            cfg = drafter.config
            self.fused = fuse_drafter(drafter)
            width = cfg.block_size if full_block else K + 1
            self.mask_ids = torch.full((width - 1,), cfg.mask_token_id, device=self.device)   # (W-1,)
            shape, like = (cfg.num_kv_heads, capacity + width, cfg.head_dim), drafter.fc.weight   # + the block
            ctx_keys, ctx_values = zeros(cfg.num_layers, shape, like), zeros(cfg.num_layers, shape, like)
        # last of the large allocations: a ModelTarget's hooks stay on the target until close()
        self.target_stack = (DenseTarget if DenseTarget.supports(target) else ModelTarget)(target, layer_ids, capacity)
        # what the fused matrices and the context rows were copied from, checked before each request
        self.weights = [weight_state(m) for m in (target, drafter) if m is not None]
        self.closed = False
        # drafts are drawn, not argmaxes: a DFlash2 drafter's walk at T > 0, or a DFlash one's with drafts "sampled"
        self.draws_drafts = drafter is not None and sampling.temperature > 0 and \
            (drafter.candidate_selector is not None or sampling.drafts == "sampled")
        V = target.get_output_embeddings().weight.shape[0]
        self.buf = Buffers(start=counter(), max_accept=counter(), uniforms=counter(torch.float64, K + 1),
                           verify_ids=counter(n=K + 1), result=counter(n=2 * K + 2),
                           target_keys=self.target_stack.keys, target_values=self.target_stack.values,
                           ctx_keys=ctx_keys, ctx_values=ctx_values,
                           draft_uniforms=counter(torch.float64, K) if self.draws_drafts else None,
                           draft_probs=counter(torch.float32, (K, V)) if self.draws_drafts else None)
        # The captured draft/verify graphs, captured on the first CUDA step; False: the parts run eagerly.
        self.graphs = None if self.device.type == "cuda" else False

    @property
    def sampling(self) -> Sampling:
        """Fixed when the Decoder is built (no setter): the captured graphs hold it."""
        return self._sampling

    def close(self):
        self.target_stack.close()
        self.closed = True

    def prefill(self, prompt_ids: list[int]) -> int:
        """Eager, variable length, PREFILL_CHUNK positions at a time (attention scores are chunk × C):
        fill the target K/V and the drafter context for the prompt."""
        buf, ids = self.buf, torch.tensor(prompt_ids, device=self.device)               # (P,)
        buf.max_accept.zero_()
        for first in range(0, len(ids), PREFILL_CHUNK):
            positions = torch.arange(first, min(first + PREFILL_CHUNK, len(ids)), device=self.device)
            logits, features = self.target_stack.forward(ids[positions], positions)     # (n, V), (n, n·H)
            if self.drafter is not None:
                append_context(self.fused, buf, self.drafter.project_context(features), positions)
        _, bonus = verify(buf.verify_ids[:0], logits[-1:], self.sampling, buf.uniforms, buf.max_accept)
        buf.start.fill_(len(ids))
        buf.verify_ids[0] = bonus
        return int(bonus)

    def draft_step(self):
        """Draft K tokens into verify_ids[1:]."""
        buf = self.buf
        block = torch.cat([buf.verify_ids[:1], self.mask_ids])                          # (W,)
        drafts, q = propose(self.fused, buf, block, self.target, self.K, self.sampling, buf.draft_uniforms)
        buf.verify_ids[1:] = drafts                                                     # (K,)
        if q is not None:
            buf.draft_probs.copy_(q)                                                    # (K, V)

    def verify_step(self):
        """Verify K+1 tokens with capture, accept on the device, append the context, advance."""
        buf, K = self.buf, self.K
        positions = buf.start + torch.arange(K + 1, device=self.device)                 # (K+1,)
        logits, features = self.target_stack.forward(buf.verify_ids, positions)         # (K+1, V)
        accepted, bonus = verify(buf.verify_ids[1:], logits, self.sampling, buf.uniforms, buf.max_accept,
                                 buf.draft_probs)
        if self.drafter is not None:   # all K+1 rows; rows past `accepted` are masked, then overwritten
            append_context(self.fused, buf, self.drafter.project_context(features), positions)
        drafts = buf.verify_ids[1:]                                                     # (K,)
        emitted = torch.where(torch.arange(K + 1, device=self.device) < accepted,
                              torch.cat([drafts, bonus[None]]), bonus)                  # (K+1,) d_1..d_a, t_a, ...
        buf.result.copy_(torch.cat([accepted[None], emitted, drafts]))
        buf.verify_ids[0] = bonus
        buf.start.add_(accepted + 1)

    def parts(self) -> dict:
        return {"draft": self.draft_step, "verify": self.verify_step} if self.drafter is not None else \
            {"verify": self.verify_step}

    def step(self):
        """One step: on CUDA the captured graphs' replays (captured on first use), else the parts eagerly."""
        if self.graphs is None:
            try:
                self.graphs = self.capture_graphs()
            except Exception as err:
                if not uncapturable(err):
                    raise
                print(f"fastpath: the step cannot be captured as CUDA graphs ({type(err).__name__}: "
                      f"{str(err).splitlines()[0][:160]}); running it eagerly with the same buffers.", file=sys.stderr)
                self.graphs = False
        if self.graphs:
            for graph in self.graphs.values():
                graph.replay()
        else:
            for part in self.parts().values():
                part()

    def capture_graphs(self) -> dict:
        """Compile the draft and the verify part, warm them up on a side stream, then capture each as a
        CUDA graph. Warm-up writes the buffers, so they are restored afterwards (also after a failure:
        the eager step then starts from the same state)."""
        saved = [t.clone() for t in self.buf.tensors()]
        try:   # every Decoder compiles the same methods anew; a captured graph no longer needs its code
            with torch._dynamo.config.patch(recompile_limit=1024):
                # static shapes: a second Decoder in one process (another K or capacity) would otherwise
                # recompile these methods with symbolic sizes (dynamo's automatic dynamic)
                compiled = {name: torch.compile(fn, fullgraph=True, dynamic=False) for name, fn in self.parts().items()}
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(3):
                        for fn in compiled.values():
                            fn()
                torch.cuda.current_stream().wait_stream(stream)
                graphs = {name: torch.cuda.CUDAGraph() for name in compiled}
                for name, fn in compiled.items():
                    with torch.cuda.graph(graphs[name]):
                        fn()
            return graphs
        finally:
            for t, s in zip(self.buf.tensors(), saved):
                t.copy_(s)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, stop_ids=(), on_tokens=None,
                 seed: int | None = None) -> Generation:
        """dflash.generate with this Decoder's K, width and sampling; the same seed draws the same
        uniforms, so sampled runs match too. A request past the capacity is refused before anything
        is written."""
        K, buf = self.K, self.buf
        dflash.require(not self.closed, "fastpath.Decoder: closed; build a new Decoder")
        dflash.require(self.weights == [weight_state(m) for m in (self.target, self.drafter) if m is not None],
                       "fastpath.Decoder: the target's or drafter's weights changed after this Decoder was built, "
                       "and it holds fused copies of them; build a new Decoder")
        dflash.check_request(prompt_ids, max_new_tokens, K, **dflash.request_limits(self.target, self.drafter))
        dflash.require(len(prompt_ids) + max_new_tokens + K <= self.capacity, f"prompt + --max-new-tokens + K = "
                       f"{len(prompt_ids)} + {max_new_tokens} + {K} exceeds the buffer capacity {self.capacity}")
        stops, generator, on_tokens = set(stop_ids), torch.Generator(self.device), on_tokens or (lambda tokens: None)
        generator.seed() if seed is None else generator.manual_seed(seed)
        # Kernels outside the graphs, with no sync: the graphs read the buffers. As dflash.generate: a round
        # draws its drafts' K uniforms (where drafts are drawn), then the K+1 of its verification.
        draw = lambda into: torch.rand(len(into), generator=generator, device=self.device, dtype=torch.float64,
                                       out=into)
        draw(buf.uniforms)
        bonus = self.prefill(prompt_ids)
        out = Generation(tokens=[bonus], position_accepted=[0] * K, position_drafted=[0] * K)
        try:   # Ctrl-C from here on: what was committed comes back with the exception
            on_tokens([bonus])
            while bonus not in stops and len(out.tokens) < max_new_tokens:
                k = min(K, max_new_tokens - len(out.tokens) - 1)   # never draft past max_new_tokens
                buf.max_accept.fill_(k)
                if self.draws_drafts:
                    draw(buf.draft_uniforms)
                draw(buf.uniforms)
                self.step()
                result = buf.result.tolist()                      # the one host sync of the step
                accepted = result[0]
                new_tokens, drafts = result[1:accepted + 2], result[K + 2:K + 2 + k]

                new_tokens = out.commit(drafts, accepted, new_tokens, stops)
                bonus = new_tokens[-1]
                on_tokens(new_tokens)
        except KeyboardInterrupt:
            out.interrupted = True
            raise dflash.Interrupted(out) from None
        return out


def generate(target, drafter, prompt_ids: list[int], max_new_tokens: int, *, num_drafts: int | None = None,
             full_block: bool = True, stop_ids=(), on_tokens=None, sampling: Sampling = Sampling(),
             seed: int | None = None, capacity: int | None = None) -> Generation:
    """dflash.generate's signature through a Decoder built for this one request (compiled and captured
    anew on CUDA); hold a Decoder to serve many. `capacity` defaults to what the request needs."""
    K = 0 if drafter is None else drafter.config.block_size - 1 if num_drafts is None else num_drafts
    dflash.check_request(prompt_ids, max_new_tokens, K, **dflash.request_limits(target, drafter))
    capacity = capacity_for(len(prompt_ids), max_new_tokens, K) if capacity is None else capacity
    with closing(Decoder(target, drafter, capacity, K, full_block, sampling)) as decoder:
        return decoder.generate(prompt_ids, max_new_tokens, stop_ids=stop_ids, on_tokens=on_tokens, seed=seed)


if __name__ == "__main__":   # the demo program, dflash_reference/demo.py, decoding through this file
    import runpy
    runpy.run_module("dflash_reference.demo", {"DECODER": "fastpath"}, "__main__")
