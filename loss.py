"""The drafter's training loss, through the target's frozen LM head (spec §7), and DFlash2's selector loss
(spec §9): the v1 weighted cross-entropy without the whole (M, V) logits, its logit-distillation variant,
and the k-way cross-entropy of the candidate selector's scores with the gold token before each row.

Shape legend as train.py's: M blocks, B block size, H hidden, V vocab; R the labelled block rows, k the
selector's candidates a row, r its rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from packed import IGNORE, to_device
from triton_ops import head_chunk_grad, triton, triton_head_chunk_grad

# Training's torch.compile settings. Inductor's FX graph cache (and with it AOTAutograd's) is off: on
# the H200 (torch 2.11) a process that found the drafter's graphs in the cache stepped 3-4x slower
# than the process that compiled them (222 against 54 ms a step, the same losses; off: 55-57 ms).
COMPILE = {"dynamic": True, "options": {"fx_graph_cache": False}}


def lm_logits(target, hidden):
    """The target's (frozen) LM head on drafter states, in the head's dtype; logits in float32 at least."""
    head = target.get_output_embeddings()
    return head(hidden.to(head.weight.dtype)).to(torch.promote_types(head.weight.dtype, torch.float32))   # (M, V)


def position_weights(block_size: int, gamma: float, device=None, dtype=torch.float32):
    """w_k = exp(-(k-1)/γ) for block rows k ≥ 1, in float64 then `dtype` (the drafter's: float32 in
    training, float64 where it is held to float64 math); the bonus row 0 has no label and weight 0."""
    k = torch.arange(block_size, dtype=torch.float64, device=device)                  # (B,)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k)).to(dtype)


def soft_chunk_grad(logits, teacher_logits, row_weights):
    """head_chunk_grad for logit distillation: logits and the teacher's logits (c, V) in the head's
    dtype, row weights (c,) -> Σ w · KL(q ‖ p), q and p the softmax of the teacher's and the drafter's
    logits, and its gradient to the logits, w · (p − q); the softmaxes in float32 (float64 for a
    float64 head). Zero when the drafter's distribution is the target's."""
    exact = torch.promote_types(logits.dtype, torch.float32)
    log_p = logits.to(exact).log_softmax(-1)                                          # (c, V)
    log_q = teacher_logits.to(exact).log_softmax(-1)                                  # (c, V)
    q = log_q.exp()
    loss = (row_weights * (q * (log_q - log_p)).sum(-1)).sum()
    d_logits = (log_p.exp() - q) * row_weights[:, None]                               # (c, V)
    return loss, d_logits.to(logits.dtype)


def head_loss_chunk(compiled: bool, soft: bool = False):
    """The chunk function FrozenHeadCrossEntropy runs. Cross-entropy: on CUDA (below float64) one
    Triton kernel, triton_head_chunk_grad; elsewhere head_chunk_grad, for `train --compile` compiled
    (inductor, dynamic rows: one compile serves every chunk length). Logit distillation:
    soft_chunk_grad, compiled the same way for --compile."""
    if soft:
        return torch.compile(soft_chunk_grad, **COMPILE) if compiled else soft_chunk_grad
    twin = torch.compile(head_chunk_grad, **COMPILE) if compiled else head_chunk_grad

    def chunk_grad(logits, labels, row_weights):
        if logits.is_cuda and triton is not None and logits.dtype != torch.float64:
            return triton_head_chunk_grad(logits, labels, row_weights)
        return twin(logits, labels, row_weights)
    return chunk_grad


class FrozenHeadCrossEntropy(torch.autograd.Function):
    """Σ_r w_r · CE(h_r Wᵀ + b, y_r) through the frozen LM head W (b its bias, if it has one, as the head
    module drafts with it at inference), without the whole (M, V) logits: rows go
    through the head CE_CHUNK at a time, and each chunk's gradient with respect to its rows,
    w · (softmax − onehot) @ W, is taken in the forward pass (W needs none); backward only scales it.
    Logits in the head's dtype, softmax in float32 (float64 for a float64 head), as lm_logits.
    `chunk_grad` is head_chunk_grad or what head_loss_chunk returns. With teacher states t_r (M, H),
    the loss is logit distillation instead: Σ_r w_r · KL(softmax(t_r Wᵀ) ‖ softmax(h_r Wᵀ)), the
    teacher's logits made chunk by chunk too, and chunk_grad is soft_chunk_grad (or it compiled).
    Returns the loss and, with top_k, each row's top_k token ids by logit (R, k), else an empty (R, 0)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk: int, chunk_grad=head_chunk_grad, teacher=None,
                bias=None, top_k: int = 0):
        loss = torch.zeros((), dtype=torch.promote_types(weight.dtype, torch.float32), device=hidden.device)
        rows, grads, candidates = hidden.to(weight.dtype), [], []   # cast once, joined once: not a cast and a copy a chunk
        for i in range(0, len(rows), chunk):
            logits = F.linear(rows[i:i + chunk], weight, bias)                        # (c, V)
            if top_k:   # DFlash2's candidates, from the logits made here anyway: no second pass through the head
                candidates.append(logits.topk(top_k, dim=-1).indices)                 # (c, k)
            wanted = labels[i:i + chunk] if teacher is None else F.linear(teacher[i:i + chunk].to(weight.dtype),
                                                                           weight, bias)
            chunk_loss, d_logits = chunk_grad(logits, wanted, row_weights[i:i + chunk])
            loss += chunk_loss
            grads.append(d_logits @ weight)                                           # (c, H)
        ctx.save_for_backward(torch.cat(grads).to(hidden.dtype))                      # (M, H)
        found = torch.cat(candidates) if top_k else labels.new_empty(len(rows), 0)   # (R, k)
        ctx.mark_non_differentiable(found)
        return loss, found

    @staticmethod
    def backward(ctx, grad_loss, _):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None, None, None, None


CE_CHUNK = 8192   # rows per LM-head pass: (8192, V) logits at a time


def block_loss(target, hidden, labels, weights, chunk_grad=head_chunk_grad, teacher=None, selector=None,
               block_ids=None, selector_weight: float = 1.0):
    """Cross-entropy through the target's LM head, weighted by block row, normalised by the weight sum.
    hidden (M, B, H), labels (M, B) on the host (make_blocks', so that finding the labelled rows waits
    for no kernel), weights (B,); chunk_grad as FrozenHeadCrossEntropy's. With teacher states (M, B, H)
    (block_teacher), the KL to the target's distribution at each labelled row instead (chunk_grad
    soft_chunk_grad). A DFlash2 drafter's `selector` adds selector_weight (α) times selector_loss, the
    blocks' ids (M, B) on the host giving each block's anchor token."""
    device, flat = hidden.device, labels.flatten()                                    # (M·B,)
    rows = (flat != IGNORE).nonzero()[:, 0]                                           # (R,) the labelled rows
    rows_here = to_device(rows, device)
    w = weights[rows_here % labels.shape[1]]                                          # (R,)
    head = target.get_output_embeddings()                                             # W (V, H), its bias or None
    wanted = None if teacher is None else teacher.flatten(0, 1)[rows_here]            # (R, H)
    gold = to_device(flat[rows], device)                                              # (R,)
    hidden_rows = hidden.flatten(0, 1)[rows_here]                                     # (R, H)
    loss, candidates = FrozenHeadCrossEntropy.apply(hidden_rows, head.weight, gold, w, CE_CHUNK, chunk_grad, wanted,
                                                    head.bias, 0 if selector is None else selector.top_k)
    loss = loss / w.sum()
    if selector is None:
        return loss
    previous = labels.roll(1, dims=1)                                                 # (M, B): row t's gold token before it,
    previous[:, 1] = block_ids[:, 0]                                                  # the anchor's before row 1
    previous = to_device(previous.flatten()[rows], device)                            # (R,)
    return loss + selector_weight * selector_loss(selector, head, hidden_rows, gold, previous, candidates, w)


def selector_loss(selector, head, hidden, gold, previous, candidates, row_weights):
    """DFlash2's selector loss (spec §9): the k-way cross-entropy of each labelled row's candidate scores
    S(b) = unary(b) + Σ_r A[previous, r] · u[r] · Bc[candidate b, r], with the gold token before the row as
    `previous` (teacher forcing), the gold token put in the last candidate's place where the top-k misses
    it; weighted by row, normalised by the weight sum. hidden (R, H) the final-normed rows, gold and
    previous (R,), candidates (R, k) their top-k by logit (FrozenHeadCrossEntropy's), row_weights (R,).
    The unary scores are the logits of the candidates, made again from their head rows so that the
    gradient reaches the drafter through them too."""
    k = candidates.shape[1]
    missing = (candidates != gold[:, None]).all(-1)                                   # (R,)
    last = torch.arange(k, device=candidates.device) == k - 1                         # (k,)
    candidates = torch.where(missing[:, None] & last, gold[:, None], candidates)       # (R, k)
    slot = (candidates == gold[:, None]).int().argmax(-1)                              # (R,) the gold's place
    rows = hidden.to(head.weight.dtype)
    unary = (head.weight[candidates] @ rows[:, :, None])[..., 0]                       # (R, k)
    if head.bias is not None:
        unary = unary + head.bias[candidates]
    pair = pair_scores(selector, candidates, previous, selector.hidden_projection(hidden))   # (R, k)
    exact = torch.promote_types(unary.dtype, torch.float32)   # the softmax in float32 at least, as the drafts' CE
    scores = unary.to(exact) + pair.to(exact)                                         # (R, k)
    ce = F.cross_entropy(scores, slot, reduction="none")                              # (R,)
    return (row_weights * ce).sum() / row_weights.sum()


def pair_scores(selector, candidates, previous, u):
    """CandidateSelector.scores' low-rank term for many rows at once: candidates (R, k), the tokens before
    (R,), the rows' projections u (R, r) -> Σ_r A[previous, r] · u[r] · Bc[candidate, r] (R, k)."""
    return (selector.successor_codebook[candidates] @ (selector.predecessor_codebook[previous] * u)[:, :, None])[..., 0]


@torch.no_grad()
def selector_walk(selector, hidden, logits, anchor_ids):
    """CandidateSelector's walk at T = 0 for many blocks at once: final-normed draft rows hidden (M, K, H),
    their logits (M, K, V), each block's anchor id (M,) -> drafts (M, K)."""
    unary, candidates = logits.topk(selector.top_k, dim=-1)                           # (M, K, k)
    u = selector.hidden_projection(hidden)                                            # (M, K, r)
    previous, drafts = anchor_ids, []                                                 # (M,)
    for t in range(hidden.shape[1]):
        scores = unary[:, t] + pair_scores(selector, candidates[:, t], previous, u[:, t])   # (M, k)
        previous = candidates[:, t].gather(-1, scores.argmax(-1, keepdim=True))[:, 0]      # (M,)
        drafts.append(previous)
    return torch.stack(drafts, 1)                                                     # (M, K)
