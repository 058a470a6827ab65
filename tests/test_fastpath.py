"""fastpath.py's own parts: the dense target stack, static buffers, the held Decoder, compiled and graphed
steps (its equality with dflash.py is in test_dflash.py)."""
from contextlib import closing
from unittest import mock

import pytest
import torch

import dflash
import fastpath
from dflash import DFlashError
from conftest import (FAMILIES, FORMATS, H, MAX_POS, T_LAYERS, VOCAB, assert_same_generation, assert_same_tokens, context_of, forward_with_capture, hf_greedy, run_both, target_config, targets32_for, write_drafter, write_target)
from dflash_reference import loading


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
    target = loading.load_target(str(write_target(tmp_path / "t", family, **extra)), torch.float64, "cpu")
    drafter = loading.load_drafter(str(write_drafter(tmp_path / "d", "zlab", block_size=4)), target, torch.float64, "cpu")
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
        target = loading.load_target(str(checkpoints["qwen3"]), torch.float64, "cpu")
        drafter = loading.load_drafter(str(write_drafter(tmp_path / "d", "zlab")), target, torch.float64, "cpu")
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
    target = loading.load_target(str(tmp_path / "mla"), torch.float64, "cpu")
    drafter = loading.load_drafter(str(write_drafter(tmp_path / "d", "zlab")), target, torch.float64, "cpu")
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
    drafter = loading.load_drafter(str(write_drafter(tmp_path / "d", "zlab", block_size=16)), target, torch.float64,
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
    target = loading.load_target(str(tmp_path / "gpt2"), torch.float64, "cpu")
    drafter = loading.load_drafter(str(write_drafter(tmp_path / "d", "zlab", block_size=6)), target, torch.float64, "cpu")
    prompt = [5, 6, 7, 8, 9, 10]
    want = dflash.generate(target, drafter, prompt, 32 - len(prompt), num_drafts=5)
    got = fastpath.generate(target, drafter, prompt, 32 - len(prompt), num_drafts=5)
    assert len(want.tokens) == 26 and (got.tokens, got.rounds) == (want.tokens, want.rounds)


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


def run_parts(dec, parts, steps: int):
    """Prefill a Decoder with a fixed prompt, then run its step `parts` (eager or compiled) `steps` times."""
    with torch.inference_mode():
        dec.prefill([1, 2, 3, 4, 5])
        dec.buf.max_accept.fill_(4)
        for _ in range(steps):
            for part in parts:
                part()


@pytest.mark.parametrize("family,fmt,temperature", [("qwen3", "zlab", 0.0), ("llama", "laguna", 0.0),
                                                    ("llama", "zlab-new", 0.0), ("qwen3", "dflash2", 0.0),
                                                    ("qwen3", "dflash2", 1.0)])
def test_fastpath_parts_trace_as_one_graph_each(targets32, drafters, family, fmt, temperature):
    """The two parts the Decoder captures as CUDA graphs, draft and verify (with capture, acceptance and
    context append), each trace with fullgraph=True through AOTAutograd, as inductor would take them, a
    DFlash2 drafter's convolutions and candidate walk included (drawn at T > 0); two traced steps advance
    the buffers exactly as two eager ones."""
    target, drafter = targets32[family], drafters(family, fmt, 5, torch.float32)
    sampling = dflash.Sampling(temperature)
    with closing(fastpath.Decoder(target, drafter, 32, 4, sampling=sampling)) as eager, \
            closing(fastpath.Decoder(target, drafter, 32, 4, sampling=sampling)) as traced:
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
    target = loading.load_target(str(checkpoints["llama"]), torch.float32, "cuda")
    drafter = loading.load_drafter(str(write_drafter(tmp_path / "d", fmt, block_size=16, num_layers=2)), target,
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
    target = loading.load_target(str(checkpoints[family]), dtype, "cuda")
    fmt = "laguna" if family == "laguna" else "zlab-new"
    drafter = loading.load_drafter(str(write_drafter(tmp_path / "d", fmt, block_size=6,
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
    mask_drafts = lambda drafter, buf, block, target, count, *sampling: (block[1:1 + count], None)   # [m, ..., m]: an accepted one is still an argmax
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

    target = loading.load_target(str(checkpoints["llama"]), torch.bfloat16, "cuda")
    drafter = loading.load_drafter(str(write_drafter(tmp_path / "d", "zlab-new", block_size=6)),
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
    target = loading.load_target(str(checkpoints["qwen3"]), torch.float32, "cuda")
    drafter = loading.load_drafter(str(write_drafter(tmp_path / "d", "zlab-new", block_size=6, layer_ids=(1, 3))),
                                  target, torch.float32, "cuda")
    prompt, sampling = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], dflash.Sampling(1.0, top_p=0.95, top_k=50)
    with closing(fastpath.Decoder(target, drafter, 256, 5, sampling=sampling)) as dec:
        fast, again = dec.generate(prompt, 40, seed=3), dec.generate(prompt, 40, seed=4)
        assert dec.graphs
    ref = dflash.generate(target, drafter, prompt, 40, sampling=sampling, seed=3)
    assert_same_tokens(fast.tokens, ref.tokens)
    assert fast.acceptance_lengths == ref.acceptance_lengths
    assert again.tokens != fast.tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dflash2_graphed_rounds_equal_eager_on_cuda(checkpoints, tmp_path, temperature):
    """A DFlash2 drafter through the compiled, graphed draft and verify parts drafts what dflash.py drafts,
    round by round (the convolutions and the selector's walk inside the graph), and commits the same tokens,
    greedy and sampled (fp32, the same seed)."""
    target = loading.load_target(str(checkpoints["qwen3"]), torch.float32, "cuda")
    drafter = loading.load_drafter(str(write_drafter(tmp_path / "d", "dflash2", block_size=6, layer_ids=(1, 3))),
                                      target, torch.float32, "cuda")
    prompt, sampling = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], dflash.Sampling(temperature)
    with closing(fastpath.Decoder(target, drafter, 256, 5, sampling=sampling)) as dec:
        fast = dec.generate(prompt, 40, seed=3)
        assert dec.graphs
    ref = dflash.generate(target, drafter, prompt, 40, sampling=sampling, seed=3)
    assert fast.rounds == ref.rounds
    assert_same_tokens(fast.tokens, ref.tokens)


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
