"""objective.py: the loss through the frozen head (cross-entropy and logit distillation, chunked, its kernels),
and DFlash2's selector loss and walk."""
import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from conftest import fresh_drafter, head_chunk_cases
from dflash_reference.training.objective import CE_CHUNK, FrozenHeadCrossEntropy, block_loss, head_loss_chunk, lm_logits, position_weights, soft_chunk_grad
from dflash_reference.training import distill, objective, train


def test_loss_weights_follow_gamma_rule():
    """w_k = exp(-(k-1)/γ) for k ≥ 1 and 0 on the bonus row; γ = 7, 5, 4 for B = 16, 10, 8."""
    assert [train.default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    w = position_weights(16, 7.0)
    assert w.dtype == torch.float32 and w[0] == 0 and w[1] == 1
    torch.testing.assert_close(w[2:], torch.exp(-torch.arange(1, 15) / 7.0))
    exact = position_weights(16, 7.0, dtype=torch.float64)   # for a float64 drafter: float64's rounding
    assert torch.equal(exact[1:], torch.exp(-torch.arange(0, 15, dtype=torch.float64) / 7.0))


def test_frozen_head_cross_entropy_equals_full_logits():
    """The chunked loss through the frozen head equals the weighted cross-entropy of the whole
    logits matrix, value and gradient, with chunks that do not divide the rows: in float64 exactly,
    and with training's float32 rows through a bfloat16 head within bfloat16's rounding."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 8, dtype=torch.float64, generator=g, requires_grad=True)
    head = torch.randn(30, 8, dtype=torch.float64, generator=g)
    labels, w = torch.randint(0, 30, (50,), generator=g), torch.rand(50, dtype=torch.float64, generator=g)
    loss = FrozenHeadCrossEntropy.apply(hidden, head, labels, w, 7)[0]
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
    loss16 = FrozenHeadCrossEntropy.apply(rows, head16, labels, w.float(), 7)[0]
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
    target = copy.deepcopy(llama_data[1]).double()
    head = target.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.randn(head.weight.shape[0], dtype=torch.float64,
                                               generator=torch.Generator().manual_seed(1)), requires_grad=False)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 4, head.weight.shape[1], dtype=torch.float64, generator=g)   # (M, B, H)
    labels = torch.randint(0, head.weight.shape[0], (3, 4), generator=g)                 # (M, B)
    labels[:, 0], labels[2, 3] = objective.IGNORE, objective.IGNORE
    weights = position_weights(4, 7.0).double()                                    # (B,)
    loss = block_loss(target, hidden, labels, weights)
    w = weights.expand(3, 4)[labels != objective.IGNORE]                                     # (R,)
    ce = F.cross_entropy(lm_logits(target, hidden[labels != objective.IGNORE]), labels[labels != objective.IGNORE],
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
    loss = FrozenHeadCrossEntropy.apply(hidden, head, labels, w, 7, soft_chunk_grad, teacher)[0]
    (grad,) = torch.autograd.grad(2 * loss, hidden)
    full = hidden.detach().requires_grad_(True)
    kl = F.kl_div((full @ head.T).log_softmax(-1), (teacher @ head.T).log_softmax(-1), log_target=True,
                  reduction="none").sum(-1)                                             # (50,)
    (want_grad,) = torch.autograd.grad(2 * (w * kl).sum(), full)
    torch.testing.assert_close(loss, (w * kl).sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
    same = FrozenHeadCrossEntropy.apply(teacher, head, labels, w, 7, soft_chunk_grad, teacher)[0]
    assert abs(same.item()) < 1e-12 and loss.item() > 0.1
    torch._dynamo.reset()
    compiled = head_loss_chunk(True, soft=True)
    logits, teacher_logits = (3 * torch.randn(37, 1000, generator=g) for _ in range(2))
    w = torch.rand(37, generator=g)
    eager_loss, eager_grad, _ = soft_chunk_grad(logits, teacher_logits, w)
    compiled_loss, compiled_grad, _ = compiled(logits, teacher_logits, w)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-5, atol=1e-7)


def test_compiled_head_chunk_equals_eager_on_cpu():
    """train --compile runs the head's loss chunk (head_chunk_grad) through inductor with dynamic rows:
    on CPU in float32 it gives the eager loss and gradient to the logits within float32 rounding, for
    two chunk lengths through one compile; both equal float64 autograd. Compiled a second time (after
    dynamo's reset), it is compiled again, not read from inductor's caches (loss.COMPILE: a process
    that found the drafter's graphs there stepped 3-4x slower on the H200)."""
    from torch._dynamo.utils import counters
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        compiled = head_loss_chunk(True)
        compiled(*head_chunk_cases("cpu", torch.float32, 37, 1000)[:3])
        assert counters["inductor"]["fxgraph_cache_hit"] == counters["aot_autograd"]["autograd_cache_hit"] == 0
        assert counters["aot_autograd"]["autograd_cache_bypass"] == 1   # compiled, around the caches
    for rows in (37, 20):
        logits, labels, w, want, want_grad = head_chunk_cases("cpu", torch.float32, rows, 1000)
        eager_loss, eager_grad, _ = objective.head_chunk_grad(logits, labels, w)
        loss, grad, _ = compiled(logits, labels, w)
        assert grad.dtype == torch.float32 and grad.shape == (rows, 1000)
        torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(grad, eager_grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(grad.double(), want_grad, rtol=1e-4, atol=1e-6)


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
    compiled, eager = head_loss_chunk(True, soft), (soft_chunk_grad if soft else objective.head_chunk_grad)
    kernel_rows, kernel = [], objective.triton_head_chunk_grad
    recorded = lambda logits, *rest: kernel_rows.append(len(logits)) or kernel(logits, *rest)
    for rows in (CE_CHUNK, 1000):
        logits, labels, w, want, want_grad = head_chunk_cases("cuda", torch.bfloat16, rows, 49152, soft)
        eager_loss, eager_grad, _ = eager(logits, labels, w)
        with mock.patch.object(objective, "triton_head_chunk_grad", recorded):
            loss, grad, _ = compiled(logits, labels, w)
        assert grad.dtype == torch.bfloat16
        for got, ref in [(loss, eager_loss), (grad, eager_grad)]:
            exact = want if got.dim() == 0 else want_grad
            err, ref_err = ((t.double() - exact).abs().max().item() for t in (got, ref))
            assert err <= 2 * ref_err + 1e-6 * max(1.0, exact.abs().max().item()), (rows, err, ref_err)
    assert kernel_rows == ([] if soft else [CE_CHUNK, 1000])   # cross-entropy through the kernel


def dflash2_pair(llama_data, seed=0):
    """The tiny Llama target in float64 and a DFlash2 drafter for it, made from a fresh DFlash one by
    train.as_dflash2, with every selector weight drawn so that the pair term is not zero."""
    target = copy.deepcopy(llama_data[1]).double()
    raw, drafter = fresh_drafter(target, seed=seed)
    sizes = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5}
    drafter, raw = train.as_dflash2(target, drafter.double(), raw, sizes)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_(generator=torch.Generator().manual_seed(seed))
    return target, drafter, raw


def block_rows(target, drafter, sequences):
    blocks = objective.make_blocks(sequences, 8, drafter.config.block_size, drafter.config.mask_token_id,
                                torch.Generator().manual_seed(0))
    features, _, _ = distill.capture_features(target, blocks.ids, blocks.lengths, drafter.config.target_layer_ids,
                                            torch.float64, with_labels=False)
    return blocks, train.draft_hidden(target, drafter, blocks, features)               # (M, B, H)


def test_selector_walk_over_many_blocks_equals_the_reference_walk(llama_data):
    """The held-out estimate's walk (every block at once) drafts what dflash.CandidateSelector drafts block
    by block at T = 0, anchor first."""
    target, drafter, _ = dflash2_pair(llama_data)
    blocks, hidden = block_rows(target, drafter, llama_data[2][:6])
    with torch.no_grad():
        rows = hidden[:, 1:]                                                           # (M, K, H)
        logits = lm_logits(target, rows)                                               # (M, K, V)
        walked = objective.selector_walk(drafter.candidate_selector, rows, logits, blocks.block_ids[:, 0])
        for m in range(len(rows)):
            drafts, _, _ = drafter.candidate_selector(rows[m], logits[m], blocks.block_ids[m, 0], 0.0, None)
            assert walked[m].tolist() == drafts.tolist()
    assert (walked != logits.argmax(-1)).any()   # the pair term changed some drafts: the walk was exercised


def test_selector_loss_is_its_definition_with_the_gold_token_before_each_row(llama_data):
    """block_loss with the selector adds, row by row in float64: the k-way cross-entropy of unary logit plus
    Σ_r A[gold before, r] · u[r] · Bc[candidate, r] over the row's top-k by logit, the gold token in the last
    candidate's place where the top-k misses it, its target the gold's place; weighted by row as the drafts'
    cross-entropy. Its gradient reaches both codebooks, the projection and the drafter's rows."""
    target, drafter, _ = dflash2_pair(llama_data)
    selector, head = drafter.candidate_selector, target.get_output_embeddings().weight
    blocks, hidden = block_rows(target, drafter, llama_data[2][:6])
    weights = position_weights(drafter.config.block_size, 2.0, dtype=torch.float64)
    both = block_loss(target, hidden, blocks.labels, weights, selector=selector, block_ids=blocks.block_ids,
                      selector_weight=0.5)
    drafts_ce = block_loss(target, hidden, blocks.labels, weights)
    want, total, missed = torch.zeros((), dtype=torch.float64), 0.0, 0
    for m, t in (blocks.labels != objective.IGNORE).nonzero().tolist():
        gold = int(blocks.labels[m, t])
        before = int(blocks.block_ids[m, 0]) if t == 1 else int(blocks.labels[m, t - 1])
        logits = head @ hidden[m, t]                                                   # (V,)
        candidates = logits.topk(selector.top_k).indices.tolist()
        if gold not in candidates:
            candidates[-1], missed = gold, missed + 1
        u = selector.hidden_projection.weight @ hidden[m, t]                           # (r,)
        scores = torch.stack([logits[c] + (selector.predecessor_codebook[before] * u * selector.successor_codebook[c]).sum()
                              for c in candidates])
        want = want + weights[t] * (torch.logsumexp(scores, 0) - scores[candidates.index(gold)])
        total += float(weights[t])
    want = want / total
    assert missed > 0   # the tiny drafter misses the gold in its top-k at some rows: the injection is exercised
    torch.testing.assert_close(both - drafts_ce, 0.5 * want, rtol=1e-10, atol=1e-12)
    params = [selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight,
              drafter.layers[0].mlp.down_proj.weight]
    got = torch.autograd.grad(both - drafts_ce, params, retain_graph=True)
    expected = torch.autograd.grad(0.5 * want, params)
    for g, e in zip(got, expected):
        assert e.abs().max() > 0
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-12)


def test_frozen_head_cross_entropy_returns_each_rows_top_k_and_label_with_their_logits():
    """With top_k, the chunked head also returns each row's top-k ids by logit then its label, and their
    logits (bias included), from the logits it made for the loss; a gradient on those logits reaches the
    rows as through W[ids] · h + b, beside the loss's own (float64, chunks that do not divide the rows)."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(19, 8, generator=g, dtype=torch.float64, requires_grad=True)
    head, bias = (torch.randn(40, 8, generator=g, dtype=torch.float64), torch.randn(40, generator=g, dtype=torch.float64))
    labels, w = torch.randint(0, 40, (19,), generator=g), torch.rand(19, generator=g, dtype=torch.float64)
    loss, picked, picked_logits = FrozenHeadCrossEntropy.apply(hidden, head, labels, w, 7, objective.head_chunk_grad,
                                                               None, bias, 4)
    logits = hidden.detach() @ head.T + bias                                          # (19, 40)
    assert torch.equal(picked[:, :4], logits.topk(4, dim=-1).indices) and torch.equal(picked[:, 4], labels)
    torch.testing.assert_close(picked_logits, logits.gather(1, picked), rtol=1e-12, atol=1e-12)
    outer = torch.randn(19, 5, generator=g, dtype=torch.float64)                      # a gradient on the logits
    (got,) = torch.autograd.grad(3 * loss + (outer * picked_logits).sum(), hidden)
    full = hidden.detach().requires_grad_(True)
    want = 3 * (w * F.cross_entropy(full @ head.T + bias, labels, reduction="none")).sum() \
        + (outer * ((head[picked] @ full[:, :, None])[..., 0] + bias[picked])).sum()
    (want_grad,) = torch.autograd.grad(want, full)
    assert (outer[:, :, None] * head[picked]).sum(1).abs().max() > 0.1   # the picks' part is not negligible
    torch.testing.assert_close(got, want_grad, rtol=1e-12, atol=1e-12)
    _, none, no_logits = FrozenHeadCrossEntropy.apply(hidden, head, labels, w, 7)
    assert none.shape == no_logits.shape == (19, 0)

