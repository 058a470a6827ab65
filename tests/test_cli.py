"""cli.py: the command line end to end, and every bad input the project knows ending in one `error:` line that
names the flag or config field and its value (the catalog), in every script."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

import bench
import bench_train
import dflash
import fastpath
from conftest import (H, HERE, command_line, MAX_POS, VOCAB, assert_same_tokens, drop_tensors, edit_config, hf_greedy, run_cli, spec_args, write_drafter)
from dflash_reference import demo, evaluation, loading, scripts
from dflash_reference.conformance import checker
from dflash_reference.training import train


def test_cli_json_matches_generate(checkpoints, targets, tmp_path):
    """`--json` prints one JSON line whose tokens equal the target's greedy decode."""
    draft = write_drafter(tmp_path / "d", "laguna", block_size=5, layer_ids=(1, 3, 4))
    result = run_cli("--target", str(checkpoints["laguna"]), "--draft", str(draft), "--prompt-ids", "5,6,7,8",
                     "--max-new-tokens", "12", "--dtype", "float64", "--device", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {"tokens", "text", "acceptance_lengths", "tau", "rounds", "drafter", "interrupted"}
    assert out["interrupted"] is False and out["drafter"] == "Laguna DFlash"
    assert_same_tokens(out["tokens"], hf_greedy(targets["laguna"], [5, 6, 7, 8], 12))
    assert out["tau"] == pytest.approx(sum(out["acceptance_lengths"]) / len(out["rounds"]))
    assert all(len(r["draft"]) <= 4 for r in out["rounds"])


def test_cli_runs_a_dflash2_drafter_and_says_so(checkpoints, targets, tmp_path):
    """`python dflash.py --draft <a DFlash2 dir>` runs it (its convolutions and selector): the target's greedy
    decode, and the stats and JSON name the drafter's kind."""
    draft = write_drafter(tmp_path / "d", "dflash2", block_size=5, layer_ids=(1, 3))
    args = ("--target", str(checkpoints["qwen3"]), "--draft", str(draft), "--prompt-ids", "5,6,7,8",
            "--max-new-tokens", "12", "--dtype", "float64", "--device", "cpu")
    out = json.loads(run_cli(*args, "--json").stdout)
    assert_same_tokens(out["tokens"], hf_greedy(targets["qwen3"], [5, 6, 7, 8], 12))
    assert out["drafter"] == "DFlash2 (convolutions of 2 taps, selector over 4 candidates)"
    text = run_cli(*args)
    assert text.returncode == 0 and re.search(r"^\s+drafter  DFlash2 \(", text.stdout, re.M), text.stdout


def test_cli_target_only_needs_no_drafter(checkpoints, targets):
    """`--target-only` decodes with the target alone, no --draft needed; --target alone is an error."""
    args = ["--target", str(checkpoints["llama"]), "--prompt-ids", "5,6,7", "--max-new-tokens", "8",
            "--dtype", "float64", "--device", "cpu"]
    alone = run_cli(*args, "--target-only", "--json")
    assert alone.returncode == 0, alone.stderr
    assert_same_tokens(json.loads(alone.stdout)["tokens"], hf_greedy(targets["llama"], [5, 6, 7], 8))
    missing = run_cli(*args)
    assert missing.returncode == 2 and "needs --draft (or --target-only)" in missing.stderr



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


# Broken drafter checkpoints: (format, breakage, message); {d} is the checkpoint dir. Each reaches the
# loader through `python dflash.py --draft {d}` against the tiny Qwen3 target (6 layers, H 32, vocab 96).
BAD_CHECKPOINTS = {
    "config missing": ("zlab", lambda p: (p / "config.json").unlink(), "draft config: {d}/config.json not found"),
    "config not an object": ("zlab", lambda p: (p / "config.json").write_text("[1, 2]"),
                             "draft config: {d}/config.json is not a JSON object of keys (it holds [1, 2])"),
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
    "hidden size mismatch": ("zlab-h48", None, "draft config: 'hidden_size' = 48 but the target's is 32: a drafter "
                             "runs on its target's embeddings and LM head"),
    "hidden size edited": ("zlab", set_top(hidden_size=64), "draft config: 'hidden_size' = 64 but the target's is "
                           "32: a drafter runs on its target's embeddings and LM head"),
    "hidden size a string": ("zlab", set_top(hidden_size="32"), "draft config: 'hidden_size' = '32' must be an "
                             "integer"),
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
    "DFlash2 architecture": ("zlab", set_top(architectures=["DFlash2DraftModel"]), "draft weights: 11 tensors missing, e.g. ['candidate_selector.h"
                             "idden_projection.weight', 'candidate_selector.predecessor_codebook', 'candidate_selector.successor_codebook']"),
    "DFlash2 keys": ("zlab", set_nested(conv_kernel_size=2, selector_top_k=16), "draft weights: 11 tensors missing, e.g. ['candidate_selector.h"
                     "idden_projection.weight', 'candidate_selector.predecessor_codebook', 'candidate_selector.successor_codebook']"),
    "DFlash2 group size": ("dflash2", set_nested(conv_group_size=5), "draft config: 'conv_group_size' = 5 does not "
                           "divide hidden_size 32 (the dynamic taps are one per group of channels)"),
    "DFlash2 vocab_size": ("dflash2", set_top(vocab_size=50), "draft config: 'vocab_size' = 50 but the target has 96 "
                           "embedding rows (a DFlash2 selector's codebooks have one row per token)"),
    "DFlash2 codebook rows": ("dflash2", put_tensor("candidate_selector.successor_codebook", torch.zeros(95, 8)),
                              "draft weights: 'candidate_selector.successor_codebook' has shape (95, 8), config "
                              "implies (96, 8)"),
    "DFlash2 conv tensor missing": ("dflash2", lambda p: drop_tensors(p, "layers.1.mlp_conv.base_kernel"),
                                    "draft weights: 1 tensors missing, e.g. ['layers.1.mlp_conv.base_kernel']"),
    "unknown architecture": ("zlab", set_top(architectures=["LlamaForCausalLM"]), "draft config: 'architectures' "
                             "= ['LlamaForCausalLM'] is not a DFlash drafter (DFlashDraftModel, DFlash2DraftModel, or a "
                             "Laguna DFlash drafter); refusing to guess its layout"),
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
    "train --seed -1": ("dflash-train", TRAIN + ["--seed", "-1"], "--seed = -1 must be in 0..2^63-1"),
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
    "--draft a file": ("dflash.py", ["--target", "{t}", "--draft", "{data}", "--prompt-ids", "1"],
                       "--draft '{data}' is a file, not a checkpoint directory"),
    "--target a file": ("dflash.py", ["--target", "{data}", "--draft", "{d}", "--prompt-ids", "1"],
                        "--target '{data}' is a file, not a checkpoint directory"),
    "--target without --draft": ("dflash.py", ["--target", "{t}"], "--target = '{t}' needs --draft (or "
                                 "--target-only)"),
    "train --heldout 99": ("dflash-train", TRAIN + ["--heldout", "99"],
                           "--heldout = 99 must be in 0..23 ({data} has 24 greedy answers)"),
    "train --data twice": ("dflash-train", TRAIN + ["--data", "{data}", "{data}"],
                           "--data: {data} given twice (its answers would train twice as often)"),
    "train --heldout 4 4": ("dflash-train", TRAIN + ["--heldout", "4", "4"], "--heldout has 2 counts for 1 --data file"),
    "train --heldout -1": ("dflash-train", TRAIN + ["--heldout", "-1"], "--heldout = -1: counts must be ≥ 0"),
    "train --heldout-tokens 0": ("dflash-train", TRAIN + ["--heldout-tokens", "0"], "--heldout-tokens = 0 must be at least 1"),
    "train --block-size 1": ("dflash-train", TRAIN + ["--block-size", "1"],
                             "--block-size = 1 must be at least 2 (the bonus and one draft)"),
    "train --layers 0": ("dflash-train", TRAIN + ["--layers", "0"], "--layers = 0 must be at least 1"),
    "train --mask-token-id past rows": ("dflash-train", TRAIN + ["--mask-token-id", str(VOCAB)],
                                        f"--mask-token-id = {VOCAB} is outside the target's {VOCAB} embedding rows"),
    "train --num-features 5": ("dflash-train", TRAIN + ["--num-features", "5"], "--num-features = 5 gives layer ids "
                               "[1, 2, 2, 2, 3] for a 6-layer target; use 1..3"),
    "train --batch-size 0": ("dflash-train", TRAIN + ["--batch-size", "0"], "--batch-size = 0 must be at least 1"),
    "train --lr 0": ("dflash-train", TRAIN + ["--lr", "0"], "--lr = 0.0 must be positive and finite"),
    "train --lr inf": ("dflash-train", TRAIN + ["--lr", "inf"], "--lr = inf must be positive and finite"),
    "train --weight-decay inf": ("dflash-train", TRAIN + ["--weight-decay", "inf"],
                                 "--weight-decay = inf must be ≥ 0 and finite"),
    "train --out a file": ("dflash-train", TRAIN + ["--out", "{data}"],
                           "--out '{data}' must name a directory for the drafter (it is a file)"),
    "train --out the target": ("dflash-train", TRAIN + ["--out", "{l}"], "--out '{l}' is the --target directory: the "
                               "drafter's config.json and model.safetensors would replace the target's"),
    "train --gamma -2": ("dflash-train", TRAIN + ["--gamma", "-2"], "--gamma = -2.0 must be positive (the loss weights "
                         "exp(-(k-1)/γ) fall with the block row k)"),
    "train --warmup -1": ("dflash-train", TRAIN + ["--warmup", "-1"],
                          "--warmup = -1.0 must be a fraction of the steps in [0, 1)"),
    "train --num-features 0": ("dflash-train", TRAIN + ["--num-features", "0"], "--num-features = 0 must be at least 1"),
    "train --heldout-tokens too few": ("dflash-train", TRAIN + ["--heldout-tokens", "2"], "held-out sequences of "
                                       "{data}: none has a response of at least block_size = 4 tokens "
                                       "(--heldout-tokens = 2)"),
    "train --init, another --block-size": ("dflash-train", TRAIN + ["--init", "{d}", "--block-size", "8"],
                                           "--block-size = 8 but the --init drafter's is 4: a checkpoint keeps its "
                                           "block, mask id and features (leave the flag out)"),
    "evaluation --seed -1": ("dflash-eval", ["--target", "{t}", "--draft", "{d}", "--out", "{tmp}/e", "--seed", "-1"],
                             "--seed = -1 must be in 0..2^63-1"),
    "distill --seed past 63 bits": ("dflash-train", DISTILL + ["--seed", str(2 ** 63)], f"--seed = {2 ** 63} must be in "
                                    "0..2^63-1"),
    "prompts --source self --seed -1": ("dflash-train", ["prompts", "--source", "self", "--target", "{l}", "--out",
                                                     "{tmp}/p.json.xz", "--seed", "-1"],
                                        "--seed = -1 must be in 0..2^63-1"),
    "evaluation --out a file": ("dflash-eval", ["--target", "{t}", "--draft", "{d}", "--out", "{data}"],
                                "--out {data} is a file; give a directory for eval.json"),
    "evaluation --limit -3": ("dflash-eval", ["--target", "{t}", "--draft", "{d}", "--out", "{tmp}/e", "--limit",
                                                "-3"], "--limit = -3 must be at least 1"),
    "train --time-budget 0": ("dflash-train", TRAIN + ["--time-budget", "0"],
                              "--time-budget = 0.0 must be positive and finite"),
    "train --time-budget inf": ("dflash-train", TRAIN + ["--time-budget", "inf"],
                                "--time-budget = inf must be positive and finite"),
    "train --data missing": ("dflash-train", TRAIN + ["--data", "{tmp}/nowhere.pt"],
                             "--data: no such file: {tmp}/nowhere.pt"),
    "train --init missing": ("dflash-train", TRAIN + ["--init", "{tmp}/nowhere"], "--init '{tmp}/nowhere': no such "
                             "directory"),
    "train without a mask id or tokenizer": ("dflash-train", TRAIN_NO_MASK,
                                             "--target '{l}' has no tokenizer: pass --mask-token-id"),
    "train --target /nonexistent": ("dflash-train", TRAIN + ["--target", "/nonexistent"],
                                    "--target '/nonexistent': no such directory"),
    "distill --batch-size 0": ("dflash-train", DISTILL + ["--batch-size", "0"], "--batch-size = 0 must be at least 1"),
    "distill --skip-prompts -1": ("dflash-train", DISTILL + ["--skip-prompts", "-1"],
                                  "--skip-prompts = -1 must be at least 0"),
    "distill --temperatures -1": ("dflash-train", DISTILL + ["--temperatures", "0", "-1"],
                                  "--temperatures: [-1.0] must be finite and ≥ 0 (0 is greedy)"),
    "distill --temperatures nan": ("dflash-train", DISTILL + ["--temperatures", "nan"],
                                   "--temperatures: [nan] must be finite and ≥ 0 (0 is greedy)"),
    "distill --time-budget 0": ("dflash-train", DISTILL + ["--time-budget", "0"],
                                "--time-budget = 0.0 must be positive and finite"),
    "distill --out a directory": ("dflash-train", DISTILL + ["--out", "{tmp}"],
                                  "--out '{tmp}' must name a file (it is a directory)"),
    "distill --out exists": ("dflash-train", DISTILL + ["--out", "{data}"], "--out '{data}' exists: pass --resume to "
                             "keep its answers and add to them, or give another file"),
    "prompts --source stdlib with --seed": ("dflash-train", ["prompts", "--source", "stdlib", "--target", "{l}", "--out",
                                            "{tmp}/p.json.xz", "--seed", "3", "--temperature", "0.5"],
                                            "--temperature, --seed: only --source self samples; --source stdlib "
                                            "reads its prompts"),
    "prompts --source file without --file": ("dflash-train", ["prompts", "--source", "file", "--target", "{l}", "--out",
                                             "{tmp}/p.json.xz"], "--source file needs --file (a text file, one "
                                             "prompt a line, or a JSON list of strings)"),
    "prompts --file with --source stdlib": ("dflash-train", ["prompts", "--source", "stdlib", "--file", "{tmp}/mine.txt",
                                            "--target", "{l}", "--out", "{tmp}/p.json.xz"],
                                            "--file names the prompts of --source file (and only of it)"),
    "prompts --file missing": ("dflash-train", ["prompts", "--source", "file", "--file", "{tmp}/none.txt", "--target",
                               "{l}", "--out", "{tmp}/p.json.xz"], "--file: {tmp}/none.txt not found"),
    "prompts --num-prompts 0": ("dflash-train", ["prompts", "--source", "stdlib", "--num-prompts", "0", "--target", "{l}",
                                "--out", "{tmp}/p.json.xz"], "--num-prompts = 0 must be at least 1"),
    "prompts --out empty": ("dflash-train", ["prompts", "--target", "{l}", "--out", ""],
                            "--out '' must name a file (it is empty)"),
    "distill without tokenizer": ("dflash-train", DISTILL, "--target '{l}': no tokenizer (prompts need its chat "
                                  "template)"),
    "distill --device tpu": ("dflash-train", DISTILL + ["--device", "tpu"],
                             "--device = 'tpu' is not a device torch knows (cpu, cuda, cuda:N, ...)"),
    # the GPU benchmarks check their flags before they look for CUDA
    "bench --new-tokens 5": ("benchmarks/bench.py", ["--new-tokens", "5"], "--new-tokens = 5 must be at least 25 (a row is "
                             "the median of its steps after the first 4, 20 at least)"),
    "bench --prompt-len 0": ("benchmarks/bench.py", ["--prompt-len", "0"], "--prompt-len = 0 must be at least 1"),
    "bench past the positions": ("benchmarks/bench.py", ["--prompt-len", "4000", "--new-tokens", "90"], "--prompt-len + "
                                 "--new-tokens = 4090 (at least 64 for the HF rows) leaves no room for a block in "
                                 "the target's 4096 positions"),
    "bench past the positions in the HF rows": ("benchmarks/bench.py", ["--prompt-len", "4020", "--new-tokens", "30"],
                                                "--prompt-len + --new-tokens = 4050 (at least 64 for the HF rows) "
                                                "leaves no room for a block in the target's 4096 positions"),
    "bench --skip misspelt": ("benchmarks/bench.py", ["--skip", "fast, dflash_ref"], "--skip: ['dflash_ref'] are not rows; "
                              "use fast, fast-ar, steps, dflash2, sampled, layers, dflash-ref, hf-eager, hf-static-compile"),
    "bench --out in a missing dir": ("benchmarks/bench.py", ["--out", "{tmp}/nowhere/b.json"],
                                     "--out {tmp}/nowhere/b.json: its directory does not exist"),
    "bench_train --steps 0": ("benchmarks/bench_train.py", ["--steps", "0"], "--steps = 0 must be at least 1"),
    "bench_train --train-batch 65": ("benchmarks/bench_train.py", ["--train-batch", "65"], "--train-batch = 65 must be at "
                                     "most 64 (the sequences a step draws from)"),
    "bench_train --skip hf-eager": ("benchmarks/bench_train.py", ["--skip", "hf-eager"], "--skip: ['hf-eager'] are not rows; "
                                    "use distill, hf, train"),
    "conformance --kit missing": ("dflash-conformance", ["--kit", "{tmp}/nokit", "check", "{data}", "--case", "laguna"],
                                  "--kit '{tmp}/nokit': no such directory"),
    "conformance --kit a file": ("dflash-conformance", ["--kit", "{data}", "write"], "--kit '{data}' is a file"),
    "conformance dump-fastpath --out in a missing dir": ("dflash-conformance", ["dump-fastpath", "--case", "laguna",
                                                                           "--out", "{tmp}/no/x.safetensors"],
                                                         "--out '{tmp}/no/x.safetensors' must name a file in a "
                                                         "directory that exists"),
    "conformance --case outside the kit": ("dflash-conformance", ["check", "{data}", "--case", "../conformance/laguna"],
                                           re.compile(r"--case = '\.\./conformance/laguna' is not in .*")),
    "bench_train --out a dir": ("benchmarks/bench_train.py", ["--out", "{tmp}"], "--out {tmp} is a directory; give a file name"),
}
# Run through a real subprocess as well, so that the exit code is the interpreter's.
IN_A_SUBPROCESS = {"--num-drafts 9", "--target /nonexistent", "--prompt-ids negative, fastpath", "train --heldout 99",
                   "anchor-first (dflash_config)", "renamed tensor"}
CATALOG = sorted(BAD_CHECKPOINTS) + sorted(BAD_FLAGS)


def cli_main(script):
    return {"dflash.py": demo.main, "fastpath.py": lambda argv: demo.main(argv, generate_fn=fastpath.generate),
            "dflash-train": train.main, "dflash-eval": evaluation.main, "benchmarks/bench.py": bench.main,
            "benchmarks/bench_train.py": bench_train.main, "dflash-conformance": checker.main}[script]


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
        scripts.run(cli_main(script), argv=argv)
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


def test_default_num_drafts_caps_k_on_every_cpu_spelling():
    """The CLI's K when none is asked for: block_size - 1 on CUDA, at most CPU_NUM_DRAFTS on CPU, however the
    CPU device is written."""
    for device in ("cpu", "cpu:0", torch.device("cpu")):
        assert scripts.default_num_drafts(16, str(device)) == scripts.CPU_NUM_DRAFTS
    assert scripts.default_num_drafts(4, "cpu") == 3
    assert scripts.default_num_drafts(16, "cuda:0") == 15


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["text", "json"])
def test_cli_ctrl_c_before_the_first_token_still_ends_as_an_interrupt(checkpoints, tmp_path, capsys, json_flag):
    """Ctrl-C while the weights load (before generate's first round) ends as any interrupt does: exit 130,
    and with --json the (empty) result with "interrupted": true; without it one `interrupted` line."""
    draft = write_drafter(tmp_path / "d", "zlab")

    def interrupted_load(*args, **kwargs):
        raise KeyboardInterrupt
    with mock.patch.object(loading, "load_drafter", interrupted_load), pytest.raises(SystemExit) as exit:
        demo.main(spec_args(checkpoints["qwen3"], draft, *json_flag))
    assert exit.value.code == 130
    captured = capsys.readouterr()
    if json_flag:
        result = json.loads(captured.out)
        assert result["interrupted"] is True and result["tokens"] == [] and result["rounds"] == []
    else:
        assert captured.out == "" and captured.err.strip() == "interrupted"


@pytest.mark.parametrize("script", ["dflash.py", "fastpath.py", "dflash-train", "dflash-eval", "dflash-conformance"])
def test_ctrl_c_while_the_modules_import_ends_with_exit_130(tmp_path, script):
    """SIGINT while a script is still importing transformers ends it with exit code 130 and no traceback. The
    signal is sent by an import hook (sitecustomize) as the import of transformers begins, so that it
    arrives there whatever the machine's speed."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, signal, sys

        class InterruptTransformers:
            def find_spec(self, name, path=None, target=None):
                if name == "transformers":
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGINT)
                return None
        sys.meta_path.insert(0, InterruptTransformers())
    """))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([*command_line(script), "--help"], capture_output=True, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "usage" not in result.stdout


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
        demo.main(spec_args(checkpoints["qwen3"], draft, "--max-new-tokens", "40", *json_flag),
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
    (demo.printer's `seen`), so the text and the token count in the stats never part; the handler in
    place before is back afterwards. Python's own handler is installed for the test, as an interactive
    run has it: a background job of a non-interactive shell starts with SIGINT ignored."""
    printed = []

    def interrupted_print(text, **kwargs):
        signal.raise_signal(signal.SIGINT)    # Ctrl-C in the middle of the print
        for _ in range(100):                  # bytecodes where Python runs the SIGINT handler
            pass
        printed.append(text)

    stream = demo.printer(None)
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
        demo.parse_args(["--help"])
    accepted = set(re.findall(r"(--[a-z][a-z-]*)", capsys.readouterr().out)) - {"--help"}
    readme = (HERE / "README.md").read_text()
    table = readme[readme.index("| flag | meaning |"):]
    table = table[:table.index("\n\n")]
    documented = {flag for row in table.splitlines()[2:] for flag in re.findall(r"(--[a-z][a-z-]*)", row.split(" | ")[0])}
    assert accepted == documented, (sorted(accepted - documented), sorted(documented - accepted))


def test_help_shows_every_default_and_names_the_implementation(capsys):
    """--help shows each flag's default, 0 and 0.0 included, and says which file decodes: the reference or its
    fast twin."""
    def help_of(main, *argv):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        return " ".join(capsys.readouterr().out.split())
    reference, fast = help_of(demo.main), help_of(lambda argv: demo.main(argv, description=demo.FAST))
    assert "samples, losslessly (default: 0.0)" in reference and "0 keeps all (default: 0)" in reference
    assert "through dflash.py, the readable reference" in reference
    assert "through fastpath.py, the fast twin of dflash.py" in fast and "readable reference" not in fast
    train_help = help_of(train.main, "train")
    assert "AdamW weight decay (default: 0.0)" in train_help and "anchors drawn (default: 0)" in train_help
    assert "in order (default: ['mtbench', 'humaneval'])" in help_of(evaluation.main)
