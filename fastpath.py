"""DFlash speculative decoding: the fast path.

The same math as `dflash.py`, token for token, arranged for a GPU. What differs:
  - static buffers: the target's KV cache, the drafter's context K/V (after k_norm and RoPE),
    and the token/position counters are allocated once, sized by `capacity`;
  - fixed shapes: every step drafts a full block and verifies K+1 tokens; acceptance is applied
    by device-side counters (the next step simply overwrites rejected rows, which masks hide);
  - fused weights: projections that read the same input are one matmul ([q;k;v], [gate;up]);
    the modules' own weights become views into the fused matrix, so nothing is stored twice;
    each drafter layer's context K/V projections are stacked into one matrix, and for Laguna the
    input norm's weight is folded into it (one shared 1/rms, in fp32);
  - dense Llama/Qwen3 targets run their layers here, over a static K/V buffer, with attention as
    a masked softmax that the compiler fuses (grouped heads share K/V, nothing is repeated); any
    other target (Laguna's MoE, sliding windows, biases) runs its own forward over a static cache;
  - compiled, graphed step: on CUDA the draft block, and the target verify with capture, accept
    and context append, are each compiled with torch.compile and captured as a CUDA graph;
  - one host sync per step: reading the accepted tokens.
On CPU the same code runs eagerly, without graphs, so the reference-equality tests run anywhere.

    $ python fastpath.py --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --prompt "Hi"

Shape legend as in dflash.py, plus C the buffer capacity in positions and g = h / hk the query
heads per K/V head.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import dflash
from dflash import DFlashError, Drafter, Generation, project_context, rope


# -----------------------------------------------------------------------------
# Static state: every buffer of one generation, allocated once

@dataclass
class Buffers:
    start: torch.Tensor          # ()          position of the bonus token = committed length - 1
    max_accept: torch.Tensor     # ()          drafts that may be accepted this step (k ≤ K)
    uniforms: torch.Tensor       # (K+1,)      float64 uniforms of this step's sampling, drawn outside graphs
    verify_ids: torch.Tensor     # (K+1,)      [bonus, d_1..d_K], the verify input
    result: torch.Tensor         # (2K+2,)     [a, d_1..d_a, t_a, padding (K+1 in all), d_1..d_K]
    # One tensor per layer, not one (L, …) tensor: a compiled in-place write into a slice of a larger
    # buffer is lowered to a copy of the whole buffer, per layer.
    ctx_keys: list[torch.Tensor]     # L × (hk, C, d)  drafter context keys after k_norm and RoPE
    ctx_values: list[torch.Tensor]   # L × (hk, C, d)  drafter context values


# -----------------------------------------------------------------------------
# Shared pieces: fused projections, attention over a static buffer

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
    with torch.inference_mode(False), torch.no_grad():   # ordinary tensors: the model may be trained later
        fused = torch.cat([w.detach() for w in weights])                                # (ΣN, H)
        offset = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = fused[offset:offset + n]
            offset += n
    return fused


def attend(q, keys, values, mask, scale: float):
    """Masked softmax attention of q (N, h, d) over keys/values (hk, S, d), mask (N, S) -> (N, h·d).
    The g query heads of each K/V head are stacked as rows, so K/V are read once and never repeated.
    As transformers' eager attention: scores in the working dtype, softmax in fp32. Compiled, this is
    two batched matmuls and a fused masked softmax, for any S."""
    N, h, d = q.shape
    hk, S, g = keys.shape[0], keys.shape[1], h // keys.shape[0]
    q = q.view(N, hk, g, d).permute(1, 2, 0, 3).reshape(hk, g * N, d)                 # (hk, g·N, d)
    scores = (q @ keys.transpose(1, 2)) * scale                                        # (hk, g·N, S)
    scores = scores.view(hk, g, N, S).masked_fill(~mask, float("-inf"))                # (hk, g, N, S)
    p = scores.softmax(-1, dtype=torch.float32).to(values.dtype).view(hk, g * N, S)
    o = p @ values                                                                      # (hk, g·N, d)
    return o.view(hk, g, N, d).permute(2, 0, 1, 3).reshape(N, h * d)                   # (N, h·d)


# -----------------------------------------------------------------------------
# Drafter: fused block projections, context K/V folded into one matrix per layer

@dataclass
class FusedDrafter:
    module: Drafter
    qkv: list[torch.Tensor]      # per layer (h·d + 2·hk·d, H)  [q; k; v]
    gate_up: list[torch.Tensor]  # per layer (2·I, H)           [gate; up]
    context_kv: torch.Tensor     # (L·2·hk·d, H)  [k rows; v rows] per layer, Laguna input norm folded in


def fuse_drafter(drafter: Drafter) -> FusedDrafter:
    """Fuse [q;k;v] and [gate;up] per layer, and stack every layer's context k/v rows; for Laguna
    scale those columns by the input-norm weight, so that W·(w ⊙ c/rms(c)) = (W·diag(w))·(c/rms(c))."""
    cfg, rows = drafter.config, []
    hd, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv, gate_up = [], []
    for layer in drafter.layers:
        attn = layer.self_attn
        w = attn.qkv_proj.weight if cfg.laguna else fused_weight([attn.q_proj, attn.k_proj, attn.v_proj])
        qkv.append(w)                                                                   # (hd + 2·kv, H)
        gate_up.append(fused_weight([layer.mlp.gate_proj, layer.mlp.up_proj]))          # (2·I, H)
        with torch.inference_mode(False), torch.no_grad():
            rows.append(w[hd:] * layer.input_layernorm.weight[None] if cfg.laguna else w[hd:])
    assert all(r.shape[0] == 2 * kv for r in rows)
    return FusedDrafter(drafter, qkv, gate_up, torch.cat(rows))


def append_context(drafter: FusedDrafter, buf: Buffers, c, positions):
    """KV injection into the static buffers: context rows c (N, H) at `positions` (N,) for all
    layers with one matmul. Rows past the accepted ones are written too; masks hide them and the
    next step overwrites them."""
    cfg = drafter.module.config
    L, hk, d, N = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, len(c)
    if cfg.laguna:
        cf = c.to(torch.promote_types(c.dtype, torch.float32))
        c = (cf * torch.rsqrt(cf.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(c.dtype)
    kv = (c @ drafter.context_kv.T).view(N, L, 2, hk, d)                               # (N, L, 2, hk, d)
    for l, layer in enumerate(drafter.module.layers):
        k = rope(layer.self_attn.k_norm(kv[:, l, 0]), positions, cfg.rope_thetas[l])   # (N, hk, d)
        buf.ctx_keys[l].index_copy_(1, positions, k.transpose(0, 1))
        buf.ctx_values[l].index_copy_(1, positions, kv[:, l, 1].transpose(0, 1))


def attention_mask(q_pos, k_pos, causal: bool, window: int | None):
    """dflash.attention_mask, always as a tensor (fixed shapes need one even for no masking)."""
    mask = dflash.attention_mask(q_pos, k_pos, causal, window)
    return torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=q_pos.device) if mask is None else mask


def draft_block(drafter: FusedDrafter, buf: Buffers, block_embeds):
    """dflash.draft_block over the static context: keys are all C buffer rows plus the block, and
    context rows at positions ≥ start (not yet committed) are masked out."""
    cfg, W, C = drafter.module.config, len(block_embeds), buf.ctx_keys[0].shape[1]
    h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    device = block_embeds.device
    positions = buf.start + torch.arange(W, device=device)                             # (W,)
    key_positions = torch.cat([torch.arange(C, device=device), positions])             # (C+W,)
    committed = torch.cat([torch.arange(C, device=device) < buf.start,
                           torch.ones(W, dtype=torch.bool, device=device)])             # (C+W,)
    x = block_embeds                                                                    # (W, H)
    for l, layer in enumerate(drafter.module.layers):
        attn, theta = layer.self_attn, cfg.rope_thetas[l]
        u = layer.input_layernorm(x)                                                    # (W, H)
        q, k, v = (u @ drafter.qkv[l].T).split([h * d, hk * d, hk * d], dim=-1)
        q = rope(attn.q_norm(q.view(W, h, d)), positions, theta)                        # (W, h, d)
        k = rope(attn.k_norm(k.view(W, hk, d)), positions, theta).transpose(0, 1)       # (hk, W, d)
        keys = torch.cat([buf.ctx_keys[l], k], dim=1)                                   # (hk, C+W, d)
        values = torch.cat([buf.ctx_values[l], v.view(W, hk, d).transpose(0, 1)], dim=1)  # (hk, C+W, d)
        mask = attention_mask(positions, key_positions, cfg.is_causal(l), cfg.window(l)) & committed
        o = attend(q, keys, values, mask, d ** -0.5).view(W, h, d)                     # (W, h, d)
        if cfg.laguna:
            o = dflash.gate(attn, u, o)
        x = x + attn.o_proj(o.reshape(W, -1))                                           # (W, H)
        gate, up = (layer.post_attention_layernorm(x) @ drafter.gate_up[l].T).chunk(2, dim=-1)
        x = x + layer.mlp.down_proj(F.silu(gate) * up)                                  # (W, H)
    return drafter.module.norm(x)                                                       # (W, H)


def propose(drafter: FusedDrafter, buf: Buffers, block, target):
    """Greedy drafts for block ids (W,): rows 1..W-1 through the target's LM head."""
    hidden = draft_block(drafter, buf, target.get_input_embeddings()(block))           # (W, H)
    return target.get_output_embeddings()(hidden[1:]).argmax(-1)                       # (W-1,)


# -----------------------------------------------------------------------------
# Target: forward with capture at explicit device positions, into static K/V

class DenseTarget:
    """A Llama/Qwen3 decoder stack run here: one [q;k;v] and one [gate;up] matmul per layer, K/V in
    static per-layer (hk, C, d) buffers, attention by `attend`. Embedding, norms, rotary embedding, o/down
    projections and LM head are the model's own modules, so the math is the model's."""

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

    def __init__(self, target, layer_ids: list[int], capacity: int):
        self.target, self.layer_ids = target, layer_ids
        self.layers = dflash.decoder_layers(target)
        self.qkv = [fused_weight([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.layers]
        self.gate_up = [fused_weight([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers]
        attn, w = self.layers[0].self_attn, self.qkv[0]
        self.head_dim, self.num_kv_heads = attn.head_dim, target.config.num_key_value_heads
        self.apply_rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb   # the model's own RoPE
        shape = (self.num_kv_heads, capacity, self.head_dim)   # per layer: see Buffers
        self.keys = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in self.layers]    # T × (hk, C, d)
        self.values = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in self.layers]  # T × (hk, C, d)
        self.key_positions = torch.arange(capacity, device=w.device)                    # (C,)

    def forward(self, ids, positions):
        """ids (N,) at positions (N,) -> logits (N, V), captured features (N, n·H)."""
        model, N, d, hk = self.target.model, len(ids), self.head_dim, self.num_kv_heads
        x = model.embed_tokens(ids)                                                     # (N, H)
        cos, sin = (t[0] for t in model.rotary_emb(x[None], positions[None]))           # (N, d)
        mask = self.key_positions[None] <= positions[:, None]                           # (N, C) causal
        captured = {}
        for l, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = (layer.input_layernorm(x) @ self.qkv[l].T).split(
                [self.qkv[l].shape[0] - 2 * hk * d, hk * d, hk * d], dim=-1)
            q, k, v = q.view(N, -1, d), k.view(N, hk, d), v.view(N, hk, d)
            if hasattr(attn, "q_norm"):   # Qwen3 normalises q and k per head before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self.apply_rotary(q, k, cos, sin)                                    # cos, sin as (N, 1, d)
            self.keys[l].index_copy_(1, positions, k.transpose(0, 1))
            self.values[l].index_copy_(1, positions, v.transpose(0, 1))
            x = x + attn.o_proj(attend(q, self.keys[l], self.values[l], mask, attn.scaling))
            gate, up = (layer.post_attention_layernorm(x) @ self.gate_up[l].T).chunk(2, dim=-1)
            x = x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)                    # (N, H)
            captured[l] = x
        features = torch.cat([captured[i] for i in self.layer_ids], -1) if self.layer_ids else None
        return self.target.lm_head(model.norm(x)), features                             # (N, V), (N, n·H)

    def state_tensors(self):
        return self.keys + self.values

    def close(self):
        pass


class ModelTarget:
    """Any other target (Laguna's MoE, sliding windows, biases) through its own forward, over a
    static cache whose layers are all full length, so that rolling back is only moving a counter;
    sliding layers still get their window from the model's own mask."""

    def __init__(self, target, layer_ids: list[int], capacity: int):
        from transformers.cache_utils import Cache, StaticLayer
        self.target = target
        num_layers = target.config.get_text_config().num_hidden_layers
        self.cache = Cache(layers=[StaticLayer(max_cache_len=capacity) for _ in range(num_layers)])
        self.capture = dflash.Capture(target, layer_ids)   # hooks registered once, not inside a compiled step

    def forward(self, ids, positions):
        """dflash.target_forward at device positions (N,) -> logits (N, V), features (N, n·H)."""
        for layer in self.cache.layers:   # write position of every layer: a device copy, no sync
            layer.cumulative_length.copy_(positions[0])
        out = self.target(input_ids=ids[None], position_ids=positions[None], use_cache=True,
                          **{dflash.cache_kwarg(self.target): self.cache})
        return out.logits[0], self.capture.features()

    def state_tensors(self):
        return [t for layer in self.cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]

    def close(self):
        self.capture.remove()


# -----------------------------------------------------------------------------
# Acceptance on the device

def verify(drafts, logits, sampling: dflash.Sampling, uniforms, max_accept):
    """dflash.verify on the device with fixed shapes: drafts (K,), logits (K+1, V). Acceptance is
    capped at `max_accept` drafts; returns (accepted, next token) as 0-d tensors, with no sync."""
    K = len(drafts)
    if sampling.temperature == 0:
        target_tokens = logits.argmax(-1)                                                 # (K+1,)
        matches = (drafts == target_tokens[:-1]).long()                                   # (K,)
        accepted = torch.minimum(matches.cumprod(0).sum(), max_accept)   # cumprod: zero after a miss
        return accepted, target_tokens.gather(0, accepted[None])[0]
    probs = dflash.target_probs(logits, sampling)                                         # (K+1, V)
    p_draft = probs[:-1].gather(-1, drafts[:, None])[:, 0]                                # (K,)
    run = (uniforms[:K] < p_draft).long().cumprod(0).sum()        # accept d_i with probability p(d_i)
    accepted = torch.minimum(run, max_accept)
    row = probs.index_select(0, accepted[None])[0]                                        # (V,) p_a
    rejected = torch.cat([drafts, drafts.new_zeros(1)]).gather(0, accepted[None])[0]      # () d_{a+1}
    dist = torch.where(run < max_accept, dflash.residual(row, rejected), row)   # a draft was rejected
    return accepted, dflash.sample(dist, uniforms[-1])


# -----------------------------------------------------------------------------
# One step, fixed shapes: draft, verify, accept, append. Compiled and graphed on CUDA.

PREFILL_CHUNK = 512   # prompt positions per prefill forward


class Decoder:
    """Owns the static buffers and the step for one target/drafter pair and capacity."""

    def __init__(self, target, drafter: Drafter | None, capacity: int, num_drafts: int, full_block: bool,
                 sampling: dflash.Sampling = dflash.Sampling()):
        self.target, self.drafter, self.capacity, self.K = target, drafter, capacity, num_drafts
        self.sampling = sampling
        self.device = target.get_input_embeddings().weight.device
        layer_ids = [] if drafter is None else drafter.config.target_layer_ids
        self.target_stack = (DenseTarget if DenseTarget.supports(target) else ModelTarget)(target, layer_ids, capacity)
        dev, K = self.device, num_drafts
        num_layers, ctx_shape, dtype = 0, None, None
        if drafter is not None:
            cfg, dtype = drafter.config, next(drafter.parameters()).dtype
            num_layers, ctx_shape = cfg.num_layers, (cfg.num_kv_heads, capacity, cfg.head_dim)
            self.fused = fuse_drafter(drafter)
            width = cfg.block_size if full_block else K + 1
            self.mask_ids = torch.full((width - 1,), cfg.mask_token_id, device=dev)    # (W-1,)
        self.buf = Buffers(
            start=torch.zeros((), dtype=torch.long, device=dev),
            max_accept=torch.zeros((), dtype=torch.long, device=dev),
            uniforms=torch.zeros(K + 1, dtype=torch.float64, device=dev),
            verify_ids=torch.zeros(K + 1, dtype=torch.long, device=dev),
            result=torch.zeros(2 * K + 2, dtype=torch.long, device=dev),
            ctx_keys=[torch.zeros(ctx_shape, dtype=dtype, device=dev) for _ in range(num_layers)],
            ctx_values=[torch.zeros(ctx_shape, dtype=dtype, device=dev) for _ in range(num_layers)])
        self.graphs = None         # the captured draft/verify graphs on CUDA; False if uncapturable

    def prefill(self, prompt_ids: list[int]) -> int:
        """Eager, variable length, PREFILL_CHUNK positions at a time (attention scores are chunk × C):
        fill the target K/V and the drafter context for the prompt."""
        buf, ids = self.buf, torch.tensor(prompt_ids, device=self.device)               # (P,)
        buf.max_accept.zero_()
        for first in range(0, len(ids), PREFILL_CHUNK):
            positions = torch.arange(first, min(first + PREFILL_CHUNK, len(ids)), device=self.device)
            logits, features = self.target_stack.forward(ids[positions], positions)     # (n, V), (n, n·H)
            if self.drafter is not None:
                append_context(self.fused, buf, project_context(self.drafter, features), positions)
        _, bonus = verify(buf.verify_ids[:0], logits[-1:], self.sampling, buf.uniforms, buf.max_accept)
        buf.start.fill_(len(ids))
        buf.verify_ids[0] = bonus
        return int(bonus)

    def step(self):
        """Draft K tokens, verify K+1 with capture, accept on the device, append context, advance."""
        if self.drafter is not None:
            self.draft()
        self.verify()

    def draft(self):
        buf = self.buf
        block = torch.cat([buf.verify_ids[:1], self.mask_ids])                          # (W,)
        buf.verify_ids[1:] = propose(self.fused, buf, block, self.target)[:self.K]      # (K,)

    def verify(self):
        buf, K = self.buf, self.K
        positions = buf.start + torch.arange(K + 1, device=self.device)                 # (K+1,)
        logits, features = self.target_stack.forward(buf.verify_ids, positions)         # (K+1, V)
        accepted, bonus = verify(buf.verify_ids[1:], logits, self.sampling, buf.uniforms, buf.max_accept)
        if self.drafter is not None:   # all K+1 rows; rows past `accepted` are masked, then overwritten
            append_context(self.fused, buf, project_context(self.drafter, features), positions)
        drafts = buf.verify_ids[1:]                                                     # (K,)
        emitted = torch.where(torch.arange(K + 1, device=self.device) < accepted,
                              torch.cat([drafts, bonus[None]]), bonus)                  # (K+1,) d_1..d_a, t_a, ...
        buf.result.copy_(torch.cat([accepted[None], emitted, drafts]))
        buf.verify_ids[0] = bonus
        buf.start.add_(accepted + 1)

    def run_step(self):
        """One step; on CUDA, replay the captured draft and verify graphs (captured on first use)."""
        if self.device.type != "cuda" or self.graphs is False:
            return self.step()
        if self.graphs is None:
            try:
                self.capture()
            except (torch._dynamo.exc.TorchDynamoException, RuntimeError) as err:
                # A target whose forward has data-dependent control flow cannot be one graph: an MoE
                # whose experts loop over the tokens routed to them fails to compile, and transformers'
                # float32 grouped-mm fallback reads its expert offsets on the host, which a CUDA graph
                # cannot capture. Run the same step eagerly, with the same buffers.
                print(f"fastpath: the step cannot be compiled and captured as CUDA graphs ({type(err).__name__}: "
                      f"{str(err).splitlines()[0][:160]}); running it eagerly with the same buffers.",
                      file=sys.stderr)
                self.graphs = False
                return self.step()
        for graph in self.graphs.values():
            graph.replay()

    def capture(self):
        """Compile the draft and the verify part, warm them up on a side stream, then capture each
        as a CUDA graph. Warm-up runs on a throwaway state, which is restored afterwards."""
        saved = [t.clone() for t in self.state_tensors()]
        try:
            self.graphs = self.compile_and_capture()
        finally:   # also after a failed capture: the eager step then starts from the same state
            for t, s in zip(self.state_tensors(), saved):
                t.copy_(s)

    def compile_and_capture(self) -> dict:
        parts = {"draft": self.draft, "verify": self.verify} if self.drafter is not None else {"verify": self.verify}
        # Every Decoder compiles the same methods anew; a captured graph no longer needs its compiled code.
        with torch._dynamo.config.patch(recompile_limit=1024):
            compiled = {name: torch.compile(fn, fullgraph=True) for name, fn in parts.items()}
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

    def state_tensors(self):
        buf = self.buf
        tensors = [buf.start, buf.max_accept, buf.uniforms, buf.verify_ids, buf.result]
        tensors += self.target_stack.state_tensors()
        tensors += buf.ctx_keys + buf.ctx_values
        return tensors


# -----------------------------------------------------------------------------
# Generation: the loop of dflash.generate, one host read per step

_decoders: dict = {}
LIVE_DECODERS = 4   # e.g. target-only and DFlash side by side, as an evaluation alternates them


def decoder_for(target, drafter, capacity: int, K: int, full_block: bool, sampling) -> Decoder:
    """Reuse the buffers and captured graphs of an earlier call with the same shapes and sampling;
    the least recently used of more than LIVE_DECODERS is dropped, hooks and buffers with it."""
    key = (target, drafter, capacity, K, full_block, sampling)
    if key not in _decoders:
        while len(_decoders) >= LIVE_DECODERS:
            _decoders.pop(next(iter(_decoders))).target_stack.close()
        _decoders[key] = Decoder(target, drafter, capacity, K, full_block, sampling)
    _decoders[key] = _decoders.pop(key)   # most recently used last
    return _decoders[key]


def capacity_for(prompt_len: int, max_new_tokens: int, K: int) -> int:
    """Buffer positions a request needs (the last step verifies K+1 rows from P+max_new-2), rounded
    up to a multiple of 256 so that similar requests share buffers and captured graphs."""
    return -(-(prompt_len + max_new_tokens + K) // 256) * 256


@torch.inference_mode()
def generate(target, drafter, prompt_ids: list[int], max_new_tokens: int, *, num_drafts: int | None = None,
             full_block: bool = True, stop_ids=(), on_tokens=None, sampling: dflash.Sampling = dflash.Sampling(),
             seed: int | None = None, capacity: int | None = None) -> Generation:
    """dflash.generate with static buffers; the same seed draws the same uniforms, so sampled runs
    match too. `capacity` (positions) defaults to what this request needs, rounded up; a request
    past a given capacity is refused before anything is written."""
    K = 0 if drafter is None else drafter.config.block_size - 1 if num_drafts is None else num_drafts
    dflash.check_request(target, drafter, prompt_ids, max_new_tokens, K)
    capacity = capacity or capacity_for(len(prompt_ids), max_new_tokens, K)
    if len(prompt_ids) + max_new_tokens + K > capacity:
        raise DFlashError(f"prompt + max_new_tokens + K = {len(prompt_ids)} + {max_new_tokens} + {K} exceeds "
                          f"the buffer capacity {capacity}")
    dec = decoder_for(target, drafter, capacity, K, full_block, sampling)
    stops = set(stop_ids)
    generator = dflash.new_generator(dec.device, seed)

    def draw_uniforms():   # a kernel outside the graphs: no sync, and the graphs read the buffer
        torch.rand(K + 1, generator=generator, device=dec.device, dtype=torch.float64, out=dec.buf.uniforms)

    draw_uniforms()
    bonus = dec.prefill(prompt_ids)
    out = Generation(tokens=[bonus], position_accepted=[0] * K, position_drafted=[0] * K)
    if on_tokens:
        on_tokens([bonus])
    while bonus not in stops and len(out.tokens) < max_new_tokens:
        k = min(K, max_new_tokens - len(out.tokens) - 1)   # never draft past max_new_tokens
        dec.buf.max_accept.fill_(k)
        draw_uniforms()
        dec.run_step()
        result = dec.buf.result.tolist()                   # the one host sync of the step
        accepted = result[0]
        new_tokens, drafts = result[1:accepted + 2], result[K + 2:K + 2 + k]

        new_tokens = out.commit(drafts, accepted, new_tokens, stops)
        bonus = new_tokens[-1]
        if on_tokens:
            on_tokens(new_tokens)
    return out


if __name__ == "__main__":
    dflash.run_cli(dflash.main, generate_fn=generate)
