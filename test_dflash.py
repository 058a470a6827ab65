"""The proof: tiny random checkpoints in the released formats, on CPU, in seconds.

Headline: greedy DFlash output is token-identical to the target's own greedy decode (HF
`generate(do_sample=False)`), whatever the drafter, block size or K; and fastpath.py gives dflash.py's
tokens, rounds and drafts. In dflash.py's order: the drafter's modules against direct computations,
target capture, the drafter block, verification, generation; then the twin's equality, and the layout of
the files. Every other file's tests are in tests/.
"""
import json
import math
import re
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import dflash
import fastpath
from dflash import DFlashError
from conftest import (FAMILIES, FORMATS, H, HERE, MAX_POS, T_LAYERS, VOCAB, assert_same_generation, assert_same_tokens, context_of, forward_with_capture, hf_greedy, laguna, prompts, run_both, run_cli, write_drafter)
from dflash_reference import demo, loading


def test_default_layer_ids_follow_spec():
    """Qwen3-8B (T=36, n=5) gives [1, 9, 17, 25, 33]; n=1 gives [T // 2]."""
    assert dflash.default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash.default_layer_ids(36, 1) == [18]
    assert dflash.default_layer_ids(6, 2) == [1, 3]


def test_softplus_gate_per_head(drafters):
    """o[t, h, :] *= softplus(g_proj(u)[t, h])."""
    attn = laguna(drafters).layers[0].self_attn
    u, o = torch.randn(3, H, dtype=torch.float64), torch.randn(3, 4, 8, dtype=torch.float64)
    got = dflash.gate(attn.g_proj(u), o)
    for t in range(3):
        for h in range(4):
            g = math.log1p(math.exp(float(attn.g_proj.weight[h] @ u[t])))
            torch.testing.assert_close(got[t, h], o[t, h] * g)


def test_aux_norms_before_fc(drafters):
    """Laguna projection: each captured layer through its own RMSNorm, then fc, then hidden_norm."""
    drafter = laguna(drafters)
    f = torch.randn(5, 3 * H, dtype=torch.float64)
    parts = []
    for i, chunk in enumerate(f.split(H, dim=-1)):
        w = drafter.aux_hidden_norms[i].weight
        parts.append(w * chunk / torch.sqrt(chunk.pow(2).mean(-1, keepdim=True) + 1e-6))
    fc = torch.cat(parts, -1) @ drafter.fc.weight.T
    want = drafter.hidden_norm.weight * fc / torch.sqrt(fc.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(drafter.project_context(f), want)


def rotate(x, positions, theta):
    """Rotate-half RoPE written pair by pair: (x_i, x_{i+d/2}) turns by pos·θ^(-2i/d)."""
    d, out = x.shape[-1], x.clone()
    for i in range(d // 2):
        angle = positions.double() * theta ** (-2 * i / d)
        c, s = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
        out[..., i] = x[..., i] * c - x[..., i + d // 2] * s
        out[..., i + d // 2] = x[..., i + d // 2] * c + x[..., i] * s
    return out


def naive_conv(x, taps, base):
    """DFlash2's convolution of one block written from its formula: out[t, c] = Σ_o (base[o, c] +
    taps[t, o, c // g]) · x[t − o, c], the rows before the block's first zero. x (W, H), taps (W, C, G)."""
    (W, H), (C, G) = x.shape, taps.shape[1:]
    out = torch.zeros_like(x)
    for t in range(W):
        for o in range(min(C, t + 1)):
            for c in range(H):
                out[t, c] += (base[o, c] + taps[t, o, c // (H // G)]) * x[t - o, c]
    return out


def around(conv, a, sublayer):
    """A sublayer with a layer's DFlash2 convolutions before and after it (a DFlash layer: none)."""
    if conv is None:
        return sublayer(a)
    C = conv.base_kernel.shape[1]
    taps = (a @ conv.kernel_projection.weight.T).view(len(a), 2, C, -1)                # (W, 2, C, G)
    return naive_conv(sublayer(naive_conv(a, taps[:, 0], conv.base_kernel[0])), taps[:, 1], conv.base_kernel[1])


def naive_block(drafter, c, x):
    """The drafter layers computed query by query from the paper's description, recomputing context K/V."""
    cfg = drafter.config
    rms = lambda t, w: w * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    for l, layer in enumerate(drafter.layers):
        x = x + around(layer.attention_conv, rms(x, layer.input_layernorm.weight),
                       lambda u: naive_attention(drafter, l, c, u))
        x = x + around(layer.mlp_conv, rms(x, layer.post_attention_layernorm.weight), layer.mlp)
    return rms(x, drafter.norm.weight)


def naive_attention(drafter, l, c, u):
    """Layer l's attention of block rows u (W, H) over context c (S, H) and themselves, query by query."""
    cfg, layer = drafter.config, drafter.layers[l]
    S, W, hq, hk, d = len(c), len(u), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rms = lambda t, w: w * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    attn = layer.self_attn
    wq, wk, wv = attn.qkv_proj.weight.split([hq * d, hk * d, hk * d])
    cc = rms(c, layer.input_layernorm.weight) if cfg.norm_context else c
    theta = cfg.rope_thetas[l]
    q = rotate(rms((u @ wq.T).view(W, hq, d), attn.q_norm.weight), torch.arange(S, S + W), theta)
    k = rotate(rms((torch.cat([cc, u]) @ wk.T).view(S + W, hk, d), attn.k_norm.weight),
               torch.arange(S + W), theta)
    v = (torch.cat([cc, u]) @ wv.T).view(S + W, hk, d)
    o = torch.zeros(W, hq, d, dtype=u.dtype)
    for t in range(W):
        qp = S + t
        keys = [j for j in range(S + W)
                if (not cfg.causal[l] or j <= qp)
                and (cfg.windows[l] is None or abs(qp - j) < cfg.windows[l])]
        if cfg.windows[l] is not None:   # W keys ending at the query, or less than W away on either side
            assert len(keys) <= (cfg.windows[l] if cfg.causal[l] else 2 * cfg.windows[l] - 1)
        for h in range(hq):
            kv = h // (hq // hk)
            p = torch.softmax(torch.stack([q[t, h] @ k[j, kv] for j in keys]) / math.sqrt(d), 0)
            o[t, h] = sum(pj * v[j, kv] for pj, j in zip(p, keys))
            if cfg.gated:
                o[t, h] *= F.softplus(attn.g_proj.weight[h] @ u[t])
    return o.reshape(W, -1) @ attn.o_proj.weight.T


def block_output(drafter, c, x):
    return dflash.draft_block(drafter, context_of(drafter, c), x)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("S", [0, 1, 9])
def test_block_attention_matches_direct_computation(drafters, fmt, S):
    """Cached-context KV injection, masks (bidirectional, causal, windowed), GQA and the gate equal a
    query-by-query computation, on both sides of the window (block 4, window 4: context + block ≤ W at
    S = 0, an empty context, and > W at S = 1 and 9)."""
    drafter = drafters("qwen3", fmt, 4)
    c, x = torch.randn(S, H, dtype=torch.float64), torch.randn(4, H, dtype=torch.float64)
    torch.testing.assert_close(block_output(drafter, c, x), naive_block(drafter, c, x), rtol=1e-10, atol=1e-10)


def test_convolution_restarts_at_each_block():
    """dflash.convolve over rows that hold several blocks equals the formula on each block alone."""
    g = torch.Generator().manual_seed(0)
    B, H_, C, G = 5, 8, 3, 2
    x = torch.randn(3 * B, H_, dtype=torch.float64, generator=g)                     # three blocks
    taps = torch.randn(3 * B, C, G, dtype=torch.float64, generator=g)
    base = torch.randn(C, H_, dtype=torch.float64, generator=g)
    got = dflash.convolve(x, taps, base, B)
    for b in range(3):
        rows = slice(b * B, (b + 1) * B)
        torch.testing.assert_close(got[rows], naive_conv(x[rows], taps[rows], base), rtol=1e-12, atol=1e-12)


def test_selector_walks_its_candidates_from_the_anchor(drafters):
    """DFlash2's selector from its description: each draft row's k likeliest tokens scored by their logit
    plus Σ_r A[prev, r]·u_t[r]·B[candidate, r], prev the anchor and then each pick (u the row's projection);
    the argmax at T = 0, at T > 0 a draw from q = softmax(scores / T) by the inverse CDF of the row's
    uniform, q kept. Every draft is one of its row's candidates."""
    selector = drafters("qwen3", "dflash2", 4).candidate_selector
    A, Bc, P = selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, H, dtype=torch.float64, generator=g)
    logits = 3 * torch.randn(6, VOCAB, dtype=torch.float64, generator=g)
    for temperature in (0.0, 0.7):
        uniforms = torch.rand(6, dtype=torch.float64, generator=g)
        drafts, candidates, q = selector(hidden, logits, torch.tensor(7), temperature, uniforms)
        previous = 7
        for t in range(6):
            top = logits[t].topk(selector.top_k).indices
            assert torch.equal(candidates[t], top)
            u = P @ hidden[t]
            scores = torch.stack([logits[t, b] + sum(A[previous, r] * u[r] * Bc[b, r] for r in range(len(u)))
                                  for b in top])
            if temperature == 0:
                pick = int(scores.argmax())
            else:
                want = (scores / temperature).softmax(0)
                torch.testing.assert_close(q[t], want, rtol=1e-12, atol=1e-12)
                pick = int((want.cumsum(0) > uniforms[t] * want.sum()).nonzero()[0])
            previous = int(top[pick])
            assert int(drafts[t]) == previous
        assert (q is None) == (temperature == 0)


def test_window_matters_only_past_its_length(drafters):
    """With window 4 the block sees the same keys as without one while context + block ≤ 4,
    and different keys once it is longer."""
    drafter = laguna(drafters, 3)
    wide = dflash.Drafter(dflash.DraftConfig(**{**vars(drafter.config), "windows": [10**6] * 2}))
    wide.load_state_dict(drafter.state_dict())
    wide = wide.double()
    x = torch.randn(3, H, dtype=torch.float64)
    short, long_ = torch.randn(1, H, dtype=torch.float64), torch.randn(6, H, dtype=torch.float64)
    torch.testing.assert_close(block_output(drafter, short, x), block_output(wide, short, x))
    assert not torch.allclose(block_output(drafter, long_, x), block_output(wide, long_, x))




@pytest.mark.parametrize("family", FAMILIES)
def test_capture_is_layer_output_before_final_norm(targets, family):
    """Captured features for layer i equal HF hidden_states[i + 1]; the last layer is captured un-normed."""
    target = targets[family]
    ids = torch.tensor([5, 17, 3, 42, 8])
    layer_ids = list(range(T_LAYERS))
    _, features = forward_with_capture(target, ids, layer_ids)
    hidden = target(input_ids=ids[None], output_hidden_states=True).hidden_states
    chunks = features.split(H, dim=-1)
    for i in range(T_LAYERS - 1):
        torch.testing.assert_close(chunks[i], hidden[i + 1][0], rtol=1e-12, atol=1e-12)
    final_norm = target.get_decoder().norm
    torch.testing.assert_close(final_norm(chunks[-1]), hidden[T_LAYERS][0], rtol=1e-12, atol=1e-12)


def test_capture_hooks_live_for_one_generation(targets, drafters):
    """generate registers one hook per captured layer once, not once per round, and removes them all
    when it returns."""
    target, drafter = targets["qwen3"], drafters("qwen3", "zlab", 4)
    layers = dflash.decoder_layers(target)
    before = [dict(layer._forward_hooks) for layer in layers]   # transformers may keep hooks of its own
    registered = []
    real = torch.nn.Module.register_forward_hook

    def counting(module, hook, **kw):
        registered.append(module)
        return real(module, hook, **kw)

    with mock.patch.object(torch.nn.Module, "register_forward_hook", counting):
        gen = dflash.generate(target, drafter, [3, 1, 4, 1, 5], 20)
    assert len(gen.rounds) > 3
    assert registered == [layers[i] for i in drafter.config.target_layer_ids]
    assert [dict(layer._forward_hooks) for layer in layers] == before


def test_cache_keyword_is_looked_up_once_per_model_class(targets, drafters):
    """The KV-cache keyword of the target's forward is resolved once per model class, not per forward."""
    dflash.cache_kwarg.cache_clear()
    with mock.patch.object(dflash.inspect, "signature", wraps=dflash.inspect.signature) as signature:
        for _ in range(2):
            dflash.generate(targets["llama"], drafters("llama", "zlab", 4), [3, 1, 4], 12)
    assert signature.call_count == 1



@pytest.mark.parametrize("fmt", FORMATS)
def test_drafter_context_is_every_committed_token_but_the_bonus(targets, drafters, fmt):
    """At each draft, the cached context equals a fresh projection of the target's features for all
    committed tokens before the bonus: the context lags by one, with no gap and no duplicate, after
    rounds that accept several drafts (drafts from the target's own continuation, two made wrong) as
    after rounds that accept none."""
    target, drafter, prompt = targets["qwen3"], drafters("qwen3", fmt, 4), [4, 8, 15, 16, 23]
    reference = hf_greedy(target, prompt, 30)                      # the target's greedy continuation
    oracle, checked = oracle_double(reference, len(prompt), {len(prompt) + 4, len(prompt) + 9}), []

    def checking_propose(drafter_, ctx, block, target_, count, *sampling):
        sequence = prompt + reference[:ctx.length - len(prompt) + 1]
        assert sequence[-1] == int(block[0])                      # the bonus is the last committed token
        _, features = forward_with_capture(target, torch.tensor(sequence[:-1]), drafter.config.target_layer_ids)
        fresh = context_of(drafter, drafter.project_context(features))
        for got, want in zip(ctx.keys + ctx.values, fresh.keys + fresh.values):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        checked.append(ctx.length)
        return oracle(drafter_, ctx, block, target_, count)

    with mock.patch.object(dflash, "propose", checking_propose):
        gen = dflash.generate(target, drafter, prompt, 14)
    assert gen.tokens == reference[:14]
    assert checked[0] == len(prompt) and len(checked) > 3
    assert max(gen.acceptance_lengths) == 4 and min(gen.acceptance_lengths[:-1]) < 4   # whole blocks and less


@pytest.mark.parametrize("fmt", FORMATS)
def test_fewer_compute_rows_agree_for_causal_drafters(targets, drafters, fmt):
    """K+1 compute rows give the same drafts as the full block exactly when every layer is causal."""
    drafter, target = drafters("qwen3", fmt, 6), targets["qwen3"]
    _, features = forward_with_capture(target, torch.tensor([1, 2, 3, 4, 5, 6, 7]), drafter.config.target_layer_ids)
    ctx = context_of(drafter, drafter.project_context(features))
    full = torch.tensor([9] + [VOCAB - 1] * 5)
    h_full = dflash.draft_block(drafter, ctx, target.get_input_embeddings()(full))
    h_short = dflash.draft_block(drafter, ctx, target.get_input_embeddings()(full[:3]))
    all_causal = all(drafter.config.causal)
    assert torch.allclose(h_full[:3], h_short, atol=1e-10) == all_causal




def test_target_probs_applies_temperature_top_k_and_top_p():
    """p = softmax(logits / T) restricted to the top-k, then to the smallest prefix reaching top_p."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0]], dtype=torch.float64)
    full = torch.softmax(logits / 0.7, -1)
    torch.testing.assert_close(dflash.target_probs(logits, dflash.Sampling(0.7)), full)
    top3 = dflash.target_probs(logits, dflash.Sampling(0.7, top_k=3))
    assert (top3[0, [2, 3]] == 0).all() and float(top3.sum()) == pytest.approx(1.0)
    torch.testing.assert_close(top3[0, [0, 1, 4]], torch.softmax(logits[0, [0, 1, 4]] / 0.7, -1))
    # full ≈ [.18, .043, .021, .002, .75]: mass 0.8 needs the top two tokens, 0.7 only the top one.
    assert (dflash.target_probs(logits, dflash.Sampling(0.7, top_p=0.8))[0] > 0).tolist() == \
        [True, False, False, False, True]
    assert (dflash.target_probs(logits, dflash.Sampling(0.7, top_p=0.7))[0] > 0).sum() == 1


STAT_V, STAT_K, STAT_N = 6, 2, 20000



def stat_tables(seed=0):
    """A synthetic target P(x | prefix) for prefixes of up to 3 tokens over 6 tokens, and an imperfect
    drafter Q (P's logits plus noise) whose argmax is right about half the time."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [()] + [p + (x,) for p in [()] for x in range(STAT_V)]
    for _ in range(2):
        prefixes += [p + (x,) for p in prefixes if len(p) == len(prefixes[-1]) for x in range(STAT_V)]
    logits = {p: 1.5 * torch.randn(STAT_V, generator=g, dtype=torch.float64) for p in prefixes}
    draft_logits = {p: logits[p] + 1.5 * torch.randn(STAT_V, generator=g, dtype=torch.float64) for p in prefixes}
    return logits, draft_logits


def speculative_first_three(verify_fn, logits, draft_logits, sampled: bool, generator):
    """First 3 tokens of one sequence: the prefill draw, then rounds of K=2 drafts verified by
    `verify_fn(drafts, logits rows, uniforms, q)`, exactly as generate chains them. The drafts are Q's
    argmax (q one-hot, None), or with `sampled` drawn from q = softmax(Q's logits), a uniform each."""
    u = torch.rand(STAT_K + 1, generator=generator, dtype=torch.float64)
    _, first = verify_fn(torch.zeros(0, dtype=torch.long), logits[()][None], u, None)
    tokens = [int(first)]
    while len(tokens) < 3:
        path, proposed, qs = tuple(tokens), [], []
        draws = torch.rand(STAT_K, generator=generator, dtype=torch.float64)
        for i in range(STAT_K):
            q = draft_logits[(path + tuple(proposed))[:3]].softmax(-1)
            proposed.append(int(dflash.sample(q, draws[i]) if sampled else q.argmax()))
            qs.append(q)
        rows = torch.stack([logits[(path + tuple(proposed[:i]))[:3]] for i in range(STAT_K + 1)])
        u = torch.rand(STAT_K + 1, generator=generator, dtype=torch.float64)
        accepted, nxt = verify_fn(torch.tensor(proposed), rows, u, torch.stack(qs) if sampled else None)
        tokens += proposed[:int(accepted)] + [int(nxt)]
    return tuple(tokens[:3])


def total_variation_vs_target(verify_fn, sampling, sampled=False):
    """TV distance between the empirical joint of the first 3 tokens and the exact target joint, and
    a bound it stays under with probability ≥ 1 − 1e-6 when sampling is exact: E[TV] ≤ ½Σ√(p(1−p)/N)
    plus a McDiarmid deviation √(ln(1e6) / 2N)."""
    logits, draft_logits = stat_tables()
    probs = lambda p: dflash.target_probs(logits[p][None], sampling)[0]
    exact = {(a, b, c): float(probs(())[a] * probs((a,))[b] * probs((a, b))[c])
             for a in range(STAT_V) for b in range(STAT_V) for c in range(STAT_V)}
    generator = torch.Generator().manual_seed(1)
    counts = {}
    for _ in range(STAT_N):
        key = speculative_first_three(verify_fn, logits, draft_logits, sampled, generator)
        counts[key] = counts.get(key, 0) + 1
    tv = 0.5 * sum(abs(counts.get(x, 0) / STAT_N - p) for x, p in exact.items())
    bound = 0.5 * sum(math.sqrt(p * (1 - p) / STAT_N) for p in exact.values()) + \
        math.sqrt(math.log(1e6) / (2 * STAT_N))
    return tv, bound


SAMPLINGS = [dflash.Sampling(1.0), dflash.Sampling(0.8, top_p=0.9, top_k=4)]



def reference_verify(sampling):
    return lambda drafts, rows, u, q: dflash.verify(drafts, rows, sampling, u, q)


def fastpath_verify(sampling):
    return lambda drafts, rows, u, q: fastpath.verify(drafts, rows, sampling, u, torch.tensor(len(drafts)), q)


@pytest.mark.parametrize("sampling,sampled", [(SAMPLINGS[0], False), (SAMPLINGS[1], False), (SAMPLINGS[1], True)],
                         ids=["T1", "T0.8-p0.9-k4", "T0.8-p0.9-k4-drawn-drafts"])
@pytest.mark.parametrize("make_verify", [reference_verify, fastpath_verify], ids=["dflash", "fastpath"])
def test_speculative_sampling_matches_target_distribution(make_verify, sampling, sampled):
    """With an imperfect drafter, the joint law of the first 3 tokens equals the target's (20k draws), for
    argmax drafts (q one-hot) and for drafts drawn from the drafter's own q, which q need not resemble p."""
    tv, bound = total_variation_vs_target(make_verify(sampling), sampling, sampled)
    assert tv < bound, f"TV {tv:.4f} ≥ bound {bound:.4f}"


@pytest.mark.parametrize("sampled", [False, True], ids=["argmax-drafts", "drawn-drafts"])
@pytest.mark.parametrize("make_verify", [reference_verify, fastpath_verify], ids=["dflash", "fastpath"])
def test_sampling_without_the_residual_fails_the_same_check(make_verify, sampled):
    """The same check catches a broken variant that redraws from p instead of max(p − q, 0)."""
    with mock.patch.object(dflash, "residual", lambda p, q: p):
        tv, bound = total_variation_vs_target(make_verify(SAMPLINGS[0]), SAMPLINGS[0], sampled)
    assert tv > bound, f"broken sampling passed: TV {tv:.4f} < bound {bound:.4f}"




@settings(max_examples=30)
@given(family=st.sampled_from(FAMILIES), fmt=st.sampled_from(FORMATS), block_size=st.integers(2, 6),
       k_fraction=st.floats(0, 1), prompt=prompts, max_new=st.integers(1, 20), full_block=st.booleans())
def test_greedy_equals_target_greedy(targets, drafters, family, fmt, block_size, k_fraction, prompt, max_new,
                                     full_block):
    """Over random prompts, block sizes, K and drafters, DFlash equals HF greedy decode token for token."""
    K = 1 + int(k_fraction * (block_size - 2))
    gen = dflash.generate(targets[family], drafters(family, fmt, block_size), prompt, max_new,
                          num_drafts=K, full_block=full_block)
    assert_same_tokens(gen.tokens, hf_greedy(targets[family], prompt, max_new))
    assert len(gen.tokens) == max_new


def oracle_double(reference: list[int], prompt_len: int, wrong_at: set[int], vocab=VOCAB):
    """A stand-in for `propose` that drafts the target's true continuation, made wrong at the
    absolute positions in `wrong_at`. The context length tells it where the block starts."""
    def propose(drafter, ctx, block, target, count, *sampling):
        start = ctx.length                                        # position of the bonus token
        drafts = []
        for pos in range(start + 1, start + len(block)):
            true = reference[pos - prompt_len] if pos - prompt_len < len(reference) else 0
            drafts.append((true + 1) % vocab if pos in wrong_at else true)
        return torch.tensor(drafts[:count]), None                 # proposed as argmaxes
    return propose


@settings(max_examples=30)
@given(family=st.sampled_from(FAMILIES), block_size=st.integers(2, 7), prompt=prompts,
       max_new=st.integers(1, 24), wrong_at=st.sets(st.integers(0, 40)), data=st.data())
def test_partial_acceptance_is_lossless(targets, drafters, family, block_size, prompt, max_new, wrong_at, data):
    """With drafts right up to chosen positions, output still equals the target's greedy decode and each
    round accepts exactly the drafts before the first wrong one."""
    K = data.draw(st.integers(1, block_size - 1))
    reference = hf_greedy(targets[family], prompt, max_new + block_size)
    wrong = {len(prompt) + w for w in wrong_at}
    with mock.patch.object(dflash, "propose", oracle_double(reference, len(prompt), wrong)):
        gen = dflash.generate(targets[family], drafters(family, "zlab", block_size), prompt, max_new, num_drafts=K)
    assert_same_tokens(gen.tokens, reference[:max_new])
    start = len(prompt)
    for round_ in gen.rounds:
        k = len(round_["draft"])
        expected = next((i for i in range(k) if start + 1 + i in wrong), k)
        assert round_["accepted"] == expected
        start += expected + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_target_only_equals_target_greedy(targets, family):
    """drafter=None runs the target alone through the same loop and matches HF greedy."""
    prompt = [3, 14, 15, 92, 65]
    gen = dflash.generate(targets[family], None, prompt, 16)
    assert_same_tokens(gen.tokens, hf_greedy(targets[family], prompt, 16))
    assert gen.acceptance_lengths == [1] * 15


@pytest.mark.parametrize("block_size,K", [(4, 3), (6, 2), (7, 6)])
def test_perfect_drafter_accepts_every_draft(targets, drafters, block_size, K):
    """A drafter that proposes the target's own next tokens gives τ_r = K+1 on every full round."""
    prompt, max_new = [7, 1, 8, 2, 8], 30
    reference = hf_greedy(targets["llama"], prompt, max_new + block_size)
    with mock.patch.object(dflash, "propose", oracle_double(reference, len(prompt), set())):
        gen = dflash.generate(targets["llama"], drafters("llama", "zlab", block_size), prompt, max_new, num_drafts=K)
    assert_same_tokens(gen.tokens, reference[:max_new])
    full_rounds = [r for r in gen.rounds if len(r["draft"]) == K]
    assert full_rounds and all(r["accepted"] == K for r in full_rounds)
    assert gen.acceptance_lengths[:len(full_rounds)] == [K + 1] * len(full_rounds)


def test_wrong_drafter_accepts_nothing(targets, drafters):
    """A drafter that is always wrong gives τ = 1: one target token per round."""
    prompt, max_new = [7, 1, 8, 2, 8], 12
    reference = hf_greedy(targets["qwen3"], prompt, max_new + 8)
    wrong = set(range(len(prompt), len(prompt) + 40))
    with mock.patch.object(dflash, "propose", oracle_double(reference, len(prompt), wrong)):
        gen = dflash.generate(targets["qwen3"], drafters("qwen3", "zlab", 4), prompt, max_new)
    assert_same_tokens(gen.tokens, reference[:max_new])
    assert gen.tau == 1.0 and gen.acceptance_lengths == [1] * (max_new - 1)


@settings(max_examples=15)
@given(prompt=prompts, wrong_at=st.sets(st.integers(0, 40)))
def test_position_counts_add_up(targets, drafters, prompt, wrong_at):
    """Per-position acceptance counts sum to the accepted drafts, never rise with position, and
    tokens = 1 (prefill) + Σ acceptance lengths."""
    reference = hf_greedy(targets["qwen3"], prompt, 30)
    wrong = {len(prompt) + w for w in wrong_at}
    with mock.patch.object(dflash, "propose", oracle_double(reference, len(prompt), wrong)):
        gen = dflash.generate(targets["qwen3"], drafters("qwen3", "zlab", 5), prompt, 24)
    assert sum(gen.position_accepted) == sum(r["accepted"] for r in gen.rounds)
    assert all(a >= b for a, b in zip(gen.position_accepted, gen.position_accepted[1:]))
    assert all(a <= d for a, d in zip(gen.position_accepted, gen.position_drafted))
    assert len(gen.tokens) == 1 + sum(gen.acceptance_lengths)


def test_stop_token_trims_inside_accepted_span(targets, drafters):
    """Output ends at the first stop token even when it sits mid-way through an accepted block,
    and a stop token from prefill ends generation at once."""
    prompt = [7, 1, 8, 2, 8]
    reference = hf_greedy(targets["qwen3"], prompt, 40)
    stop = next(t for i, t in enumerate(reference) if i >= 3 and t not in reference[:i])
    with mock.patch.object(dflash, "propose", oracle_double(reference, len(prompt), set())):
        gen = dflash.generate(targets["qwen3"], drafters("qwen3", "zlab", 6), prompt, 40, stop_ids={stop})
        first = dflash.generate(targets["qwen3"], drafters("qwen3", "zlab", 6), prompt, 40,
                                stop_ids={reference[0]})
    assert_same_tokens(gen.tokens, reference[:reference.index(stop) + 1])
    assert first.tokens == [reference[0]] and first.rounds == []


@pytest.mark.parametrize("module", [dflash, fastpath], ids=["dflash", "fastpath"])
def test_top_k_1_and_tiny_temperature_equal_greedy(targets, drafters, module):
    """Sampling with top_k = 1, or at a temperature near 0, gives the greedy tokens, in both files."""
    target, drafter, prompt = targets["qwen3"], drafters("qwen3", "zlab", 4), [3, 1, 4, 1, 5]
    greedy = module.generate(target, drafter, prompt, 16).tokens
    assert module.generate(target, drafter, prompt, 16, sampling=dflash.Sampling(1.5, top_k=1), seed=0).tokens == greedy
    assert module.generate(target, drafter, prompt, 16, sampling=dflash.Sampling(1e-4), seed=0).tokens == greedy


@pytest.mark.parametrize("module", [dflash, fastpath], ids=["dflash", "fastpath"])
def test_seeded_sampling_reproduces(targets, drafters, module):
    """The same seed gives the same sampled tokens, another seed other tokens, in both files."""
    target, drafter, prompt, hot = targets["llama"], drafters("llama", "zlab", 4), [3, 1, 4], dflash.Sampling(50.0)
    runs = [module.generate(target, drafter, prompt, 16, sampling=hot, seed=s).tokens for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt=[], num_drafts=2), r"prompt: empty"),
    (dict(prompt=[1], num_drafts=0), r"--num-drafts = 0 must be in 1\.\.3"),
    (dict(prompt=[1], num_drafts=4), r"--num-drafts = 4 must be in 1\.\.3"),
    (dict(prompt=[1] * 10, num_drafts=2, max_new=MAX_POS), rf"10 \+ {MAX_POS} exceeds .* {MAX_POS}"),
    (dict(prompt=[1], num_drafts=2, max_new=0), r"--max-new-tokens = 0 must be at least 1"),
    (dict(prompt=[1, VOCAB], num_drafts=2), rf"--prompt-ids: \[{VOCAB}\] outside the target's vocabulary"),
])
def test_bad_request_is_rejected(targets, drafters, kwargs, message):
    """generate itself (not only the CLI) refuses an empty prompt, K out of range, a request past the
    target's positions, max_new_tokens < 1 and ids outside the vocabulary before anything runs."""
    with pytest.raises(DFlashError, match=message):
        dflash.generate(targets["qwen3"], drafters("qwen3", "zlab", 4), kwargs["prompt"],
                        kwargs.get("max_new", 8), num_drafts=kwargs["num_drafts"])


@pytest.mark.parametrize("module", [dflash, fastpath], ids=["dflash", "fastpath"])
def test_a_generation_without_rounds_has_no_tau(targets, drafters, module):
    """One new token comes from the prefill, with no verification round: τ is None (nothing to average),
    the CLI's table prints it as '-', and the JSON as null; a round with no drafts counts as τ_r = 1."""
    target, drafter = targets["qwen3"], drafters("qwen3", "zlab", 4)
    one = module.generate(target, drafter, [5, 3, 9], 1)
    assert len(one.tokens) == 1 and one.rounds == [] and one.tau is None
    assert re.search(r"^\s+tau  -$", demo.stats_table(one, 1.0), re.M)
    assert json.loads(json.dumps({"tau": one.tau})) == {"tau": None}
    two = module.generate(target, drafter, [5, 3, 9], 2)
    assert [r["draft"] for r in two.rounds] == [[]] and two.tau == 1.0


def stop_after(rounds: int):
    """An on_tokens callback that raises KeyboardInterrupt at its `rounds`-th call, as Ctrl-C would."""
    calls = []

    def on_tokens(tokens):
        calls.append(tokens)
        if len(calls) == rounds:
            raise KeyboardInterrupt
    return on_tokens, calls


@pytest.mark.parametrize("module", [dflash, fastpath], ids=["dflash", "fastpath"])
def test_ctrl_c_returns_what_was_committed(targets, drafters, module):
    """Ctrl-C during generate raises dflash.Interrupted carrying the rounds committed before it: a prefix of
    the target's greedy decode, with consistent counts, marked interrupted."""
    target, drafter = targets["qwen3"], drafters("qwen3", "zlab", 4)
    on_tokens, calls = stop_after(3)
    with pytest.raises(dflash.Interrupted) as stop:
        module.generate(target, drafter, [5, 6, 7], 40, on_tokens=on_tokens)
    gen = stop.value.generation
    assert isinstance(stop.value, KeyboardInterrupt) and gen.interrupted
    assert gen.tokens == [t for tokens in calls for t in tokens]
    assert len(gen.rounds) == 2 and sum(gen.acceptance_lengths) == len(gen.tokens) - 1
    assert_same_tokens(gen.tokens, hf_greedy(target, [5, 6, 7], 40)[:len(gen.tokens)])


@settings(max_examples=30)
@given(family=st.sampled_from(FAMILIES), fmt=st.sampled_from(FORMATS), block_size=st.integers(2, 6),
       prompt=prompts, max_new=st.integers(1, 20), full_block=st.booleans(), seed=st.integers(0, 10**6),
       dtype=st.sampled_from([torch.float64, torch.float32]), data=st.data())
def test_fastpath_equals_reference(targets, targets32, drafters, family, fmt, block_size, prompt, max_new,
                                   full_block, seed, dtype, data):
    """Over checkpoints, prompts, block sizes, K and lengths, fastpath gives dflash.py's tokens,
    acceptance lengths and per-round drafts, with rounds that accept partially."""
    K = data.draw(st.integers(1, block_size - 1))
    target = (targets if dtype == torch.float64 else targets32)[family]
    ref, fast, reference = run_both(target, drafters(family, fmt, block_size, dtype), prompt, max_new, seed,
                                    num_drafts=K, full_block=full_block)
    assert_same_generation(fast, ref)
    if dtype == torch.float64:
        assert_same_tokens(fast.tokens, reference[:max_new])


@pytest.mark.parametrize("family", FAMILIES)
def test_fastpath_target_only_equals_target_greedy(targets, family):
    """fastpath with no drafter matches HF greedy, for dense and model-forward targets."""
    prompt = [3, 14, 15, 92, 65]
    gen = fastpath.generate(targets[family], None, prompt, 16)
    assert_same_tokens(gen.tokens, hf_greedy(targets[family], prompt, 16))


@settings(max_examples=20)
@given(family=st.sampled_from(FAMILIES), fmt=st.sampled_from(FORMATS), block_size=st.integers(2, 6),
       prompt=prompts, max_new=st.integers(1, 16), seed=st.integers(0, 10**6),
       temperature=st.sampled_from([20.0, 60.0]), top_p=st.sampled_from([1.0, 0.9]),
       top_k=st.sampled_from([0, 5]), data=st.data())
def test_fastpath_sampling_equals_reference(targets, drafters, family, fmt, block_size, prompt, max_new, seed,
                                            temperature, top_p, top_k, data):
    """At T > 0 with the same seed, fastpath draws the same tokens and accepts the same drafts as dflash.py
    (temperatures that flatten the peaked test targets, so that draws and rejections really happen)."""
    K = data.draw(st.integers(1, block_size - 1))
    ref, fast, _ = run_both(targets[family], drafters(family, fmt, block_size), prompt, max_new, seed,
                            num_drafts=K, sampling=dflash.Sampling(temperature, top_p, top_k), seed=seed)
    assert_same_generation(fast, ref)


@pytest.mark.parametrize("family,fmt", [("qwen3", "zlab"), ("laguna", "laguna")])
def test_fastpath_prefill_in_chunks_equals_reference(targets, drafters, family, fmt):
    """A prompt longer than a prefill chunk (3 positions here) gives dflash.py's generation."""
    with mock.patch.object(fastpath, "PREFILL_CHUNK", 3):
        ref, fast, reference = run_both(targets[family], drafters(family, fmt, 4), [5, 3, 9, 4, 7, 1, 8, 2], 12,
                                        help_seed=7)
    assert_same_generation(fast, ref)
    assert_same_tokens(fast.tokens, reference[:12])


def test_fastpath_stops_like_reference(targets, drafters):
    """Stop tokens trim the accepted span identically in both files."""
    prompt = [7, 1, 8, 2, 8]
    reference = hf_greedy(targets["qwen3"], prompt, 40)
    stop = next(t for i, t in enumerate(reference) if i >= 3 and t not in reference[:i])
    ref, fast, _ = run_both(targets["qwen3"], drafters("qwen3", "zlab", 6), prompt, 40, help_seed=3, stop_ids={stop})
    assert_same_generation(fast, ref)
    assert fast.tokens[-1] == stop


def test_fastpath_cli_json_equals_reference_cli(checkpoints, tmp_path):
    """`python fastpath.py --json` prints the same line as `python dflash.py --json`."""
    draft = write_drafter(tmp_path / "d", "zlab-new", block_size=5)
    args = ["--target", str(checkpoints["qwen3"]), "--draft", str(draft), "--prompt-ids", "5,6,7,8",
            "--max-new-tokens", "12", "--dtype", "float64", "--device", "cpu", "--json"]
    fast = run_cli(*args, script="fastpath.py")
    assert fast.returncode == 0, fast.stderr
    assert json.loads(fast.stdout) == json.loads(run_cli(*args).stdout)



def zlab_reference():
    """z-lab's own reference, `dflash/model.py` of the PyPI package dflash 0.1.0, installed apart (its import
    name is this file's): `pip install --no-deps --target .zlab dflash==0.1.0`, as .ci/run does."""
    import importlib.util
    path = HERE / ".zlab" / "dflash" / "model.py"
    assert path.is_file(), f"{path} missing: pip install --no-deps --target .zlab dflash==0.1.0"
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recording(fn, record):
    """fn, with record(its result) after each call."""
    def recorded(*args):
        out = fn(*args)
        record(out)
        return out
    return recorded


@pytest.mark.package
@pytest.mark.parametrize("fmt", ["zlab", "dflash2"])
def test_drafts_per_round_equal_zlabs_reference(targets, tmp_path, fmt):
    """On a tiny checkpoint in the released format (DFlashDraftModel, and DFlash2DraftModel with its
    convolutions and selector), z-lab's reference (dflash_generate, T = 0, float64 on CPU) drafts what
    dflash.py drafts, round for round, and both commit the target's greedy decode. Near max_new_tokens
    z-lab shrinks the block to the tokens left, while dflash.py keeps the full block and verifies fewer
    drafts: those last rounds are compared in their tokens only."""
    zlab = zlab_reference()
    target, block = targets["qwen3"], 6
    path = write_drafter(tmp_path / fmt, fmt, block_size=block, layer_ids=(1, 3))
    ours = loading.load_drafter(str(path), target, torch.float64, "cpu")
    theirs = (zlab.DFlash2DraftModel if fmt == "dflash2" else zlab.DFlashDraftModel).from_pretrained(
        str(path), dtype=torch.float64).eval()
    rounds = []
    if fmt == "dflash2":   # the selector's walk
        theirs.propose = recording(theirs.propose, lambda out: rounds.append(out[0][0].tolist()))
    else:                  # the argmax of the draft logits
        theirs.compute_logits = recording(theirs.compute_logits, lambda out: rounds.append(out[0].argmax(-1).tolist()))
    prompt, max_new = [5, 17, 3, 42, 8, 23, 61, 2], 40
    with mock.patch.object(zlab, "_cuda_time", lambda: 0.0):   # its stats time with CUDA syncs
        result = zlab.dflash_generate(theirs, target, torch.tensor([prompt]), max_new, None, return_stats=True)
    gen = dflash.generate(target, ours, prompt, max_new)
    assert_same_tokens(gen.tokens, result.output_ids[0, len(prompt):].tolist())
    assert_same_tokens(gen.tokens, hf_greedy(target, prompt, max_new))
    ours_drafts = [r["draft"] for r in gen.rounds]
    whole = lambda drafts: len(drafts) == block - 1
    full = next(i for i, (a, b) in enumerate(zip(ours_drafts + [[]], rounds + [[]])) if not (whole(a) and whole(b)))
    assert full >= 20 and ours_drafts[:full] == rounds[:full]                       # every round with a full block
    assert gen.acceptance_lengths[:full] == result.acceptance_lengths[:full]


FLOORS = {   # each file imports only files above it in this list
    "dflash": "dflash.py", "scripts": "dflash_reference/scripts.py", "loading": "dflash_reference/loading.py",
    "kernels": "dflash_reference/kernels.py", "fastpath": "fastpath.py", "demo": "dflash_reference/demo.py",
    "evaluation": "dflash_reference/evaluation.py", "prompt_sources": "dflash_reference/training/prompt_sources.py",
    "objective": "dflash_reference/training/objective.py", "distill": "dflash_reference/training/distill.py",
    "train": "dflash_reference/training/train.py", "cases": "dflash_reference/conformance/cases.py",
    "checker": "dflash_reference/conformance/checker.py", "bench": "benchmarks/bench.py",
    "bench_train": "benchmarks/bench_train.py"}


def project_imports(name: str) -> set[str]:
    """The project files a file imports, inside functions too, but not in its `if __name__ == "__main__":`
    block: a script's entry point may hand its flags to a file above it (dflash.py's to demo.py)."""
    import ast
    tree = ast.parse((HERE / FLOORS[name]).read_text())
    entry = [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
    skipped = {id(n) for block in entry for n in ast.walk(block)}
    nodes = [n for n in ast.walk(tree) if id(n) not in skipped]
    dotted = [alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names]
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            dotted += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return {part for name in dotted for part in name.split(".")} & set(FLOORS)


def test_files_import_only_files_below_them():
    """The project's files form floors: each imports only files on a lower floor, so there is no circle, and
    dflash.py, the reference, imports no project file at all. Imports inside functions count too."""
    found = [p.relative_to(HERE).as_posix() for p in [*HERE.glob("*.py"), *HERE.glob("dflash_reference/**/*.py"),
                                                        *HERE.glob("benchmarks/*.py")]]
    assert sorted(p for p in found if p != "conftest.py" and not p.rsplit("/", 1)[-1].startswith(("test_", "__init__"))) == \
        sorted(FLOORS.values())
    assert project_imports("dflash") == set()
    names = list(FLOORS)
    for floor, name in enumerate(names):
        above = project_imports(name) - set(names[:floor])
        assert not above, (name, sorted(above))
