"""objective.py: training blocks, and the packed forward that is dflash.draft_block for every block at once."""
import re
from unittest import mock

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

import dflash
from conftest import MASK, VOCAB, H, context_of, fresh_drafter, write_drafter
from dflash import DFlashError
from dflash_reference import loading
from dflash_reference.training import objective, train


def test_blocks_use_same_position_labels():
    """Block [x_a, m, ..., m] at anchor a has labels x_{a+k} at row k ≥ 1 (no shift), IGNORE on the
    bonus row and past the end; anchors stay in the response and leave at least one label."""
    seq = objective.Sequence(torch.arange(10, 30), prompt_len=6)                       # N = 20
    g = torch.Generator().manual_seed(0)
    blocks = objective.make_blocks([seq], 10, 4, MASK, g)
    assert len(blocks.anchors) == 10 and (blocks.sequence == 0).all()
    for j, a in enumerate(blocks.anchors.tolist()):
        assert 6 <= a <= 18
        assert blocks.block_ids[j].tolist() == [10 + a, MASK, MASK, MASK]
        want = [objective.IGNORE] + [10 + a + k if a + k < 20 else objective.IGNORE for k in (1, 2, 3)]
        assert blocks.labels[j].tolist() == want
    full = objective.make_blocks([seq], 20, 4, MASK, full_only=True)
    assert full.anchors.tolist() == list(range(6, 17))                             # every a ≤ N - B
    assert (full.labels[:, 1:] != objective.IGNORE).all()
    own = torch.arange(100, 120)[None]                                             # labels given per position
    relabelled = objective.make_blocks([seq], 20, 4, MASK, full_only=True, labels=own)
    assert relabelled.labels[:, 1:].tolist() == [[100 + a + k for k in (1, 2, 3)] for a in range(6, 17)]
    assert torch.equal(relabelled.block_ids, full.block_ids)


def test_anchors_are_resampled_and_padded():
    """Each draw picks new random anchors; a short response gives only the blocks it has, and the
    blocks of several sequences follow one another, each naming its sequence."""
    seq = objective.Sequence(torch.arange(40), prompt_len=4)
    g = torch.Generator().manual_seed(0)
    draws = [objective.make_blocks([seq], 6, 4, MASK, g).anchors.tolist() for _ in range(3)]
    assert len({tuple(d) for d in draws}) == 3 and all(d == sorted(d) for d in draws)
    short = objective.Sequence(torch.arange(7), prompt_len=4)                          # anchors 4, 5 only
    blocks = objective.make_blocks([seq, short], 4, 4, MASK, g)
    assert blocks.sequence.tolist() == [0, 0, 0, 0, 1, 1] and blocks.anchors[4:].tolist() == [4, 5]
    assert blocks.labels[4:].tolist() == [[objective.IGNORE, 5, 6, objective.IGNORE], [objective.IGNORE, 6, objective.IGNORE, objective.IGNORE]]


@pytest.mark.parametrize("fmt", ["zlab", "zlab-new", "laguna", "dflash2"])
def test_packed_forward_equals_draft_block_per_anchor(llama_data, tmp_path, fmt):
    """Each block of the packed training forward equals dflash.draft_block with the context of
    positions < a (later context rows exist but must stay unseen), for overlapping blocks, an anchor
    at 0, two sequences with different numbers of blocks whose blocks come in three runs (as
    make_blocks' padding blocks do), and bidirectional, causal and sliding-window layers; changing
    one block's inputs leaves every other block, of its sequence or not, unchanged. One RoPE table per
    base serves the context and the rows."""
    target64 = loading.load_target(str(llama_data[0]), torch.float64, "cpu")
    drafter = loading.load_drafter(str(write_drafter(tmp_path / fmt, fmt, block_size=4)), target64,
                                  torch.float64, "cpu")
    B, N = 4, 14
    c = torch.randn(2, N, H, dtype=torch.float64)                                  # (Bt, N, H)
    sequence = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 0])                        # (M,)
    anchors = torch.tensor([0, 3, 11, 2, 4, 7, 8, 10, 12, 5])                      # (M,)
    x = torch.randn(len(anchors), B, H, dtype=torch.float64)                       # (M, B, H)
    with mock.patch.object(dflash, "rope_table", wraps=dflash.rope_table) as tables:
        hidden = objective.packed_forward(drafter, c, x, sequence, anchors)           # (M, B, H)
    assert tables.call_count == len(set(drafter.config.rope_thetas))               # one table, context and rows
    for j, (b, a) in enumerate(zip(sequence.tolist(), anchors.tolist())):
        want = dflash.draft_block(drafter, context_of(drafter, c[b, :a]), x[j])
        torch.testing.assert_close(hidden[j], want, rtol=1e-10, atol=1e-10)
    moved = x.clone()
    moved[1] += 1.0                                                                # block 1 of sequence 0
    changed = (objective.packed_forward(drafter, c, moved, sequence, anchors) - hidden).abs().amax(-1) > 1e-12   # (M, B)
    assert changed[1].all() and not changed[0].any() and not changed[2:].any()
    with pytest.raises(DFlashError, match="no blocks"):
        objective.packed_forward(drafter, c, x[:0], sequence[:0], anchors[:0])
    with pytest.raises(DFlashError, match="past the context"):
        objective.packed_forward(drafter, c, x, sequence, anchors + c.shape[1] - 5)    # the last ones past N


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
    packed_mask = objective.packed_mask
    def recorded_mask(block_anchors, *rest):
        kinds.append((block_anchors.device.type, rest[-1]))
        return packed_mask(block_anchors, *rest)
    for mode, device, dtype in (("cpu", "cpu", torch.float64), ("cuda", "cuda", torch.float32),
                                ("cuda compiled", "cuda", torch.float32)):
        target = loading.load_target(str(llama_data[0]), dtype, device)
        drafter = loading.load_drafter(str(path), target, dtype, device).requires_grad_(True)
        if mode == "cuda compiled":
            torch._dynamo.reset()
            train.compile_drafter(drafter)
        c_in, x_in = (t.detach().to(device, dtype).requires_grad_() for t in (c, x))
        with mock.patch.object(objective, "packed_mask", recorded_mask):
            out = objective.packed_forward(drafter, c_in, x_in, sequence, anchors)        # (M, B, H)
        out.backward(grad_out.to(device, dtype))
        runs[mode] = [out.detach(), c_in.grad, x_in.grad] + [p.grad for p in drafter.layers.parameters()]
    assert {kind for kind in kinds if kind[0] == "cuda"} == {("cuda", True)} and ("cpu", False) in kinds   # flex on CUDA
    for mode in ("cuda", "cuda compiled"):
        assert len(runs[mode]) == len(runs["cpu"]) > 3 and all(t is not None for t in runs[mode])
        for got, want in zip(runs[mode], runs["cpu"]):
            torch.testing.assert_close(got.double().cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["zlab-new", "laguna"])
def test_packed_forward_through_flex_attention_on_cpu(llama_data, tmp_path, fmt):
    """The packed forward's flex attention (attend_packed under a PackedMask) on CPU, forward only (flex attention has no CPU backward): the
    packed forward with its sparse mask forced gives the dense path's rows within float32 rounding, both
    eagerly (flex attention unfused, as off CUDA) and from a drafter dynamo traces (flex attention
    traced into its graph; aot_eager, since inductor's CPU flex template returns no log-sum-exp). The
    CUDA test's case (flex_attention_case), in float32."""
    path, sequence, anchors, c, x, _ = flex_attention_case(tmp_path, fmt)
    c, x = c.float(), x.float()                                                     # (Bt, N, H), (M, B, H)
    target = loading.load_target(str(llama_data[0]), torch.float32, "cpu")
    packed_mask, kinds = objective.packed_mask, {}
    def recorded_mask(*args):
        mask = packed_mask(*args)
        kinds.setdefault(mode, set()).add(type(mask))
        return mask
    runs = {}
    for mode in ("dense", "flex", "flex traced"):
        drafter = loading.load_drafter(str(path), target, torch.float32, "cpu").requires_grad_(False)
        if mode == "flex traced":
            torch._dynamo.reset()
            drafter.compile(dynamic=True, backend="aot_eager")
        with torch.no_grad(), mock.patch.object(objective, "runs_flex", lambda *_: mode != "dense"), \
                mock.patch.object(objective, "packed_mask", recorded_mask):
            runs[mode] = objective.packed_forward(drafter, c, x, sequence, anchors)     # (M, B, H)
    assert kinds == {"dense": {torch.Tensor}, "flex": {objective.PackedMask}, "flex traced": {objective.PackedMask}}
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
    sequences = [objective.Sequence(torch.randint(0, VOCAB - 2, (40,), generator=g), 5) for _ in range(2)]
    blocks = objective.make_blocks(sequences, 6, 4, MASK, g)
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
    table = torch.compile(lambda p: dflash.rope_table(p, 10000.0, 16, torch.float32), **objective.COMPILE)
    _, code = run_and_get_code(table, torch.arange(10))
    assert any(computes_trig.search(c) for c in code)


def test_block_slots_keep_each_sequence_in_order():
    """Each sequence's blocks take its slots b·P, b·P+1, ... in the order they come, whatever runs
    they come in; P is the most blocks a sequence has."""
    slots, P = objective.block_slots(torch.tensor([0, 0, 0, 2, 2, 0]), 3)
    assert P == 4 and slots.tolist() == [0, 1, 2, 8, 9, 3]
    slots, P = objective.block_slots(torch.tensor([1, 1, 1]), 2)
    assert P == 3 and slots.tolist() == [3, 4, 5]


BLOCK_MASK_PARTS = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                    "q_indices", "full_q_num_blocks", "full_q_indices"]


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 40), (False, 40), (True, 3), (False, 3),
                                           (True, 1), (False, 1000)])
def test_context_tiles_are_create_block_masks(causal, window):
    """The BlockMask of context_tiles, built from the interval of context keys each row sees, is the BlockMask that
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
        rule = objective.packed_rule(anchors, B, torch.tensor(N), causal, None if window is None else torch.tensor(window))
        got = BlockMask.from_kv_blocks(*objective.context_tiles(anchors, B, N, window, tile), BLOCK_SIZE=tile,
                                       mask_mod=rule, seq_lengths=(P * B, N))
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
    """The packed rule's PackedMask (the context's BlockMask from context_tiles, tiles of 8 here, 128
    on CUDA; the rule within a block) gives the same attention as the dense mask SDPA gets from the
    rule, GQA included (float64, CPU, flex attention unfused), rows that see no context key included;
    whole tiles are skipped, and each row sees exactly: the context before its anchor, its own block's
    rows, under the layer's causal/window rule."""
    g = torch.Generator().manual_seed(0)
    Bt, P, B, N, h, hk, d = 2, 12, 4, 60, 4, 2, 8
    anchors = torch.randint(0, N - B, (Bt, P), generator=g)                         # (Bt, P)
    anchors[0, :2] = 0                                                              # no context key seen
    rule = objective.packed_rule(anchors, B, torch.tensor(N), causal, None if window is None else torch.tensor(window))
    dense = objective.packed_mask(anchors, B, N, causal, window, False)                 # (Bt, 1, P·B, N+P·B)
    q = torch.randn(Bt, h, P * B, d, dtype=torch.float64, generator=g)
    keys, values = (torch.randn(Bt, hk, N + P * B, d, dtype=torch.float64, generator=g) for _ in range(2))
    mask = objective.packed_mask(anchors, B, N, causal, window, True)
    mask = mask._replace(context=BlockMask.from_kv_blocks(*objective.context_tiles(anchors, B, N, window, 8),
                                                          BLOCK_SIZE=8, mask_mod=rule, seq_lengths=(P * B, N)))
    assert mask.context.sparsity() > 40   # percent of tiles skipped
    # unfused flex attention applies the rule itself, so the tiles are checked on their own: a tile is
    # listed (partly or wholly seen) exactly where some row of it sees some context key of it
    seen = torch.nn.functional.pad(dense[..., :N], (0, -N % 8, 0, -(P * B) % 8))     # (Bt, 1, 8·Rt, 8·Kt)
    seen = seen.unflatten(-1, (-1, 8)).unflatten(2, (-1, 8)).any(-1).any(3)          # (Bt, 1, Rt, Kt)
    assert torch.equal(mask.context.to_dense().bool(), seen)
    own = dense[..., N:].unflatten(2, (P, B)).unflatten(-1, (P, B)).diagonal(0, 2, 4)   # (Bt, 1, B, B, P)
    assert torch.equal(own, mask.own[..., None].expand_as(own))                   # every block's own rule
    got = objective.attend_packed(q, keys, values, mask)
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
    """The gradients through objective.attend_packed's two parts and their join equal SDPA's over the dense
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
        with mock.patch.object(objective, "flex_attention", dense_flex):
            attend = objective.attend_packed if sparse else dflash.attend
            out = attend(*leaves, objective.packed_mask(anchors, B, N, causal, window, sparse))
        out.backward(grad_out)
        runs[sparse] = [out.detach()] + [t.grad for t in leaves]
    for got, want in zip(runs[True], runs[False]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
