"""What a training step computes: blocks drawn at anchors in the target's answers, every block drafted in
one packed pass, and the loss through the target's frozen LM head (with DFlash2's selector loss).

A block at anchor a is [x_a, m, …, m] at positions a..a+B-1 with same-position labels x_{a+k} (the
DFlash paper, §3). The packed forward runs them through dflash.py's own `Drafter.forward`, each sequence
of a batch as one row: its blocks are one run of query rows against its context's K/V and themselves,
under a rule that keeps each block to the context strictly before its anchor and to its own rows, within
them the layer's causal and window rule as at inference. On CUDA the rule runs as flex attention over the
context's tiles that some row sees (`PackedMask`), elsewhere as a dense mask through SDPA.

The loss is the weighted cross-entropy of each block row with the target's own token there, through the
frozen LM head a chunk of rows at a time (never the whole (M, V) logits), or with `soft` the KL to the
target's distribution; DFlash2 adds the k-way cross-entropy of the candidate selector's scores with the
gold token before each row.

Shapes (as in dflash.py, plus): Bt sequences in a batch, N padded sequence length, M blocks, B block
size, P the most blocks a sequence of the batch has, H hidden, h/hk query/key heads, d head_dim, V vocab;
R the labelled block rows, k the selector's candidates a row, r its rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_mask, flex_attention

import dflash
from dflash import Drafter, require

try:   # CUDA builds of torch ship Triton; without it the loss's chunks run their plain-torch twin
    import triton
    import triton.language as tl
except ImportError:
    triton = None
# -----------------------------------------------------------------------------
# Training blocks: anchors in the response, same-position labels (docs/training.md)

@dataclass
class Sequence:
    """A prompt and the target's answer to it, the unit of training data (distill.py writes them)."""
    ids: torch.Tensor     # (N,) prompt ids then the target's response
    prompt_len: int       # P: positions >= P are the response, the only place anchors go



IGNORE = -100   # label of rows without a target: the bonus row, rows past the end


@dataclass
class Blocks:
    ids: torch.Tensor        # (Bt, N) sequences, right-padded
    lengths: torch.Tensor    # (Bt,) true lengths
    sequence: torch.Tensor   # (M,) which sequence each block is drawn from
    anchors: torch.Tensor    # (M,) anchor a of each block: x_a is its bonus, at position a
    block_ids: torch.Tensor  # (M, B) block inputs [x_a, m, ..., m]
    labels: torch.Tensor     # (M, B) the label of position a+k at row k ≥ 1 (same position, no shift), else IGNORE

    def drawn(self) -> int:
        """How many blocks were drawn: each has a label; the padding of make_blocks(pad_to=…) has none."""
        return int((self.labels != IGNORE).any(1).sum())


def to_device(t, device):
    """A host tensor onto `device` without waiting for the GPU: on CUDA through pinned memory, since a
    copy from pageable memory first waits for every kernel queued before it."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def pad_sequences(sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (Bt, N) and true lengths (Bt,)."""
    lengths = torch.tensor([len(s.ids) for s in sequences])                           # (Bt,)
    ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)           # (Bt, N)
    for b, seq in enumerate(sequences):
        ids[b, :len(seq.ids)] = seq.ids
    return ids, lengths


def choose_anchors(seq: Sequence, count: int, block_size: int, generator, full_only: bool) -> list[int]:
    """Anchors in the response with at least one label (every label if full_only): random without
    replacement if a generator is given, else evenly spaced."""
    last = len(seq.ids) - (block_size if full_only else 2)
    valid = list(range(seq.prompt_len, last + 1))
    if len(valid) <= count:
        return valid
    if generator is None:
        return [valid[round(i * (len(valid) - 1) / max(count - 1, 1))] for i in range(count)]
    return sorted(valid[i] for i in torch.randperm(len(valid), generator=generator)[:count].tolist())


def make_blocks(sequences: list[Sequence], count: int, block_size: int, mask_token_id: int, generator=None,
                full_only=False, anchor_lists: list[list[int]] | None = None, labels=None, pad_to: int = 1) -> Blocks:
    """Up to `count` blocks per sequence, at anchor_lists[b] if given, else by choose_anchors, one after
    another. A row's label is labels[b, a+k] (N-padded, e.g. the target's own argmax), by default the
    text's own token there. With pad_to > 1, unlabelled blocks at anchor 0 round the count M up to a
    multiple of pad_to: they add nothing to the loss, and the head's shapes repeat more often. Each goes
    to the sequence with the fewest blocks so far, so the packed forward's longest run (P) grows only
    once every sequence is as long."""
    B = block_size
    ids, lengths = pad_sequences(sequences)                                           # (Bt, N), (Bt,)
    chosen = [anchor_lists[b] if anchor_lists is not None else choose_anchors(seq, count, B, generator, full_only)
              for b, seq in enumerate(sequences)]
    sequence = torch.tensor([b for b, a in enumerate(chosen) for _ in a], dtype=torch.long)   # (M,)
    anchors = torch.tensor([x for a in chosen for x in a], dtype=torch.long)         # (M,)
    k = torch.arange(B)                                                               # (B,)
    positions = anchors[:, None] + k                                                  # (M, B)
    block_ids = torch.full((len(anchors), B), mask_token_id, dtype=torch.long)        # (M, B)
    block_ids[:, 0] = ids[sequence, anchors]
    source = ids if labels is None else labels.cpu()                                  # (Bt, N)
    in_text = positions < lengths[sequence, None]                                     # (M, B)
    row_labels = source[sequence[:, None], positions.clamp(max=ids.shape[1] - 1)]     # (M, B)
    row_labels = row_labels.masked_fill(~(in_text & (k >= 1)), IGNORE)
    extra = -len(anchors) % pad_to
    if extra:
        counts, owners = torch.bincount(sequence, minlength=len(sequences)), []         # (Bt,) blocks so far
        for _ in range(extra):
            owners.append(int(counts.argmin()))
            counts[owners[-1]] += 1
        owners = torch.tensor(owners, dtype=torch.long)                                 # (extra,)
        sequence, anchors = torch.cat([sequence, owners]), torch.cat([anchors, torch.zeros(extra, dtype=torch.long)])
        padding = torch.full((extra, B), mask_token_id, dtype=torch.long)                # (extra, B)
        padding[:, 0] = ids[owners, 0]
        block_ids = torch.cat([block_ids, padding])
        row_labels = torch.cat([row_labels, torch.full((extra, B), IGNORE, dtype=torch.long)])
    return Blocks(ids, lengths, sequence, anchors, block_ids, row_labels)


def pad_positions(features, labels, teacher, multiple: int):
    """Features (Bt, N, n·H), labels (Bt, N) and teacher states (Bt, N, H) or None padded with zeros
    and IGNORE to N a multiple of `multiple`: positions past every sequence's end are hidden from every
    block (each anchor lies before its end) and carry no label, so the loss is unchanged, and steps
    repeat fewer shapes."""
    extra = -features.shape[1] % multiple
    if not extra:
        return features, labels, teacher
    pad = lambda t: None if t is None else torch.nn.functional.pad(t, (0, 0, 0, extra))
    return pad(features), torch.nn.functional.pad(labels, (0, extra), value=IGNORE), pad(teacher)


def block_slots(sequence, Bt: int) -> tuple[torch.Tensor, int]:
    """Blocks (M,) by sequence (on the host) of Bt sequences -> each block's slot (M,) among the packed
    forward's Bt·P, sequence b's blocks in order from b·P on, and P, the most blocks a sequence has."""
    seen, index = [0] * Bt, []
    for b in sequence.tolist():
        index.append(seen[b])
        seen[b] += 1
    P = max(seen, default=0)
    return sequence * P + torch.tensor(index, dtype=torch.long), P


def packed_rule(block_anchors, block_size: int, N, causal: bool, window):
    """Which keys a row sees in the packed forward, as a flex attention mask_mod (b, head, q, kv) -> bool:
    query row q of sequence b belongs to its block q // B at anchor block_anchors[b, q // B] (Bt, P); keys
    are [context positions 0..N-1 | the sequence's P·B block rows]. A row sees the context strictly
    before its anchor and its own block's rows (the other blocks are other drafts); within that,
    dflash.visible_at applies the layer's causal/window rule to absolute positions, as at inference.
    N and the window (or None) are 0-dim tensors: the compiled drafter reads them as data, so a new length
    compiles nothing new, and inductor does not lower flex attention for a rule that closes over a
    symbolic int derived in it, such as -window (pytorch/pytorch#182606)."""
    B = block_size

    def rule(b, head, q, kv):
        block, anchor = q // B, block_anchors[b, q // B]
        row = (kv - N).clamp(min=0)                                                   # kv's block row, if one
        in_context = kv < N
        visible = torch.where(in_context, kv < anchor, row // B == block)
        if not causal and window is None:
            return visible
        key_position = torch.where(in_context, kv, anchor + row % B)                # own block's rows: same anchor
        return visible & dflash.visible_at(anchor + q % B - key_position, causal, window)
    return rule


def packed_mask(block_anchors, block_size: int, N: int, causal: bool, window: int | None, sparse: bool):
    """packed_rule's mask for block_anchors (Bt, P) over (Bt, P·B) query rows and (Bt, N + P·B) keys ->
    if sparse, a PackedMask: the context's flex attention BlockMask (its unseen 128 × 128 tiles skipped,
    its wholly seen ones skipping the rule: context_tiles) and the (B, B) rule within a block; else the
    dense (Bt, 1, P·B, N + P·B) bool mask for SDPA, the rule evaluated at every (row, key)."""
    device, B, rows = block_anchors.device, block_size, block_anchors.shape[1] * block_size
    tiles = context_tiles(block_anchors, B, N, window) if sparse else None
    N_t, window_t = (None if n is None else to_device(torch.tensor(n), device) for n in (N, window))
    rule = packed_rule(block_anchors, B, N_t, causal, window_t)
    if not sparse:
        return create_mask(rule, block_anchors.shape[0], None, rows, N + rows, device=device)
    o = torch.arange(B, device=device)                                                 # (B,) a row's place in its block
    return PackedMask(BlockMask.from_kv_blocks(*tiles, BLOCK_SIZE=TILE, mask_mod=rule, seq_lengths=(rows, N)),
                      own=dflash.visible_at(o[:, None] - o, causal, window))          # (B, B) row o sees row j


TILE = 128   # flex attention's tile of rows and keys


def context_tiles(block_anchors, block_size: int, N: int, window: int | None, tile: int = TILE):
    """The tiles of the context's N keys that packed_rule's rows see, as BlockMask.from_kv_blocks takes them:
    the BlockMask create_block_mask(rule, ...) builds with tiles of `tile`, from the interval of keys each
    row sees there, not the rule at every (row, key), which on an H200 cost 4 ms a step compiled (one
    kernel over 32 × 2,048 × 2,816 pairs) and 1.7 GiB eager. Row o of a block at anchor a (position a + o)
    sees the context [a + o − w + 1, a), w the window (None: unbounded; causal or not, every context key it
    sees lies before it). A tile is listed if some row sees some key of it, and as full if every row sees
    every key; the tiles past the rows' and keys' ends are padding that nothing sees, as create_block_mask
    pads them. -> per row tile, the partly seen key tiles' count and indices, then the full ones'."""
    (Bt, P), B, device = block_anchors.shape, block_size, block_anchors.device
    R = P * B
    w = N + B if window is None else window                                            # unbounded: wider than the keys
    o = torch.arange(B, device=device)                                                 # (B,) a row's place in its block
    anchor = block_anchors[..., None]                                                  # (Bt, P, 1)
    lo = (anchor + o - w + 1).clamp(min=0).reshape(Bt, R, 1)                           # (Bt, R, 1) context [lo, hi)
    hi = anchor.expand(Bt, P, B).reshape(Bt, R, 1)                                     # (Bt, R, 1)
    tiles = torch.arange(0, N, tile, device=device)                                   # (Kt,) each key tile's first key
    ends = tiles + tile
    rows_pad = -R % tile                                                               # padding rows see nothing
    some = F.pad((lo < hi) & (lo < ends) & (hi > tiles), (0, 0, 0, rows_pad))         # (Bt, Qt·tile, Kt) meets the tile
    every = F.pad((lo <= tiles) & (hi >= ends), (0, 0, 0, rows_pad))                   # holds it (never one past the end)
    some, every = some.unflatten(1, (-1, tile)).any(2), every.unflatten(1, (-1, tile)).all(2)   # (Bt, Qt, Kt)

    def ordered(tiles_listed):   # (Bt, Qt, Kt) -> per row tile: how many, and their key tiles first
        listed = tiles_listed[:, None].to(torch.int32)                                 # (Bt, 1, Qt, Kt)
        return (listed.sum(-1, dtype=torch.int32),
                torch.argsort(listed, dim=-1, descending=True, stable=True).to(torch.int32))
    return (*ordered(some & ~every), *ordered(every))


# -----------------------------------------------------------------------------
# The packed attention: the draft layers' rule, with the context's unseen tiles skipped

@cache
def compiled_flex_attention():
    """flex attention fused by Triton, compiled on first use (torch.compile at import would cost every
    import of this file a second or two)."""
    return torch.compile(flex_attention)


class PackedMask(NamedTuple):
    """Training's packed forward on CUDA: W query rows in blocks of B, over keys [S context keys | the
    W rows themselves]. Each row sees context keys by `context`, a flex attention BlockMask over the
    context alone (its unseen tiles skipped), and the rows of its own block by `own` (B, B) bool, the
    same for every block: the layer's causal/window rule within a block."""
    context: BlockMask
    own: torch.Tensor


def attend_packed(q, keys, values, mask: PackedMask):
    """dflash.attend under a PackedMask (the attention Drafter.forward takes on CUDA), in two parts joined by their log-sum-exps: the context through flex
    attention (only the tiles some row sees, the K/V heads shared in the kernel) and each block's own B × B
    rows as small dense products. Kept out of the flex call, the own rows add no partly seen tiles to it
    (in it, each 128-row tile of 8 blocks of 16 would meet one or two tiles of the rows' keys, 1/8 seen,
    each applying the rule)."""
    (h, W, d), hk, B = q.shape[-3:], keys.shape[-3], mask.own.shape[0]
    S = keys.shape[-2] - W                                                             # context keys
    # a compiled drafter traces flex attention into its own graph; eager calls on CUDA take the compiled
    # one (inductor's CPU flex attention returns no log-sum-exp: elsewhere the unfused one)
    flex = compiled_flex_attention() if q.is_cuda and not torch.compiler.is_compiling() else flex_attention
    out_context, aux = flex(q, keys[..., :S, :], values[..., :S, :], block_mask=mask.context, enable_gqa=True,
                            return_aux=AuxRequest(lse=True))                           # (..., h, W, d), lse (..., h, W)
    qb = q.unflatten(-3, (hk, h // hk)).unflatten(-2, (W // B, B))                     # (..., hk, g, W/B, B, d)
    kb, vb = (t[..., S:, :].unflatten(-2, (W // B, B)).unsqueeze(-4) for t in (keys, values))  # (..., hk, 1, W/B, B, d)
    exact = aux.lse.dtype                                                              # ≥ fp32, as flex's scores
    scores = qb.to(exact) @ kb.to(exact).transpose(-1, -2) * d ** -0.5               # (..., hk, g, W/B, B, B)
    scores = scores.masked_fill(~mask.own, float("-inf"))
    lse_own = scores.logsumexp(-1)                                                     # (..., hk, g, W/B, B)
    out_own = (scores - lse_own[..., None]).exp().to(vb.dtype) @ vb                    # (..., hk, g, W/B, B, d)
    out_own = out_own.flatten(-3, -2).flatten(-4, -3)                                  # (..., h, W, d)
    lse_own = lse_own.flatten(-2).flatten(-3, -2)                                      # (..., h, W)
    lse = torch.logaddexp(aux.lse, lse_own)   # (..., h, W), finite: every row sees itself (a window is ≥ 1)
    out = out_context * (aux.lse - lse).exp()[..., None] + out_own * (lse_own - lse).exp()[..., None]
    return out.to(q.dtype)


def runs_flex(device, head_dim: int) -> bool:
    """Whether the packed forward attends through flex attention (a PackedMask, attend_packed): its fused
    kernels run on CUDA, for head dims of 16 and more; elsewhere SDPA over a dense mask."""
    return device.type == "cuda" and head_dim >= 16


def packed_forward(drafter: Drafter, c, x, sequence, anchors):
    """dflash.draft_block for every block at once, through the same Drafter.forward: contexts c
    (Bt, N, H) at positions 0..N-1 and block embeddings x (M, B, H), block j of sequence sequence[j]
    at anchors[j] + 0..B-1 (both on the host). Each sequence's blocks are one run of query rows (P·B,
    padded with blocks at anchor 0 that see only themselves) against its context's K/V (each layer's
    context_kv, as at inference) and those rows, so nothing is copied per block; packed_rule keeps each
    row to the context before its anchor and its own block. Returns the final-normed hidden states
    (M, B, H)."""
    (M, B, H), (Bt, N), device = x.shape, c.shape[:2], c.device
    require(M > 0, "packed_forward: no blocks to draft (M = 0)")
    require(int(anchors.max()) < N, f"packed_forward: an anchor at {int(anchors.max())}, past the "
                   f"context's {N} positions")
    slots, P = block_slots(sequence, Bt)                                              # (M,) on the host
    block_anchors = torch.zeros(Bt * P, dtype=torch.long).index_copy(0, slots, anchors).view(Bt, P)   # (Bt, P)
    block_anchors, slots = to_device(block_anchors, device), to_device(slots, device)   # empty slots at anchor 0
    rows_x = x.new_zeros(Bt * P, B, H).index_copy(0, slots, x).view(Bt, P * B, H)     # (Bt, P·B, H)
    positions = (block_anchors[..., None] + torch.arange(B, device=device)).flatten(1)   # (Bt, P·B)
    sparse = runs_flex(device, drafter.config.head_dim)
    masks = {}   # one per distinct (causal, window) rule
    for layer in drafter.layers:
        if (layer.causal, layer.window) not in masks:
            masks[layer.causal, layer.window] = packed_mask(block_anchors, B, N, layer.causal, layer.window, sparse)
    # one RoPE table over every position a key or row takes: the context's 0..N-1, the rows' up to N+B-2
    table = drafter.rope_tables(torch.arange(N + B - 1, device=device), c.dtype)     # {θ: (N+B-1, 1, d) × 2}
    context_tables = {theta: (cos[:N], sin[:N]) for theta, (cos, sin) in table.items()}
    row_tables = {theta: (cos[positions], sin[positions]) for theta, (cos, sin) in table.items()}   # (Bt, P·B, 1, d)
    context = [layer.context_kv(c, context_tables) for layer in drafter.layers]       # L × (Bt, hk, N, d) each
    # cuDNN left out, as for the target: it plans every new shape, and each training step brings new ones
    # (H200, 32 sequences a step: 184 against 266 ms, p90 202 against 1,624)
    with sdpa_kernel(dflash.TARGET_ATTENTION):
        hidden = drafter(rows_x, row_tables, context, [masks[layer.causal, layer.window] for layer in drafter.layers],
                         block=B, attend=attend_packed if sparse else dflash.attend)
    return hidden.view(Bt * P, B, H)[slots]                                           # (M, B, H)


# -----------------------------------------------------------------------------
# The frozen LM head's cross-entropy, a chunk of rows at a time, and its gradient to the logits

def top_ids(logits, top_k: int):
    """Each row's top_k column ids by logit, largest first (c, top_k); an empty (c, 0) for top_k 0."""
    if not top_k:
        return torch.empty(len(logits), 0, dtype=torch.long, device=logits.device)
    return logits.topk(top_k, dim=-1).indices                                         # (c, k)


def head_chunk_grad(logits, labels, row_weights, top_k: int = 0):
    """One chunk of FrozenHeadCrossEntropy: logits (c, V) in the head's dtype, labels (c,), row weights
    (c,) -> Σ w · CE, its gradient to the logits, w · (softmax − onehot), in the head's dtype, with
    the softmax in float32 (float64 for a float64 head), and each row's top_k ids (top_ids). Pointwise
    but for the softmax's row sums, so that compiled (`train --compile`) it is a few fused passes over
    the logits rather than one per op. The plain-torch twin of triton_head_chunk_grad, which
    head_loss_chunk takes on CUDA."""
    exact = torch.promote_types(logits.dtype, torch.float32)
    log_p = logits.to(exact).log_softmax(-1)                                          # (c, V)
    loss = -(row_weights * log_p.gather(1, labels[:, None])[:, 0]).sum()
    onehot = torch.arange(logits.shape[1], device=logits.device) == labels[:, None]   # (c, V)
    d_logits = (log_p.exp() - onehot.to(exact)) * row_weights[:, None]                # (c, V)
    return loss, d_logits.to(logits.dtype), top_ids(logits, top_k)


if triton is not None:
    @triton.jit
    def _head_chunk_grad(Logits, Labels, Weights, Grad, RowLoss, TopIds, V, stride, BLOCK: tl.constexpr,
                         TOP: tl.constexpr, TOP_SLOTS: tl.constexpr):
        """Row r of a chunk: its log-partition log Σ exp(x) in one online pass over the row's logits x,
        then its loss w·(log Z − x[y]) and, in a second pass, its gradient w·(exp(x − log Z) − onehot(y))
        in the logits' dtype; float32 inside. With TOP > 0, also the row's TOP largest logits' columns,
        largest first: the first pass keeps each lane's three largest, and TOP steps of a merge take the
        largest lane head each; where a lane gave all three (ties crowding it, a constant row), the TOP
        are picked one at a time by passes over the row instead."""
        r = tl.program_id(0).to(tl.int64)
        row, cols = Logits + r * stride, tl.arange(0, BLOCK)
        run_max = tl.full([BLOCK], -1e30, tl.float32)   # finite: a lane past V adds exp(-inf) = 0, not NaN
        run_sum = tl.zeros([BLOCK], tl.float32)
        first = tl.full([BLOCK], -float("inf"), tl.float32)   # each lane's largest logits, largest first
        second, third = first, first
        first_id = tl.zeros([BLOCK], tl.int32)
        second_id, third_id = first_id, first_id
        for start in range(0, V, BLOCK):
            c = start + cols
            x = tl.load(row + c, mask=c < V, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(run_max, x)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.exp(x - new_max)
            run_max = new_max
            if TOP > 0:
                over_first, over_second, over_third = x > first, x > second, x > third
                third = tl.where(over_second, second, tl.where(over_third, x, third))
                third_id = tl.where(over_second, second_id, tl.where(over_third, c, third_id))
                second = tl.where(over_first, first, tl.where(over_second, x, second))
                second_id = tl.where(over_first, first_id, tl.where(over_second, c, second_id))
                first = tl.where(over_first, x, first)
                first_id = tl.where(over_first, c, first_id)
        top = tl.max(run_max, 0)
        log_z = top + tl.log(tl.sum(run_sum * tl.exp(run_max - top), 0))
        label, w = tl.load(Labels + r), tl.load(Weights + r).to(tl.float32)
        tl.store(RowLoss + r, w * (log_z - tl.load(row + label).to(tl.float32)))
        for start in range(0, V, BLOCK):
            c = start + cols
            x = tl.load(row + c, mask=c < V, other=0.0).to(tl.float32)
            grad = (tl.exp(x - log_z) - (c == label).to(tl.float32)) * w
            tl.store(Grad + r * V + c, grad.to(Grad.dtype.element_ty), mask=c < V)
        if TOP > 0:
            slots = tl.arange(0, TOP_SLOTS)
            picked = tl.zeros([TOP_SLOTS], tl.int32)
            taken = tl.zeros([BLOCK], tl.int32)
            for j in tl.static_range(TOP):   # merge the lanes' sorted threes: the largest head each step
                lane = cols == tl.argmax(first, 0)
                picked = tl.where(slots == j, tl.sum(tl.where(lane, first_id, 0), 0), picked)
                first, first_id = tl.where(lane, second, first), tl.where(lane, second_id, first_id)
                second, second_id = tl.where(lane, third, second), tl.where(lane, third_id, second_id)
                third = tl.where(lane, -float("inf"), third)
                taken += lane.to(tl.int32)
            if tl.max(taken, 0) >= 3:   # that lane's fourth might have been next: pick exactly instead
                last_value, last_id = float("inf"), -1
                for pick in range(TOP):   # the largest after the last pick, by value, then lowest column
                    best_value, best_id = -float("inf"), V
                    for start in range(0, V, BLOCK):
                        c = start + cols
                        x = tl.load(row + c, mask=c < V, other=float("-inf")).to(tl.float32)
                        after = ((x < last_value) | ((x == last_value) & (c > last_id))) & (c < V)
                        x = tl.where(after, x, -float("inf"))
                        tile_value = tl.max(x, 0)
                        tile_id = tl.min(tl.where(after & (x == tile_value), c, V), 0)
                        better = (tile_value > best_value) | ((tile_value == best_value) & (tile_id < best_id))
                        best_value = tl.where(better, tile_value, best_value)
                        best_id = tl.where(better, tile_id, best_id)
                    picked = tl.where(slots == pick, best_id, picked)
                    last_value, last_id = best_value, best_id
            tl.store(TopIds + r * TOP + slots, picked, mask=slots < TOP)


# a row's tile and the kernel's warps: 0.651 ms a chunk of 8,192 rows on the H200, 1.69× its floor (the
# fastest of twelve tried, 0.651–1.001 ms; docs/speed.md)
HEAD_BLOCK, HEAD_WARPS = 2048, 8


def triton_head_chunk_grad(logits, labels, row_weights, top_k: int = 0, block: int = HEAD_BLOCK,
                           warps: int = HEAD_WARPS):
    """head_chunk_grad as one Triton kernel, a program per row: the logits read twice (the second time
    mostly from L2) and the gradient written once. On the H200, 0.651 ms a chunk of 8,192 × 49,152
    against 1.330 for head_chunk_grad compiled by inductor. Labels must lie in [0, V) (block_loss
    drops the rows without one; checking here would read them back to the host). log Z is summed at
    the scale of the largest logit, so far from 0 (|logits| in the hundreds) it rounds more than the
    twin; a drafter's logits stay well inside that. The top_k ids come from the same first pass, with no
    topk over the vocabulary; among equal logits they may be other columns than torch.topk's."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    labels, row_weights = labels.contiguous(), row_weights.contiguous()                # read at r, not r·stride
    (c, V), exact = logits.shape, torch.promote_types(logits.dtype, torch.float32)
    require(top_k <= V, f"top_k = {top_k} must be at most the vocabulary's {V}")
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)          # (c, V)
    row_loss = torch.empty(c, dtype=exact, device=logits.device)                   # (c,)
    ids = torch.empty(c, top_k, dtype=torch.int32, device=logits.device)           # (c, k)
    if c:
        _head_chunk_grad[(c,)](logits, labels, row_weights, grad, row_loss, ids, V, logits.stride(0),
                               BLOCK=block, TOP=top_k, TOP_SLOTS=triton.next_power_of_2(max(top_k, 1)),
                               num_warps=warps)
    return row_loss.sum(), grad, ids.long()


# -----------------------------------------------------------------------------
# The loss: the drafts' weighted cross-entropy through the frozen head, and DFlash2's selector loss

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


def soft_chunk_grad(logits, teacher_logits, row_weights, top_k: int = 0):
    """head_chunk_grad for logit distillation: logits and the teacher's logits (c, V) in the head's
    dtype, row weights (c,) -> Σ w · KL(q ‖ p), q and p the softmax of the teacher's and the drafter's
    logits, its gradient to the logits, w · (p − q), and each row's top_k ids (top_ids); the softmaxes
    in float32 (float64 for a float64 head). Zero when the drafter's distribution is the target's."""
    exact = torch.promote_types(logits.dtype, torch.float32)
    log_p = logits.to(exact).log_softmax(-1)                                          # (c, V)
    log_q = teacher_logits.to(exact).log_softmax(-1)                                  # (c, V)
    q = log_q.exp()
    loss = (row_weights * (q * (log_q - log_p)).sum(-1)).sum()
    d_logits = (log_p.exp() - q) * row_weights[:, None]                               # (c, V)
    return loss, d_logits.to(logits.dtype), top_ids(logits, top_k)


def head_loss_chunk(compiled: bool, soft: bool = False):
    """The chunk function FrozenHeadCrossEntropy runs. Cross-entropy: on CUDA (below float64) one
    Triton kernel, triton_head_chunk_grad; elsewhere head_chunk_grad, for `train --compile` compiled
    (inductor, dynamic rows: one compile serves every chunk length). Logit distillation:
    soft_chunk_grad, compiled the same way for --compile."""
    if soft:
        return torch.compile(soft_chunk_grad, **COMPILE) if compiled else soft_chunk_grad
    twin = torch.compile(head_chunk_grad, **COMPILE) if compiled else head_chunk_grad

    def chunk_grad(logits, labels, row_weights, top_k: int = 0):
        if logits.is_cuda and triton is not None and logits.dtype != torch.float64:
            return triton_head_chunk_grad(logits, labels, row_weights, top_k)
        return twin(logits, labels, row_weights, top_k)
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

    With top_k (DFlash2's candidates), also each row's top_k ids by logit followed by its label (R, k + 1)
    and their logits (R, k + 1) in float32 at least, taken by chunk_grad from the logits made for the
    loss: no second pass over the vocabulary. The logits are differentiable: their gradient g reaches
    the rows as Σ_j g_j · W[id_j], W's rows summed by embedding_bag, never gathered as (R, k + 1, H).
    Without, both are empty (R, 0)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, row_weights, chunk: int, chunk_grad=head_chunk_grad, teacher=None,
                bias=None, top_k: int = 0):
        exact = torch.promote_types(weight.dtype, torch.float32)
        loss = torch.zeros((), dtype=exact, device=hidden.device)
        rows, grads, picked, picked_logits = hidden.to(weight.dtype), [], [], []   # cast once, joined once
        for i in range(0, len(rows), chunk):
            logits = F.linear(rows[i:i + chunk], weight, bias)                        # (c, V)
            wanted = labels[i:i + chunk] if teacher is None else F.linear(teacher[i:i + chunk].to(weight.dtype),
                                                                           weight, bias)
            chunk_loss, d_logits, top = chunk_grad(logits, wanted, row_weights[i:i + chunk], top_k)   # top (c, k)
            loss += chunk_loss
            grads.append(d_logits @ weight)                                           # (c, H)
            if top_k:
                ids = torch.cat([top, labels[i:i + chunk, None]], 1)                   # (c, k + 1)
                picked.append(ids)
                picked_logits.append(logits.gather(1, ids).to(exact))                 # (c, k + 1)
        ids = torch.cat(picked) if top_k else labels.new_empty(len(rows), 0)          # (R, k + 1)
        ctx.save_for_backward(torch.cat(grads).to(hidden.dtype), weight, ids)         # (M, H), W, ids
        ctx.hidden_dtype = hidden.dtype
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(ids)
        return loss, ids, torch.cat(picked_logits) if top_k else loss.new_empty(len(rows), 0)

    @staticmethod
    def backward(ctx, grad_loss, _, grad_picked_logits):
        grad, weight, ids = ctx.saved_tensors
        grad_hidden = None if grad_loss is None else grad * grad_loss.to(grad.dtype)   # (M, H)
        if grad_picked_logits is not None and ids.shape[1]:   # top_k given, its logits used
            with torch.autocast(grad.device.type, enabled=False):
                through_picks = F.embedding_bag(ids, weight, mode="sum",
                                                per_sample_weights=grad_picked_logits.to(weight.dtype))   # (R, H)
            through_picks = through_picks.to(ctx.hidden_dtype)
            grad_hidden = through_picks if grad_hidden is None else grad_hidden + through_picks
        return grad_hidden, None, None, None, None, None, None, None, None


CE_CHUNK = 8192   # rows per LM-head pass: (8192, V) logits at a time


def block_loss(target, hidden, labels, weights, chunk_grad=head_chunk_grad, teacher=None, selector=None,
               block_ids=None, selector_weight: float = 1.0, normalizer=None):
    """Cross-entropy through the target's LM head, weighted by block row, normalised by the weight sum (or
    by `normalizer`, the whole batch's across data-parallel ranks, whose losses then add up to it).
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
    loss, picked, picked_logits = FrozenHeadCrossEntropy.apply(hidden_rows, head.weight, gold, w, CE_CHUNK, chunk_grad,
                                                               wanted, head.bias, 0 if selector is None else selector.top_k)
    total = w.sum() if normalizer is None else normalizer
    loss = loss / total
    if selector is None:
        return loss
    previous = labels.roll(1, dims=1)                                                 # (M, B): row t's gold token before it,
    previous[:, 1] = block_ids[:, 0]                                                  # the anchor's before row 1
    previous = to_device(previous.flatten()[rows], device)                            # (R,)
    return loss + selector_weight * selector_loss(selector, hidden_rows, previous, picked, picked_logits, w) \
        * w.sum() / total


def selector_loss(selector, hidden, previous, picked, picked_logits, row_weights):
    """DFlash2's selector loss (docs/training.md): the k-way cross-entropy of each labelled row's candidate scores
    S(b) = unary(b) + Σ_r A[previous, r] · u[r] · Bc[candidate b, r], with the gold token before the row as
    `previous` (teacher forcing), the gold token put in the last candidate's place where the top-k misses
    it; weighted by row, normalised by the weight sum. hidden (R, H) the final-normed rows, previous (R,),
    picked (R, k + 1) each row's top-k by logit then its gold token and picked_logits (R, k + 1) their
    logits, the unary scores (FrozenHeadCrossEntropy's: through them the gradient reaches the drafter
    too), row_weights (R,)."""
    k = picked.shape[1] - 1
    candidates, gold = picked[:, :k], picked[:, k:]                                   # (R, k), (R, 1)
    missing = (candidates != gold).all(-1, keepdim=True)                              # (R, 1)
    last = torch.arange(k, device=picked.device) == k - 1                             # (k,)
    candidates = torch.where(missing & last, gold, candidates)                        # (R, k)
    unary = torch.where(missing & last, picked_logits[:, k:], picked_logits[:, :k])   # (R, k)
    slot = (candidates == gold).int().argmax(-1)                                      # (R,) the gold's place
    pair = pair_scores(selector, candidates, previous, selector.hidden_projection(hidden))   # (R, k)
    scores = unary + pair.to(unary.dtype)   # float32 at least, as the drafts' CE    # (R, k)
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
