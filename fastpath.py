"""DFlash speculative decoding: the fast path.

The same math as `dflash.py`, token for token, arranged for a GPU. What differs:
  - static buffers: the target's KV cache, the drafter's context K/V (after k_norm and RoPE),
    and the token/position counters are allocated once, sized by `capacity`;
  - fixed shapes: every step drafts a full block and verifies K+1 tokens; acceptance is applied
    by device-side counters (the next step simply overwrites rejected rows, which masks hide);
  - folded weights: each drafter layer's context K/V projections are stacked into one matrix,
    and for Laguna the input norm's weight is folded into it (one shared 1/rms, in fp32);
  - compiled, graphed step: on CUDA the draft block, and the target verify with capture, accept
    and context append, are each compiled with torch.compile and captured as a CUDA graph;
  - one host sync per step: reading the accepted tokens.
On CPU the same code runs eagerly, without graphs, so the reference-equality tests run anywhere.

    $ python fastpath.py --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --prompt "Hi"

Shape legend as in dflash.py, plus C the buffer capacity in positions.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    target_cache: object         # HF Cache of T full-length static layers, (1, hk_t, C, d_t) each
    ctx_keys: torch.Tensor | None    # (L, hk, C, d)  drafter context keys after k_norm and RoPE
    ctx_values: torch.Tensor | None  # (L, hk, C, d)  drafter context values


def new_target_cache(target, capacity: int):
    """A static cache with every layer full-length, so that rolling back is only moving a counter;
    sliding layers still get their window from the model's own mask."""
    from transformers.cache_utils import Cache, StaticLayer
    num_layers = target.config.get_text_config().num_hidden_layers
    return Cache(layers=[StaticLayer(max_cache_len=capacity) for _ in range(num_layers)])


def set_cache_length(cache, length):
    """Point every static layer's write position at `length` (a device scalar): no sync."""
    for layer in cache.layers:
        layer.cumulative_length.copy_(length)


# -----------------------------------------------------------------------------
# Drafter: context K/V folded into one matrix per layer

@dataclass
class FoldedContext:
    weight: torch.Tensor         # (L·2·hk·d, H)  [k rows; v rows] per layer, Laguna norm folded in
    laguna: bool                 # apply the shared 1/rms of c before the folded projection


def fold_context_weights(drafter: Drafter) -> FoldedContext:
    """Stack each layer's k/v projection rows; for Laguna scale columns by the input-norm weight
    so that W·(w ⊙ c/rms(c)) = (W·diag(w))·(c/rms(c))."""
    cfg, rows = drafter.config, []
    kv = cfg.num_kv_heads * cfg.head_dim
    for layer in drafter.layers:
        attn = layer.self_attn
        if cfg.laguna:
            w_kv = attn.qkv_proj.weight[cfg.num_heads * cfg.head_dim:]                 # (2·hk·d, H)
            rows.append(w_kv * layer.input_layernorm.weight[None])
        else:
            rows.append(torch.cat([attn.k_proj.weight, attn.v_proj.weight]))          # (2·hk·d, H)
    assert all(r.shape[0] == 2 * kv for r in rows)
    return FoldedContext(torch.cat(rows), cfg.laguna)


def append_context(drafter: Drafter, folded: FoldedContext, buf: Buffers, c, positions):
    """KV injection into the static buffers: context rows c (N, H) at `positions` (N,) for all
    layers with one matmul. Rows past the accepted ones are written too; masks hide them and the
    next step overwrites them."""
    cfg = drafter.config
    L, hk, d, N = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, len(c)
    if folded.laguna:
        cf = c.to(torch.promote_types(c.dtype, torch.float32))
        c = (cf * torch.rsqrt(cf.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(c.dtype)
    kv = (c @ folded.weight.T).view(N, L, 2, hk, d)                                    # (N, L, 2, hk, d)
    for l, layer in enumerate(drafter.layers):
        k = rope(layer.self_attn.k_norm(kv[:, l, 0]), positions, cfg.rope_thetas[l])   # (N, hk, d)
        buf.ctx_keys[l].index_copy_(1, positions, k.transpose(0, 1))
        buf.ctx_values[l].index_copy_(1, positions, kv[:, l, 1].transpose(0, 1))


def attention_mask(q_pos, k_pos, causal: bool, window: int | None):
    """dflash.attention_mask, always as a tensor (fixed shapes need one even for no masking)."""
    mask = dflash.attention_mask(q_pos, k_pos, causal, window)
    return torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=q_pos.device) if mask is None else mask


def draft_block(drafter: Drafter, buf: Buffers, block_embeds):
    """dflash.draft_block over the static context: keys are all C buffer rows plus the block, and
    context rows at positions ≥ start (not yet committed) are masked out."""
    cfg, W, C = drafter.config, len(block_embeds), buf.ctx_keys.shape[2]
    device = block_embeds.device
    positions = buf.start + torch.arange(W, device=device)                             # (W,)
    key_positions = torch.cat([torch.arange(C, device=device), positions])             # (C+W,)
    committed = torch.cat([torch.arange(C, device=device) < buf.start,
                           torch.ones(W, dtype=torch.bool, device=device)])             # (C+W,)
    x = block_embeds                                                                    # (W, H)
    for l, layer in enumerate(drafter.layers):
        attn, theta = layer.self_attn, cfg.rope_thetas[l]
        u = layer.input_layernorm(x)                                                    # (W, H)
        q, k, v = attn.qkv(u)                                                           # (W, h|hk, d)
        q = rope(attn.q_norm(q), positions, theta).transpose(0, 1)                      # (h, W, d)
        k = rope(attn.k_norm(k), positions, theta).transpose(0, 1)                      # (hk, W, d)
        keys = torch.cat([buf.ctx_keys[l], k], dim=1)                                   # (hk, C+W, d)
        values = torch.cat([buf.ctx_values[l], v.transpose(0, 1)], dim=1)               # (hk, C+W, d)
        mask = attention_mask(positions, key_positions, cfg.is_causal(l), cfg.window(l)) & committed
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # (h, W, d)
        o = o.transpose(0, 1)                                                           # (W, h, d)
        if cfg.laguna:
            o = dflash.gate(attn, u, o)
        x = x + attn.o_proj(o.reshape(W, -1))                                           # (W, H)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)                                                              # (W, H)


def propose(drafter: Drafter, buf: Buffers, block, target):
    """Greedy drafts for block ids (W,): rows 1..W-1 through the target's LM head."""
    hidden = draft_block(drafter, buf, target.get_input_embeddings()(block))           # (W, H)
    return target.get_output_embeddings()(hidden[1:]).argmax(-1)                       # (W-1,)


# -----------------------------------------------------------------------------
# Target verify with capture, acceptance on the device

def target_forward(target, ids, positions, cache, capture: dflash.Capture):
    """dflash.target_forward at explicit device positions (N,), writing into the static cache."""
    out = target(input_ids=ids[None], position_ids=positions[None], use_cache=True,
                 **{dflash.cache_kwarg(target): cache})
    return out.logits[0], capture.features()                                          # (N, V), (N, n·H)


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

class Decoder:
    """Owns the static buffers and the step for one target/drafter pair and capacity."""

    def __init__(self, target, drafter: Drafter | None, capacity: int, num_drafts: int, full_block: bool,
                 sampling: dflash.Sampling = dflash.Sampling()):
        self.target, self.drafter, self.capacity, self.K = target, drafter, capacity, num_drafts
        self.sampling = sampling
        self.device = target.get_input_embeddings().weight.device
        # Hooks registered once, not inside a compiled step.
        self.capture_hooks = dflash.Capture(target, [] if drafter is None else drafter.config.target_layer_ids)
        dev, K = self.device, num_drafts
        ctx_shape = None
        if drafter is not None:
            cfg, dtype = drafter.config, next(drafter.parameters()).dtype
            ctx_shape = (cfg.num_layers, cfg.num_kv_heads, capacity, cfg.head_dim)
            self.folded = fold_context_weights(drafter)
            width = cfg.block_size if full_block else K + 1
            self.mask_ids = torch.full((width - 1,), cfg.mask_token_id, device=dev)    # (W-1,)
        self.buf = Buffers(
            start=torch.zeros((), dtype=torch.long, device=dev),
            max_accept=torch.zeros((), dtype=torch.long, device=dev),
            uniforms=torch.zeros(K + 1, dtype=torch.float64, device=dev),
            verify_ids=torch.zeros(K + 1, dtype=torch.long, device=dev),
            result=torch.zeros(2 * K + 2, dtype=torch.long, device=dev),
            target_cache=new_target_cache(target, capacity),
            ctx_keys=None if ctx_shape is None else torch.zeros(ctx_shape, dtype=dtype, device=dev),
            ctx_values=None if ctx_shape is None else torch.zeros(ctx_shape, dtype=dtype, device=dev))
        self.graphs = None         # the captured draft/verify graphs on CUDA; False if uncapturable

    def prefill(self, prompt_ids: list[int]) -> int:
        """Eager, variable length: fill the target cache and the drafter context for the prompt."""
        buf, P = self.buf, len(prompt_ids)
        buf.max_accept.zero_()
        positions = torch.arange(P, device=self.device)                                 # (P,)
        set_cache_length(buf.target_cache, torch.zeros((), dtype=torch.long, device=self.device))
        logits, features = target_forward(self.target, torch.tensor(prompt_ids, device=self.device), positions,
                                          buf.target_cache, self.capture_hooks)
        _, bonus = verify(buf.verify_ids[:0], logits[-1:], self.sampling, buf.uniforms, buf.max_accept)
        if self.drafter is not None:
            append_context(self.drafter, self.folded, buf, project_context(self.drafter, features), positions)
        buf.start.fill_(P)
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
        buf.verify_ids[1:] = propose(self.drafter, buf, block, self.target)[:self.K]    # (K,)

    def verify(self):
        buf, K = self.buf, self.K
        positions = buf.start + torch.arange(K + 1, device=self.device)                 # (K+1,)
        set_cache_length(buf.target_cache, buf.start)
        logits, features = target_forward(self.target, buf.verify_ids, positions, buf.target_cache,
                                          self.capture_hooks)                           # (K+1, V)
        accepted, bonus = verify(buf.verify_ids[1:], logits, self.sampling, buf.uniforms, buf.max_accept)
        if self.drafter is not None:   # all K+1 rows; rows past `accepted` are masked, then overwritten
            append_context(self.drafter, self.folded, buf, project_context(self.drafter, features), positions)
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
        tensors += [t for layer in buf.target_cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]
        if buf.ctx_keys is not None:
            tensors += [buf.ctx_keys, buf.ctx_values]
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
            _decoders.pop(next(iter(_decoders))).capture_hooks.remove()
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
