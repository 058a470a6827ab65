"""The conformance kit's cases: tiny checkpoint pairs in the released formats, each with a request and the
golden values dflash.py computes at every stage of its first rounds.

Each case in golden/<case>/ holds:

    target/, drafter/         config.json + model.safetensors (a vocabulary of 8, so drafts are often right)
    case.json                 the request, the stage list with each stage's tolerance and usual pitfall
    expected.safetensors      '<stage>.<round>' tensors, and the whole run's 'round_drafts' and 'tokens'

The pairs are tiny random checkpoints in the exact released formats, written here apart from loading.py
so that the loader is checked against them (the tests run on them too): weights from seeded draws, so a
file is byte-identical wherever torch's CPU generator is, norms near 1, matrices with unit-variance
outputs, the target's LM head `head_scale` times that (so its argmaxes are clear). Config files hold only
the keys that matter, so that they do not change with the transformers version. A few cases are designed
pairs: some weights set by hand so that every draft is accepted.

checker.py compares a port's dump with a case and names what differs.

Rounds: round 0 is the prefill (the prompt's features and context); round r ≥ 1 drafts a block, verifies
it and appends the accepted rows and the bonus's predecessor to the context. Shapes: P prompt, k drafts
verified this round (K, or fewer near max_new_tokens), W block rows (B, or K+1), a accepted drafts.
"""
import json
import math
from contextlib import ExitStack, closing
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

import dflash
import fastpath
from dflash_reference import loading, scripts

# -----------------------------------------------------------------------------
# Tiny random checkpoints in the released formats

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
    gives one RoPE base per layer type (zlab-new). "dflash2" is z-lab's DFlash2DraftModel layout:
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
    """The tensor names and shapes of a drafter checkpoint with n captured layers, as released (docs/checkpoints.md):
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


# -----------------------------------------------------------------------------
# The cases

KIT = scripts.package_data("conformance", "golden")
ROUNDS = 8        # stages are kept for rounds 0..ROUNDS; the tokens for the whole generation
VOCAB, MAX_POS = 8, 128   # every case's vocabulary and positions

# Stages in the order a round computes them: name -> (shape, atol = rtol, the pitfall it usually means).
STAGES = {
    "draft_uniforms": ("(K,)", 0, "the uniforms of a round's draws of its drafts (DFlash2's walk at T > 0, one a "
                       "draft row): drawn before the round's K+1 verification uniforms, from the same generator"),
    "conv_in": ("(W, H)", 1e-4, "DFlash2's first convolution of layer l's sublayer s (conv_in.<l>.<s>), the "
                "sublayer's input: taps reading a later row (x[t + o] for x[t − o]), the dynamic taps indexed at the "
                "source row t − o instead of the output row t, the halves of base_kernel swapped, the convolution "
                "skipped or run over the residual instead of the normed input, the block's embeddings unscaled "
                "(input_embedding_scale), or the blocks run as one stream, carrying the last block's rows into this "
                "one instead of restarting from zeros"),
    "conv_out": ("(W, H)", 1e-4, "DFlash2's second convolution of layer l's sublayer s (conv_out.<l>.<s>), what "
                 "the sublayer adds to the residual: skipped, its taps computed from the sublayer's output instead "
                 "of its normed input, or a mistake of the first convolution made in the second"),
    "hidden": ("(W, H)", 1e-4, "the drafter's block: a sliding layer run as full attention, no window or a "
               "window on one side only, causal and bidirectional layers mixed up (the causality override), "
               "another layer's RoPE base or the target's, the block at the wrong positions (a window's clipped "
               "positions for absolute ones), a missing gate, no final norm, or the embeddings unscaled"),
    "top5_logits": ("(W-1, 5)", 1e-3, "the LM head over the drafter's rows 1..W-1: the rows read shifted by "
                    "one, read before the final norm, a head other than the target's own, or output_multiplier and "
                    "softcapping not applied"),
    "top5_ids": ("(W-1, 5)", 0, "the LM head over the drafter's rows 1..W-1, read shifted by one, or a head other "
                 "than the target's (not shared: a padded vocabulary read as the drafter's own)"),
    "candidates": ("(k, top_k)", 0, "DFlash2's candidates, each row's top_k draft logits (after "
                   "output_multiplier and softcapping; compared as sets): the rows read shifted by one"),
    "selector_scores": ("(k, top_k)", 1e-4, "DFlash2's walk: the codebooks read at the wrong rows (a key stored "
                        "without '.weight' missed at load, so left at their init) or swapped, the walk seeded with "
                        "another token than the bonus, the pair term with the wrong predecessor (the row's own "
                        "argmax for the token picked before), no hidden_projection, the rows read before the final "
                        "norm, or the unary term taken before output_multiplier and softcapping"),
    "drafts": ("(k,)", 0, "the readout shifted by one: drafts from rows 0..W-2 instead of 1..W-1 (next-token "
               "labels, or anchor-first rows read as same-position), more drafts than max_new_tokens allows, or a "
               "DFlash2 drafter run without its selector (each row's argmax)"),
    "uniforms": ("(K+1,)", 0, "the verification's uniforms: draw the kit's to reproduce a sampled case"),
    "features": ("(P or k+1, n·H)", 1e-4, "the captured target layers: a wrong layer index (one layer off), "
                 "the output after the final norm, or HF hidden_states[i] instead of [i + 1]"),
    "accepted": ("()", 0, "verification: the comparison with the target's choice, or the rejection rule (a "
                 "DFlash2 draft verified as if proposed one-hot, not with the selector's q)"),
    "context": ("(P or a+1, H)", 1e-4, "the projected context: a missing hidden_norm after fc, a missing Laguna "
                "per-capture norm (aux_hidden_norms), or the wrong rows appended: the bonus token's hidden state "
                "put into the context too early (a row past the accepted drafts), or rejected rows kept"),
    "ctx_keys": ("(hk, S, d)", 1e-4, "layer 0's context keys: no input norm on the context before k/v "
                 "(Laguna), a missing k_norm, or RoPE at the wrong context positions"),
    "ctx_values": ("(hk, S, d)", 1e-4, "layer 0's context values: no input norm on the context (Laguna)"),
}
TOKENS_PITFALL = ("the commit: the bonus token, stop handling (the tokens end at the first stop written, an "
                  "accepted draft included), trimming at max_new_tokens, or tokens equal to the mask id dropped "
                  "from the output as if they were padding")
ROUND_DRAFTS_PITFALL = ("the drafts of a round past the recorded ones (round_drafts (rounds, K), −1 past a round's "
                        "k): under CUDA graphs or a compiled step, a buffer read before it is written, a position "
                        "or length captured as a constant, or a lowering that drafts otherwise than eager; or a "
                        "drafter bug that only later rounds reach")
ACCEPTANCE_PITFALL = ("verification in the rounds past the recorded ones: the comparison with the target's "
                      "choice, the rejection rule, or the number of drafts near max_new_tokens")
# values of the whole generation, checked after the rounds' stages; the last two cannot see a drafter bug
WHOLE_RUN = ("round_drafts", "acceptance_lengths", "tokens")
DRAFTER_BLIND = ("acceptance_lengths", "tokens")


def stage_of(key: str) -> str:
    """'<stage>[.<layer>.<sublayer>].<round>' -> its stage; a whole run's value is its own."""
    return key if key in WHOLE_RUN else key.split(".")[0]


def stage_order(keys) -> list[str]:
    """The keys in the order a decode computes them: by round, then by stage, a DFlash2 drafter's convolutions
    by layer, sublayer, then in before out; the whole run's values last."""
    order = list(STAGES)

    def position(key):
        parts = key.split(".")
        if parts[0] in ("conv_in", "conv_out"):
            return int(parts[-1]), order.index("conv_in"), int(parts[1]), ("attn", "mlp").index(parts[2]), \
                parts[0] == "conv_out"
        return int(parts[-1]), order.index(parts[0]), 0, 0, False
    return sorted((k for k in keys if k not in WHOLE_RUN), key=position) + [k for k in WHOLE_RUN if k in keys]

CASES = {
    "zlab-qwen3": dict(
        pair_seed=120,
        about="z-lab DFlashDraftModel (Qwen3-8B-DFlash-b16 layout): top-level block_size, full bidirectional "
              "attention, a Qwen3 target", target="qwen3", fmt="zlab", block_size=8, layers=2,
        layer_ids=[1, 3, 4], prompt_len=6, max_new_tokens=24),
    "zlab-new-window": dict(
        pair_seed=202,
        about="the newer z-lab layout (dflash_config.block_size, rope_parameters, sliding and full layers, "
              "window 6) with a context long enough that the window bites, a Llama target",
        target="llama", fmt="zlab-new", block_size=8, layers=3, window=6, layer_ids=[1, 4], prompt_len=10,
        max_new_tokens=24),
    "laguna": dict(
        pair_seed=344,
        about="poolside Laguna: fused qkv_proj, softplus per-head gate, per-capture norms, causal sliding "
              "layers (window 6), input norm on the context, a Laguna (MoE, hybrid) target whose layers' output "
              "projections are scaled by 0.3 (so that bf16 keeps its prefill's values)", quiet_target=0.3,
        target="laguna", fmt="laguna", block_size=8, layers=2, window=6, layer_ids=[0, 2, 5], prompt_len=9,
        max_new_tokens=24),
    "k3-block-width": dict(
        pair_seed=428,
        about="K = 3 < B - 1 = 7, the drafter computing all B rows (z-lab)", target="qwen3", fmt="zlab",
        block_size=8, layers=2, layer_ids=[1, 3, 4], prompt_len=5, max_new_tokens=20, num_drafts=3),
    "k3-drafts-width": dict(
        pair_seed=502,
        about="K = 3 < B - 1 = 7, the drafter computing K+1 rows", target="qwen3", fmt="zlab", block_size=8,
        layers=2, layer_ids=[1, 3, 4], prompt_len=5, max_new_tokens=20, num_drafts=3, full_block=False),
    "sampled": dict(
        pair_seed=600,
        about="sampled at T 0.8, top-p 0.8, top-k 5, from a target whose LM head is not scaled up, so that "
              "its distributions are wide: the stored uniforms decide the accepts and draws, and the output "
              "is not its greedy decode",
        target="qwen3", fmt="zlab", block_size=8, layers=2, layer_ids=[1, 3, 4], prompt_len=6,
        max_new_tokens=24, temperature=0.8, top_p=0.8, top_k=5, seed=11, head_scale=1.0),
    "zlab-new-bidirectional": dict(
        pair_seed=718,
        about="the newer z-lab layout with dflash_config.causal false, so that its sliding layers see their "
              "window (6) on both sides, RoPE bases keyed by layer type (sliding 1e4, full 1e7), and no "
              "target_layer_ids (the default ids for 2 features); a Llama target",
        target="llama", fmt="zlab-new", block_size=8, layers=3, window=6, layer_ids=None, num_features=2,
        prompt_len=10, max_new_tokens=24, causal=False, rope_by_type={"sliding_attention": 1e4,
                                                                      "full_attention": 1e7}),
    "dflash2": dict(
        pair_seed=806,
        about="z-lab DFlash2DraftModel: a convolution around each sublayer over the block's rows, the candidate "
              "selector's walk from the bonus, every layer sliding (window 6) and bidirectional (top-level "
              "is_causal false); a Qwen3 target", target="qwen3", fmt="dflash2", block_size=8, layers=2, window=6,
        layer_ids=[1, 3, 4], prompt_len=10, max_new_tokens=24),
    "high-acceptance": dict(
        pair_seed=900,
        about="a designed pair: a target that counts through a cycle of 7 tokens and a z-lab drafter whose "
              "attention copies the context row 8 positions back, so that after the first round every draft is "
              "accepted: 8 rows enter the context each round, and a bug shows in late rounds too",
        target="qwen3", fmt="zlab", block_size=8, layers=2, layer_ids=[1, 3, 4], prompt_len=10,
        max_new_tokens=64, designed="copying"),
    "stop-in-block": dict(
        pair_seed=1000,
        about="the high-acceptance pair with a stop token that comes as an accepted draft in the middle of a "
              "block: the tokens end at it, while that round's acceptance length counts the drafts past it",
        target="qwen3", fmt="zlab", block_size=8, layers=2, layer_ids=[1, 3, 4], prompt_len=10,
        max_new_tokens=64, designed="copying", stop_ids=[6]),
    "dflash2-high-acceptance": dict(
        pair_seed=1100,
        about="a designed DFlash2 pair: the counting target and a drafter whose candidate selector knows the "
              "count (its pair term favours each token's successor) while its draft logits are near ties, so "
              "that the walk from the bonus, among 7 candidates a row, drafts whole blocks that are accepted",
        target="qwen3", fmt="dflash2", block_size=8, layers=2, window=6, layer_ids=[1, 3, 4], prompt_len=10,
        max_new_tokens=48, designed="walking", selector_top_k=7),
    "dflash2-sampled": dict(
        pair_seed=1200,
        about="the designed DFlash2 pair sampled at T 4 (the counting target's successor then has p near 0.7): each "
              "draft is drawn from the selector's softmax over its candidates with the stored draft_uniforms, and "
              "verified with min(1, p/q) against that q, the residual drawn at a rejection",
        target="qwen3", fmt="dflash2", block_size=8, layers=2, window=6, layer_ids=[1, 3, 4], prompt_len=10,
        max_new_tokens=40, designed="walking", selector_top_k=7, temperature=4.0, seed=13),
    "dflash2-scaled": dict(
        pair_seed=1302,
        about="the designed DFlash2 pair with input_embedding_scale 2, output_multiplier 3 and "
              "final_logit_softcapping 2: the block's embeddings scaled, the draft logits scaled then capped before "
              "the candidates and the selector's scores are taken", target="qwen3", fmt="dflash2", block_size=8,
        layers=2, window=6, layer_ids=[1, 3, 4], prompt_len=10, max_new_tokens=40, designed="walking",
        selector_top_k=7, scales={"input_embedding_scale": 2.0, "output_multiplier": 3.0, "final_logit_softcapping": 2.0}),
    "served": dict(
        pair_seed=1400,
        about="three requests served by one engine instance, one after another and as one batch: the copying pair "
              "of high-acceptance with a mask id the target also writes (6), prompts of 10, 13 and 7 tokens at other "
              "phases of the count, the second stopping early at a stop token; each request's values must equal "
              "its own run alone", target="qwen3", fmt="zlab", block_size=8, layers=2, layer_ids=[1, 3, 4],
        designed="copying", mask_token_id=6,
        requests=[dict(prompt_len=10, max_new_tokens=32, phase=3),
                  dict(prompt_len=13, max_new_tokens=32, phase=0, stop_ids=[5]),
                  dict(prompt_len=7, max_new_tokens=24, phase=5)]),
}


# -----------------------------------------------------------------------------
# The checkpoint pair of a case, from seeded draws (byte-identical wherever torch's CPU generator is)

def write_pair(directory: Path, case: dict, seed: int):
    """The case's target and drafter, as conformance/cases.py writes them: a vocabulary of 8, 128 positions; a designed
    case's then set to count (below)."""
    write_target(directory / "target", case["target"], seed, VOCAB, MAX_POS, case.get("head_scale", 4.0))
    raw = drafter_config(case["fmt"], case["block_size"], case["layer_ids"], VOCAB, case["layers"],
                         case.get("window", 4), causal=case.get("causal"), rope_by_type=case.get("rope_by_type"),
                         mask_token_id=case.get("mask_token_id"))
    if "selector_top_k" in case:
        raw["dflash_config"]["selector_top_k"] = case["selector_top_k"]
    raw["dflash_config"].update(case.get("scales", {}))
    write_drafter(directory / "drafter", raw, seed + 1, case.get("num_features") or len(case["layer_ids"]))
    if case.get("quiet_target"):   # each layer's output projections scaled down: a residual stream bf16 keeps
        edit_tensors(directory / "target" / "model.safetensors", lambda t: [
            t[name].mul_(case["quiet_target"]) for name in t if name.endswith(("o_proj.weight", "down_proj.weight",
                                                                               "experts.down_proj"))])
    if case.get("designed"):
        edit_tensors(directory / "target" / "model.safetensors", counting_target)
        edit_tensors(directory / "drafter" / "model.safetensors",
                     {"copying": copying_drafter, "walking": walking_drafter}[case["designed"]])


# A designed pair, made from the seeded one: the target counts through CYCLE (its text is periodic, 7 tokens),
# the drafter knows how. Every token x embeds as e0 + e_{1+x} (e_i a unit vector of the hidden space); the
# seeded weights stay in, scaled down, so that every layer and every capture still differs.
CYCLE = [0, 3, 1, 5, 2, 6, 4]                                        # the mask token, 7, is never written
SUCCESSOR = {x: CYCLE[(i + 1) % len(CYCLE)] for i, x in enumerate(CYCLE)}


def edit_tensors(path: Path, edit):
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def unit(i: int, size: int = H) -> torch.Tensor:
    return torch.eye(size)[i]


def counting_target(t: dict):
    """Embeddings e0 + e_{1+x}; an LM head whose row y reads e_{1+x} for x's successor y; layers that add
    only a little (their output projections times 0.02): the greedy text walks CYCLE."""
    t["model.embed_tokens.weight"] = torch.stack([unit(0) + unit(1 + x) for x in range(VOCAB)]) \
        + 0.05 * t["model.embed_tokens.weight"]
    head = torch.zeros(VOCAB, H)
    for x, y in SUCCESSOR.items():
        head[y] += unit(1 + x)
    t["lm_head.weight"] = 3.0 * head + 0.02 * t["lm_head.weight"]
    for name in t:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] *= 0.02


def copying_drafter(t: dict, offset: int = 8, sharpness: float = 14.0):
    """A z-lab drafter whose layer 0 attends from each block row to the context row `offset` positions
    back (its query is its key rotated by RoPE's angles for -offset, sharpened by q/k norms of `sharpness`)
    and copies that row's token into the row: with text of period 7, the token 8 back is the one before the
    row's own, so the target's LM head reads the row's own token. The rest adds only a little."""
    n, d = t["fc.weight"].shape[1] // H, t["layers.0.self_attn.q_norm.weight"].shape[0]
    t["fc.weight"] = torch.cat([torch.eye(H)] * n, 1) / n + 0.02 * t["fc.weight"]   # the captures' mean
    key, query = torch.zeros(d), torch.zeros(d)
    for f in (0, 1):   # RoPE's two fastest frequencies (base 1e6, d 8): 1 and 0.0316 radians a position
        angle = -offset * 1e6 ** (-2 * f / d)
        key[f], query[f], query[f + d // 2] = 1.0, math.cos(angle), math.sin(angle)
    p, heads, kv_heads = "layers.0.self_attn.", t["layers.0.self_attn.q_proj.weight"].shape[0] // d, \
        t["layers.0.self_attn.k_proj.weight"].shape[0] // d
    t[p + "q_proj.weight"] = torch.outer(query.repeat(heads), unit(0)) + 0.01 * t[p + "q_proj.weight"]   # from e0
    t[p + "k_proj.weight"] = torch.outer(key.repeat(kv_heads), unit(0)) + 0.01 * t[p + "k_proj.weight"]
    token_dims = torch.eye(H)[1:1 + d]                                            # (d, H): e_1 .. e_d
    t[p + "v_proj.weight"] = token_dims.repeat(kv_heads, 1) + 0.01 * t[p + "v_proj.weight"]
    t[p + "o_proj.weight"] = token_dims.T.repeat(1, heads) / heads + 0.01 * t[p + "o_proj.weight"]
    t[p + "q_norm.weight"] = torch.full((d,), sharpness)
    t[p + "k_norm.weight"] = torch.full((d,), sharpness)
    for name in t:
        if name.endswith("down_proj.weight") or name.startswith("layers.1.self_attn.o_proj"):
            t[name] *= 0.05


def walking_drafter(t: dict, strength: float = 5.0):
    """A DFlash2 drafter whose layers add only a little (so its draft logits are near ties), and whose
    selector's pair term is `strength` times its hidden's e0 (about 4) when a candidate is the predecessor's
    successor: the walk counts on from the bonus while the successor is among a row's candidates."""
    for name in t:
        if name.endswith(("o_proj.weight", "down_proj.weight", "kernel_projection.weight")):
            t[name] *= 0.05
    s, rank = "candidate_selector.", t["candidate_selector.predecessor_codebook"].shape[1]
    t[s + "hidden_projection.weight"] = strength * unit(0).expand(rank, -1) + 0.01 * t[s + "hidden_projection.weight"]
    t[s + "predecessor_codebook"] = torch.eye(VOCAB, rank) + 0.01 * t[s + "predecessor_codebook"]
    successor = torch.zeros(VOCAB, rank)
    for x, y in SUCCESSOR.items():
        successor[y, x] = 1.0
    t[s + "successor_codebook"] = successor + 0.01 * t[s + "successor_codebook"]


# -----------------------------------------------------------------------------
# Recording the stages of a generation

class Recorded(Exception):
    """A replay's value, recorded: the replay goes no further."""

    def __init__(self, value):
        super().__init__("recorded")
        self.value = value


class Recorder:
    """'<stage>.<round>' -> tensor, for rounds 0..ROUNDS; `calls` counts target passes (round = calls - 1)."""

    def __init__(self, stop_at: str | None = None):
        self.values, self.calls, self.stop_at = {}, 0, stop_at   # stop_at: a key, recorded, ends the run
        self.target_margin = self.draft_margin = float("inf")   # the least gap any greedy choice won by
        self.last_hidden = None        # the drafter's block output, until its propose records the readout
        self.features = []             # fastpath: target passes since the last verify
        self.prefill_context = None    # fastpath: the prefill's context rows so far (it appends in chunks)
        self.accepted = 0              # fastpath: the last verify's accepted count

    def put(self, stage: str, r: int, value):
        if r <= ROUNDS:
            self.values[f"{stage}.{r}"] = torch.as_tensor(value).detach().to("cpu").clone()
            if self.stop_at == f"{stage}.{r}":
                raise Recorded(self.values[self.stop_at])

    def put_readout(self, r: int, hidden, target, drafter):
        self.put("hidden", r, hidden)
        top = drafter.draft_logits(hidden[1:], target.get_output_embeddings()).topk(5, dim=-1)   # (W-1, 5) each
        self.put("top5_logits", r, top.values)
        self.put("top5_ids", r, top.indices)
        if drafter.candidate_selector is None:   # a DFlash drafter drafts the argmax; DFlash2's walk: below
            self.draft_margin = min(self.draft_margin, float((top.values[:, 0] - top.values[:, 1]).min()))

    def drafter_parts(self, r_now, drafter):
        """Patches that record DFlash2's stages as either file runs them: each convolution (conv_in, the
        sublayer's input; conv_out, what it adds to the residual) by layer and sublayer, and the selector's
        candidates and scores, by candidate id."""
        real_conv, real_select, real_scores, scores = dflash.GroupedDynamicCausalConv.forward, \
            dflash.CandidateSelector.forward, dflash.CandidateSelector.scores, []
        where = {id(conv): f"{l}.{sublayer}" for l, layer in enumerate(drafter.layers)
                 for sublayer, conv in (("attn", layer.attention_conv), ("mlp", layer.mlp_conv)) if conv is not None}

        def conv_forward(conv, a, sublayer, block):
            def recorded(z):
                self.put(f"conv_in.{where[id(conv)]}", r_now(), z)
                return sublayer(z)
            out = real_conv(conv, a, recorded, block)
            self.put(f"conv_out.{where[id(conv)]}", r_now(), out)
            return out

        def select(selector, hidden, logits, anchor, temperature, uniforms):
            scores.clear()
            drafts, candidates, q = real_select(selector, hidden, logits, anchor, temperature, uniforms)
            top2 = torch.stack(scores).topk(2, dim=-1).values                          # (k, 2) the walk's choices
            gaps = [top2[:, 0] - top2[:, 1]]
            if selector.top_k < logits.shape[-1]:   # and which tokens are candidates
                edge = logits.topk(selector.top_k + 1, dim=-1).values[:, -2:]          # (k, 2)
                gaps.append(edge[:, 0] - edge[:, 1])
            self.draft_margin = min([self.draft_margin] + [float(g.min()) for g in gaps])
            order = candidates.argsort(-1)                                              # (k, top_k) by id
            self.put("candidates", r_now(), candidates.gather(-1, order))
            self.put("selector_scores", r_now(), torch.stack(scores).gather(-1, order))
            return drafts, candidates, q

        def score(selector, *args):
            scores.append(real_scores(selector, *args))
            return scores[-1]
        return [mock.patch.object(dflash.GroupedDynamicCausalConv, "forward", conv_forward),
                mock.patch.object(dflash.CandidateSelector, "forward", select),
                mock.patch.object(dflash.CandidateSelector, "scores", score)]


def record_reference(target, drafter, request: dict, generate=None, stop_at: str | None = None):
    """dflash.generate on the request, every stage recorded by wrapping the functions it calls (the math
    itself is untouched). `generate` swaps in a variant (the tests' broken ports). -> the values, the
    Generation, and the Recorder (its margins: see `margin`). stop_at: raise Recorded once that key is."""
    rec, d = Recorder(stop_at), dflash
    real = {name: getattr(d, name) for name in ("target_forward", "propose", "draft_block", "verify",
                                                "append_context")}
    real_project = d.Drafter.project_context

    def target_forward(*args):
        logits, features = real["target_forward"](*args)
        top2 = logits.topk(2, dim=-1).values                                            # (N, 2)
        rec.target_margin = min(rec.target_margin, float((top2[:, 0] - top2[:, 1]).min()))
        rec.put("features", rec.calls, features)
        rec.calls += 1
        return logits, features

    def draft_block(drafter_, ctx, block_embeds):
        rec.last_hidden = real["draft_block"](drafter_, ctx, block_embeds)
        return rec.last_hidden

    def propose(drafter_, ctx, block, target_, count, sampling, uniforms):
        if uniforms is not None:   # drawn before the round's verification uniforms
            rec.put("draft_uniforms", rec.calls, uniforms)
        drafts, q = real["propose"](drafter_, ctx, block, target_, count, sampling, uniforms)
        rec.put_readout(rec.calls, rec.last_hidden, target_, drafter_)
        return drafts, q

    def verify(drafts, logits, sampling, uniforms, draft_probs=None):
        accepted, token = real["verify"](drafts, logits, sampling, uniforms, draft_probs)
        r = rec.calls - 1
        if sampling.temperature > 0:   # greedy rounds draw nothing
            rec.put("uniforms", r, uniforms)
        if r > 0:
            rec.put("drafts", r, drafts)
            rec.put("accepted", r, torch.tensor(accepted))
        return accepted, token

    def project_context(self, features):
        c = real_project(self, features)
        rec.put("context", rec.calls - 1, c)
        return c

    def append_context(drafter_, ctx, c):
        real["append_context"](drafter_, ctx, c)
        rec.put("ctx_keys", rec.calls - 1, ctx.keys[0])
        rec.put("ctx_values", rec.calls - 1, ctx.values[0])

    with ExitStack() as patches:
        for name, fn in [("target_forward", target_forward), ("propose", propose), ("draft_block", draft_block),
                         ("verify", verify), ("append_context", append_context)]:
            patches.enter_context(mock.patch.object(d, name, fn))
        patches.enter_context(mock.patch.object(d.Drafter, "project_context", project_context))
        for patch in rec.drafter_parts(lambda: rec.calls, drafter):
            patches.enter_context(patch)
        gen = (generate or d.generate)(target, drafter, request["prompt_ids"], request["max_new_tokens"],
                                       **generate_kwargs(request))
    return rec.values | whole_run_values(gen), gen, rec


def record_fastpath(target, drafter, request: dict, decoder=None) -> dict:
    """fastpath.generate (eager, on CPU) on the request, or a held Decoder's generate, its stages recorded as
    the reference's are. It verifies K+1 rows and writes K+1 context rows every round; the rows past the
    accepted ones, which its masks hide and the next round overwrites, are left out."""
    rec, f = Recorder(), fastpath
    real = {name: getattr(f, name) for name in ("propose", "draft_block", "verify", "append_context")}
    real_forward = {cls: cls.forward for cls in (f.DenseTarget, f.ModelTarget)}

    def forward_of(cls):
        def forward(self, ids, positions):
            logits, features = real_forward[cls](self, ids, positions)
            rec.features.append(features)
            return logits, features
        return forward

    def draft_block(drafter_, buf, block_embeds):
        rec.last_hidden = real["draft_block"](drafter_, buf, block_embeds)
        return rec.last_hidden

    def propose(drafter_, buf, block, target_, count, sampling, uniforms):
        drafts, q = real["propose"](drafter_, buf, block, target_, count, sampling, uniforms)
        k, r = int(buf.max_accept), rec.calls
        if k > 0:   # the reference drafts only where a draft can be verified, and walks only its k rows
            rec.put_readout(r, rec.last_hidden, target_, drafter_.module)
            if uniforms is not None:
                rec.put("draft_uniforms", r, uniforms)
            for stage in ("candidates", "selector_scores"):
                if f"{stage}.{r}" in rec.values:
                    rec.values[f"{stage}.{r}"] = rec.values[f"{stage}.{r}"][:k]
        else:                         # so its stages of this round are not the reference's
            for key in [key for key in rec.values if key.startswith(("conv_", "candidates.", "selector_scores."))
                        and key.endswith(f".{r}")]:
                del rec.values[key]
        return drafts, q

    def verify(drafts, logits, sampling, uniforms, max_accept, draft_probs=None):
        accepted, token = real["verify"](drafts, logits, sampling, uniforms, max_accept, draft_probs)
        k, r = int(max_accept), rec.calls   # calls counts verifications here, the prefill's first
        rec.put("features", r, torch.cat(rec.features) if r == 0 else rec.features[-1][:k + 1])
        if r > 0:
            rec.put("drafts", r, drafts[:k])
            rec.put("accepted", r, torch.tensor(int(accepted)))
        if sampling.temperature > 0:
            rec.put("uniforms", r, uniforms)
        rec.accepted, rec.features = int(accepted), []
        rec.calls += 1
        return accepted, token

    def append_context(drafter_, buf, c, positions):
        real["append_context"](drafter_, buf, c, positions)
        if rec.calls == 0:   # prefill chunks, appended before the prefill's verify
            r = 0
            rec.prefill_context = c if rec.prefill_context is None else torch.cat([rec.prefill_context, c])
            rows, length = rec.prefill_context, int(positions[-1]) + 1
        else:                # after a round's verify: the accepted drafts' rows and the bonus's
            r = rec.calls - 1
            rows, length = c[:rec.accepted + 1], int(positions[0]) + rec.accepted + 1
        rec.put("context", r, rows)
        rec.put("ctx_keys", r, buf.ctx_keys[0][:, :length])
        rec.put("ctx_values", r, buf.ctx_values[0][:, :length])

    with ExitStack() as patches:
        for name, fn in [("propose", propose), ("draft_block", draft_block), ("verify", verify),
                         ("append_context", append_context)]:
            patches.enter_context(mock.patch.object(f, name, fn))
        for cls in real_forward:
            patches.enter_context(mock.patch.object(cls, "forward", forward_of(cls)))
        for patch in rec.drafter_parts(lambda: rec.calls, drafter):
            patches.enter_context(patch)
        kwargs = generate_kwargs(request)
        gen = f.generate(target, drafter, request["prompt_ids"], request["max_new_tokens"], **kwargs) \
            if decoder is None else decoder.generate(request["prompt_ids"], request["max_new_tokens"],
                                                     stop_ids=kwargs["stop_ids"], seed=kwargs["seed"])
    return rec.values | whole_run_values(gen)


def record_graphed(case_dir: Path, request: dict) -> dict:
    """fastpath.generate on CUDA (float32), through its compiled and captured graphs: only what a graph replay
    leaves, the whole run's values (round_drafts, acceptance_lengths, tokens), for comparing a graphed run's
    drafts round by round with eager ones."""
    spec = loading.read_file(Path(case_dir) / "case.json", "conformance case")
    dflash.require(request["temperature"] == 0, f"--graphs: case {spec['case']} is sampled, and a CUDA generator "
                   "draws other uniforms than the kit's CPU one; give a greedy case")
    dflash.require(torch.cuda.is_available(), "--graphs: no CUDA device (the graphs are captured on CUDA only)")
    target = loading.load_target(str(Path(case_dir) / "target"), torch.float32, "cuda")
    drafter = loading.load_drafter(str(Path(case_dir) / "drafter"), target, torch.float32, "cuda")
    K = drafter.config.block_size - 1 if request["num_drafts"] is None else request["num_drafts"]
    kwargs = generate_kwargs(request)
    with closing(fastpath.Decoder(target, drafter, fastpath.capacity_for(len(request["prompt_ids"]),
                                  request["max_new_tokens"], K), K, kwargs["full_block"], kwargs["sampling"])) as dec:
        gen = dec.generate(request["prompt_ids"], request["max_new_tokens"], stop_ids=kwargs["stop_ids"],
                           seed=kwargs["seed"])
        dflash.require(bool(dec.graphs), f"--graphs: case {spec['case']} ran eagerly (its step was not captured)")
    return whole_run_values(gen)


def whole_run_values(gen) -> dict:
    """The WHOLE_RUN values of a Generation, as a dump holds them: round_drafts (rounds, K), −1 past a round's k."""
    K = len(gen.position_drafted)
    drafts = torch.tensor([r["draft"] + [-1] * (K - len(r["draft"])) for r in gen.rounds], dtype=torch.long)
    return {"round_drafts": drafts.reshape(len(gen.rounds), K),
            "acceptance_lengths": torch.tensor(gen.acceptance_lengths), "tokens": torch.tensor(gen.tokens)}


def generate_kwargs(request: dict) -> dict:
    # a case made before drafts could be drawn proposes the argmax, as its request does not say
    sampling = dflash.Sampling(request["temperature"], request["top_p"], request["top_k"],
                               request.get("drafts", "argmax"))
    return dict(num_drafts=request["num_drafts"], full_block=request["full_block"], sampling=sampling,
                seed=request["seed"], stop_ids=request.get("stop_ids", ()))


# -----------------------------------------------------------------------------
# Writing the kit

def request_of(name: str, case: dict) -> dict:
    """The case's request: a seeded prompt; a designed case's counts through CYCLE from the case's phase but
    for its 5th token, so that the first round's drafts, copied from the prompt, are rejected part way."""
    g = torch.Generator().manual_seed(len(name))
    prompt = torch.randint(0, VOCAB - 1, (case["prompt_len"],), generator=g).tolist()
    if case.get("designed"):
        prompt = [CYCLE[(case.get("phase", 3) + i) % len(CYCLE)] for i in range(case["prompt_len"])]
        prompt[4] = SUCCESSOR[prompt[4]]
    stops = {"stop_ids": case["stop_ids"]} if "stop_ids" in case else {}
    return {"prompt_ids": prompt, "max_new_tokens": case["max_new_tokens"], "num_drafts": case.get("num_drafts"),
            "full_block": case.get("full_block", True), "temperature": case.get("temperature", 0.0),
            "top_p": case.get("top_p", 1.0), "top_k": case.get("top_k", 0), "seed": case.get("seed", 0), **stops}


def requests_of(name: str, case: dict) -> list[dict]:
    """A case's requests: its one, or a served case's several (each a request of its own)."""
    return [request_of(f"{name}/{i}", case | part) for i, part in enumerate(case["requests"])] \
        if "requests" in case else [request_of(name, case)]


def load_case(case_dir: Path, dtype=torch.float32, device: str = "cpu"):
    """The pair and the spec of a kit case (None while the case is being written)."""
    case_dir = Path(case_dir)
    spec = loading.read_file(case_dir / "case.json", "conformance case") if (case_dir / "case.json").exists() else None
    target = loading.load_target(str(case_dir / "target"), dtype, device)
    drafter = loading.load_drafter(str(case_dir / "drafter"), target, dtype, device)
    return target, drafter, spec


MARGIN = 1e-2   # the least gap between the two largest logits of any row a case's tokens depend on
BF16_HEADROOM, BF16_FLOOR = 2.0, 1e-2   # a bf16 band: this many times the deviation seen, and at least this
BF16_DRIFT = 0.1    # a value bf16 moves further than this has drifted too far for a band that still catches bugs


def margin(recorder: Recorder) -> float:
    """The least gap any greedy choice of the run won by: the target's top-2 logits; a DFlash drafter's top-2
    draft logits; DFlash2's top-2 selector scores and its k-th and (k+1)-th draft logits (which are candidates)."""
    return min(recorder.target_margin, recorder.draft_margin)


def within_ties(ids, logits, tolerance: float):
    """top5_ids (W-1, 5) with each run of ranks whose expected logits lie within twice the logits' tolerance
    of the next sorted by id: near-tied tokens may come in either order in a port that is right."""
    out = ids.clone()
    for row in range(ids.shape[0]):
        start = 0
        for j in range(1, ids.shape[1] + 1):
            if j == ids.shape[1] or logits[row, j - 1] - logits[row, j] > 2 * tolerance * (1 + abs(logits[row, j])):
                out[row, start:j] = ids[row, start:j].sort().values
                start = j
    return out


def deviation(got, want) -> float:
    """The largest |got − want| / (1 + |want|), the measure every float stage's tolerance bounds."""
    return float(((got.double() - want.double()).abs() / (1 + want.double().abs())).max()) if want.numel() else 0.0


def bf16_reach(directory: Path, requests: list[dict], golden: list[dict]) -> dict:
    """What a port computing in bf16 can be held to on this case: dflash.py and fastpath.py in bf16 on CPU (two
    orders of rounding: the reference's, and the twin's fused weights) run its requests; `until` is the first key,
    in the order a decode computes them, where either moves a discrete value (an id, a draft, an acceptance, a
    token) or drifts more than BF16_DRIFT from the float32 value (None: neither, the whole run holds), and each
    float stage's tolerance before it is BF16_HEADROOM times the largest deviation seen, at least BF16_FLOOR."""
    target, drafter, _ = load_case(directory, torch.bfloat16)
    runs = [(record(target, drafter, request), want) for request, want in zip(requests, golden)
            for record in (lambda *args: record_reference(*args)[0], record_fastpath)]
    order = {key: i for i, key in enumerate(stage_order(golden[0]))}
    first, worst = len(order), {}
    for got, want in runs:
        for key in stage_order(want):
            stage = key.split(".")[0]
            if order[key] >= first:
                break
            moved = key not in got or got[key].shape != want[key].shape or \
                (key in WHOLE_RUN or not STAGES[stage][1]) and stage != "top5_ids" and \
                not torch.equal(got[key].to(want[key].dtype), want[key]) or \
                want[key].is_floating_point() and STAGES.get(stage, (0, 0))[1] and deviation(got[key], want[key]) > BF16_DRIFT
            if moved:
                first = order[key]
                break
    for got, want in runs:
        for key in [key for key in stage_order(want) if order[key] < first]:
            stage = key.split(".")[0]
            if want[key].is_floating_point() and key not in WHOLE_RUN and STAGES[stage][1]:
                worst[stage] = max(worst.get(stage, 0.0), deviation(got[key], want[key]))
    bands = {stage: max(BF16_FLOOR, float(f"{BF16_HEADROOM * dev:.2g}")) for stage, dev in worst.items()}
    for got, want in runs:   # top5 ids, whose near-ties within the band may come in either order
        for key in [key for key in stage_order(want) if order[key] < first and key.startswith("top5_ids.")]:
            logits = want["top5_logits" + key[len("top5_ids"):]].double()
            if not torch.equal(*(within_ties(ids, logits, bands["top5_logits"]) for ids in (got[key], want[key]))):
                first = min(first, order[key])
    return {"until": None if first == len(order) else stage_order(golden[0])[first], "tolerances": bands}


CASE_FILES = {"target", "drafter", "case.json", "expected.safetensors"}


def write_case(root: Path, name: str, case: dict, seed: int):
    """fill_case into a dir beside the case's, then moved into place: an interrupted write leaves the old
    case whole, never a new seed's model beside the old case.json."""
    directory = Path(root) / name
    if directory.exists() or directory.is_symlink():   # replaced whole: it must hold nothing but a case
        dflash.require(directory.is_dir(), f"conformance: {directory} is a file, not a case's dir")
        others = scripts.foreign_names(directory, CASE_FILES)
        dflash.require(not others, f"conformance: {directory} holds files a case does not ({', '.join(others)}); "
                       "move them or give another --kit")
    scripts.replace_dir(directory, lambda partial: fill_case(partial, name, case, seed))


def clear(request: dict, values: dict, gen, recorder: Recorder, target, drafter) -> bool:
    """Whether a run suits the kit: greedy, every choice wins by MARGIN (float32 rounding cannot flip a token)
    and the output holds two tokens at least; sampled, the output is not its greedy decode and holds 4
    different tokens (the draws are not forced); and its recorded rounds accept a draft (two rounds,
    greedy), so that acceptance and a multi-row context append are checked."""
    if request["temperature"] > 0:
        greedy = dflash.generate(target, drafter, request["prompt_ids"], request["max_new_tokens"]).tokens
        choices = gen.tokens != greedy and len(set(gen.tokens)) >= 4
    else:   # and not one token over and over, which a verifier that compares wrongly can still match
        choices = margin(recorder) >= MARGIN and len(set(gen.tokens)) >= 2
    accepting = sum(int(v) > 0 for k, v in values.items() if k.startswith("accepted."))   # recorded rounds
    return choices and accepting >= (1 if request["temperature"] > 0 or request.get("stop_ids") else 2)


def fill_case(directory: Path, name: str, case: dict, seed: int):
    """A case's pair from the first seed (seed, seed + 2, ...) whose runs are clear; its requests; what a bf16
    port can be held to (bf16_reach); dflash.py's values at every stage, each request's under 'request.<i>.'
    in a served case."""
    requests = requests_of(name, case)
    for seed in range(seed, seed + 40, 2):
        write_pair(directory, case, seed)
        target, drafter, _ = load_case(directory)
        runs = [record_reference(target, drafter, request) for request in requests]
        if all(clear(request, *run, target, drafter) for request, run in zip(requests, runs)):
            break
    else:
        raise ValueError(f"conformance: no seed gives case {name} clear choices and rounds that accept a draft")
    golden = [values for values, _, _ in runs]
    reach = [bf16_reach(directory, [request], [values]) for request, values in zip(requests, golden)]
    checked = [order[:order.index(r["until"])] if r["until"] else order
               for r, order in zip(reach, map(stage_order, golden))]
    drafter_stages = set(STAGES) - {"draft_uniforms", "uniforms", "features", "accepted"} | {"round_drafts"}
    bf16 = None if any(not set(map(stage_of, keys)) & drafter_stages for keys in checked) else {   # nothing of the drafter's
        "until": [r["until"] for r in reach] if "requests" in case else reach[0]["until"],
        "tolerances": {stage: max(r["tolerances"].get(stage, 0) for r in reach) for r in reach for stage in r["tolerances"]}}
    stages = {"stages": {stage: {"shape": shape, "tolerance": tol, "pitfall": pitfall}
                         for stage, (shape, tol, pitfall) in STAGES.items()},
              "tokens": {"shape": "(T,)", "tolerance": 0, "pitfall": TOKENS_PITFALL}, "bf16": bf16}
    outcomes = [{"tau": gen.tau, "acceptance_lengths": gen.acceptance_lengths} for _, gen, _ in runs]
    if "requests" in case:
        spec = {"case": name, "about": case["about"], "seed": seed, "requests": requests, "rounds_recorded": ROUNDS,
                **stages, "outcomes": outcomes}
        staged = {f"request.{i}.{key}": value for i, values in enumerate(golden) for key, value in values.items()}
    else:
        spec = {"case": name, "about": case["about"], "seed": seed, "request": requests[0], "rounds_recorded": ROUNDS,
                **stages, **outcomes[0]}
        staged = golden[0]
    (directory / "case.json").write_text(json.dumps(spec, indent=1))
    staged = {k: v for k, v in staged.items() if not k.endswith("acceptance_lengths")}   # case.json holds them
    save_file(staged, directory / "expected.safetensors", metadata={"format": "pt"})


def write_kit(root: Path = KIT, names=None):
    for name, case in CASES.items():
        if names is None or name in names:
            write_case(root, name, case, seed=case["pair_seed"])
