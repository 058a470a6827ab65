"""bench_train.py: the training pipeline's floors."""

import pytest

import bench_train
from conftest import target_config


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
