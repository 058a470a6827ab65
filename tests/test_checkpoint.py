"""loading.py: every released format resolved into one DraftConfig, the released configs, saving."""
import json
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

import dflash
from dflash import DFlashError
from conftest import (FORMATS, H, MAX_POS, T_LAYERS, VOCAB, drafter_config, drafter_shapes, spec_args, write_drafter)
from dflash_reference import demo, loading, scripts
from dflash_reference.conformance import cases


def test_missing_layer_ids_use_default_rule(targets, tmp_path):
    """Without target_layer_ids the drafter captures the default layers for n = fc width / H."""
    path = write_drafter(tmp_path / "d", "zlab", layer_ids=(1, 2, 3))
    config = json.loads((path / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (path / "config.json").write_text(json.dumps(config))
    drafter = loading.load_drafter(str(path), targets["qwen3"], torch.float64, "cpu")
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
    assert loading.load_draft_config(raw, T_LAYERS, 2 * H).causal == causal


def test_dflash_config_is_read_before_the_top_level():
    """Every key, RoPE's and the block size's included, from dflash_config first, then the top level
    (docs/checkpoints.md); a null in dflash_config falls through to the top level."""
    raw = drafter_config("zlab-new", 4, (1, 3))
    raw["dflash_config"].update(rope_theta=123.0, block_size=None)
    raw.update(rope_theta=456.0, block_size=8)
    raw.pop("rope_parameters", None)
    cfg = loading.load_draft_config(raw, T_LAYERS, 2 * H)
    assert cfg.rope_thetas == [123.0, 123.0] and cfg.block_size == 8
    raw["dflash_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 789.0}
    assert loading.load_draft_config(raw, T_LAYERS, 2 * H).rope_thetas == [789.0, 789.0]


RELEASED = scripts.package_data("released_configs")
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
    "zlab_Qwen3.8-27B-DFlash2.json": dict(   # its selector_rank cut to 4 here: the codebooks have a row per token
        block_size=8, mask_token_id=248070, target_layer_ids=[5, 19, 33, 47, 61], num_layers=5, num_kv_heads=8,
        causal=[False] * 5, windows=[2048] * 5, rope_thetas=[1e7] * 5, gated=False, conv_kernel_size=2,
        conv_group_size=16, selector_rank=4, selector_top_k=16, vocab_size=248320),
}


@pytest.mark.parametrize("name", sorted(RELEASED_EXPECTED))
def test_released_configs_resolve_or_are_refused(tmp_path, name):
    """Each published drafter config, at tiny widths (the same semantic keys, head counts kept, H 32, d 2)
    with random weights, loads against a tiny target of its target's depth and vocabulary and resolves as
    vLLM reads it, or is refused with one line naming every key it cannot honour."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    raw = json.loads((RELEASED / name).read_text())
    if loading.is_dflash2(raw):   # as released, at its own widths: the selector's rank
        assert loading.load_draft_config(raw, 64, 5 * raw["hidden_size"]).selector_rank == 256
        raw["dflash_config"]["selector_rank"] = 4
    raw |= {"hidden_size": H, "intermediate_size": 48, "head_dim": 2} | ({"v_head_dim": 2} if "v_head_dim" in raw else {})
    nested = raw.get("dflash_config") or {}
    layers = nested.get("num_target_layers", raw.get("num_target_layers", 24))
    target = AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=raw["vocab_size"], hidden_size=H, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True))
    shapes = cases.drafter_tensor_shapes(raw, len(nested["target_layer_ids"]))
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({k: torch.randn(shape) * 0.1 for k, shape in shapes.items()}, tmp_path / "model.safetensors")
    expected = RELEASED_EXPECTED[name]
    if isinstance(expected, str):
        with pytest.raises(DFlashError) as err:
            loading.load_drafter(str(tmp_path), target, torch.float32, "cpu")
        assert str(err.value) == expected
        return
    cfg = loading.load_drafter(str(tmp_path), target, torch.float32, "cpu").config
    assert {k: getattr(cfg, k) for k in expected} == expected


@pytest.mark.parametrize("fmt", FORMATS)
def test_kv_rows_of_the_one_projection_are_the_files_k_and_v(targets, tmp_path, fmt):
    """The modules' one qkv_proj holds the file's rows: z-lab's q/k/v_proj stacked at load, Laguna's
    qkv_proj as shipped, split [q (h·d); k (hk·d); v (hk·d)]. At position 0 (RoPE is the identity) a
    context row's key is k_norm(W_k c) and its value W_v c, with W_k, W_v read from the file."""
    path = write_drafter(tmp_path / "d", fmt, layer_ids=(1, 3, 4) if fmt == "laguna" else (1, 3))
    drafter = loading.load_drafter(str(path), targets["qwen3"], torch.float64, "cpu")
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




@pytest.mark.parametrize("fmt,layers,n", [("zlab", 2, 2), ("laguna", 5, 5)])
def test_saved_checkpoint_has_the_released_names_and_loads_back_exactly(targets, tmp_path, fmt, layers, n):
    """A drafter saved by loading.save_drafter has exactly the released format's tensor names (the
    independent list in drafter_shapes: 58 tensors for a 5-layer Laguna drafter), the same bytes as the
    file it was loaded from, and loads back to the same parameters."""
    ids = (0, 1, 2, 3, 5)[:n] if fmt == "laguna" else (1, 3)
    path = write_drafter(tmp_path / "src", fmt, layer_ids=ids, num_layers=layers)
    drafter = loading.load_drafter(str(path), targets["laguna"], torch.float32, "cpu")
    raw = json.loads((path / "config.json").read_text())
    loading.save_drafter(drafter, raw, tmp_path / "out", torch.float32)
    saved, source = load_file(tmp_path / "out" / "model.safetensors"), load_file(path / "model.safetensors")
    assert set(saved) == set(drafter_shapes(fmt, layers, n)) == set(source)
    if fmt == "laguna":
        assert len(saved) == 58
    assert all(torch.equal(saved[k], source[k]) for k in saved)
    again = loading.load_drafter(str(tmp_path / "out"), targets["laguna"], torch.float32, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), drafter.parameters()))
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "out").iterdir()}
    assert modes == {"config.json": 0o666 & ~scripts.umask(), "model.safetensors": 0o666 & ~scripts.umask()}   # as open() makes them


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
        loading.load_target(str(cut), torch.float32, "cpu")
    data = (checkpoints["llama"] / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(DFlashError, match=r"--target '.*cut': cannot load \("):
        loading.load_target(str(cut), torch.float32, "cpu")


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
    with mock.patch.object(loading.AutoModelForCausalLM, "from_pretrained") as load, pytest.raises(SystemExit) as exit:
        scripts.run(demo.main, argv=spec_args(str(tmp_path / "hybrid"), draft))
    assert exit.value.code == 2 and not load.called
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: target: layer_types has ['linear_attention'] layers (a hybrid model, e.g. Qwen3-Next or Qwen3.5): "
        "their recurrent state would advance over rejected drafts, and only K/V caches are rolled back here; "
        "not supported")
