"""The decoding's Triton kernels, each beside the plain-torch function it must equal.

Each section holds one computation twice: the plain-torch function, which runs on CPU, in float64 and
wherever Triton is missing, and is what the tests hold the kernel to; and its Triton kernel, which the
plain function dispatches to on CUDA. The kernels change where values live and how they are fused,
never the math: fp32 inside, results rounded to the working dtype as the plain functions round them.

  - `heads_into_place`: a dense target layer's [q; k; v] rows into rotated q and its K/V slots
    (fastpath's `DenseTarget`, distill's `BatchDecoder`);
  - `attend_upto`: attention by buffer slot, each query seeing one range of slots (fastpath, BatchDecoder);
  - `sample`: inverse-CDF draws, a token per row (fastpath's drawn drafts and verify at T > 0);
  - `topk`: the k largest of each row, largest first (DFlash2's candidates);
  - `candidate_walk`: DFlash2's candidate selector walking a block's drafts (fastpath's draft part).

Training's kernel, the loss through the frozen LM head, is beside its loss (training/objective.py).

Shapes: Bt sequences, N rows, h/hk query/key heads, d head_dim, C or S buffer slots, V vocab.
"""
import torch

import dflash

try:   # CUDA builds of torch ship Triton; without it (CPU installs) every function runs its plain-torch twin
    import triton
    import triton.language as tl
except ImportError:
    triton = None


# -----------------------------------------------------------------------------
# A target layer's heads: [q; k; v] rows -> rotated q, K/V written at their slots

def heads_into_place(attn, apply_rotary, qkv_rows, keys, values, cos, sin, slots):
    """A layer's [q; k; v] projection rows (Bt, N, (h+2·hk)·d) into heads: q and k normalised per head
    (Qwen3's q_norm/k_norm) and rotated (`apply_rotary`, cos/sin (Bt, N, d)), k and v written into
    keys/values (Bt, hk, C, d) at each row's slots (Bt, N) -> q (Bt, N, h, d). On CUDA one Triton kernel
    (`triton_heads_into_place`, the rotation as Llama/Qwen3 have it), where the compiled twin below
    is three (on the H200, SmolLM2-135M's shapes); elsewhere, and for float64, the twin: the model's own modules."""
    if qkv_rows.is_cuda and triton is not None and qkv_rows.dtype != torch.float64:
        return triton_heads_into_place(attn, qkv_rows, keys, values, cos, sin, slots)
    (Bt, N, _), hk, d = qkv_rows.shape, keys.shape[1], keys.shape[3]
    q, k, v = qkv_rows.split([qkv_rows.shape[-1] - 2 * hk * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(Bt, N, -1, d), k.view(Bt, N, hk, d), v.view(Bt, N, hk, d)
    if hasattr(attn, "q_norm"):   # Qwen3 normalises q and k per head before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary(q, k, cos, sin, unsqueeze_dim=2)                                # cos, sin as (Bt, N, 1, d)
    rows = torch.arange(Bt, device=qkv_rows.device)[:, None]                           # (Bt, 1)
    keys[rows, :, slots] = k                                                            # (Bt, N, hk, d) into (Bt, hk, C, d)
    values[rows, :, slots] = v
    return q                                                                            # (Bt, N, h, d)


if triton is not None:
    @triton.jit
    def _heads_into_place(QKV, Cos, Sin, Slots, QNormW, KNormW, Q, K, V, N, sxr, scr, ssb, ssn,
                          skb, skh, sks, svb, svh, svs, eps, HQ: tl.constexpr, HK: tl.constexpr,
                          D: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
        """One (projection row r = b·N + n, head of [q; k; v]): v stored at the row's slot as it is; q and
        k normalised (NORM: weight · (x/rms(x)) rounded as Qwen3RMSNorm rounds) and rotated,
        x·cos + rotate_half(x)·sin in fp32 rounded once (as inductor fuses it), into q or the keys."""
        r, head = tl.program_id(0), tl.program_id(1)
        b, n = r // N, r % N
        lo = tl.arange(0, HALF)                                                         # a half head: rotate_half's halves
        ok, hi = lo < D // 2, lo + D // 2
        src = QKV + r * sxr + head * D
        slot = tl.load(Slots + b * ssb + n * ssn)
        if head >= HQ + HK:
            dst = V + b * svb + (head - HQ - HK) * svh + slot * svs
            tl.store(dst + lo, tl.load(src + lo, mask=ok), mask=ok)
            tl.store(dst + hi, tl.load(src + hi, mask=ok), mask=ok)
        else:
            dtype = Q.dtype.element_ty
            x_lo = tl.load(src + lo, mask=ok, other=0.0).to(tl.float32)
            x_hi = tl.load(src + hi, mask=ok, other=0.0).to(tl.float32)
            if NORM:
                rstd = 1.0 / tl.sqrt((tl.sum(x_lo * x_lo, 0) + tl.sum(x_hi * x_hi, 0)) / D + eps)
                W = QNormW if head < HQ else KNormW
                w_lo = tl.load(W + lo, mask=ok, other=0.0).to(tl.float32)
                w_hi = tl.load(W + hi, mask=ok, other=0.0).to(tl.float32)
                x_lo = (w_lo * (x_lo * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
                x_hi = (w_hi * (x_hi * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            c_lo = tl.load(Cos + r * scr + lo, mask=ok, other=0.0).to(tl.float32)
            c_hi = tl.load(Cos + r * scr + hi, mask=ok, other=0.0).to(tl.float32)
            s_lo = tl.load(Sin + r * scr + lo, mask=ok, other=0.0).to(tl.float32)
            s_hi = tl.load(Sin + r * scr + hi, mask=ok, other=0.0).to(tl.float32)
            out_lo, out_hi = (x_lo * c_lo - x_hi * s_lo).to(dtype), (x_hi * c_hi + x_lo * s_hi).to(dtype)
            if head < HQ:
                dst = Q + r * (HQ * D) + head * D
            else:
                dst = K + b * skb + (head - HQ) * skh + slot * sks
            tl.store(dst + lo, out_lo, mask=ok)
            tl.store(dst + hi, out_hi, mask=ok)


def triton_heads_into_place(attn, qkv_rows, keys, values, cos, sin, slots):
    """`heads_into_place` as one Triton kernel, a program per (row, head): nothing between the [q; k; v]
    matmul and attention is written but q and the K/V slots. The kernel addresses K/V with unit stride
    along head_dim and the tables by row; tables shared by the rows are broadcast here."""
    (Bt, N, width), hk, d = qkv_rows.shape, keys.shape[1], keys.shape[3]
    h = width // d - 2 * hk
    if d % 2 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError(f"triton_heads_into_place: head_dim {d} must be even (RoPE's halves), and keys/values "
                         f"contiguous along it (strides {keys.stride(-1)}, {values.stride(-1)})")
    cos, sin = (t.expand(Bt, N, d) for t in (cos, sin))                                 # (Bt, N, d)
    qkv_rows, cos, sin = (t if t.is_contiguous() else t.contiguous() for t in (qkv_rows, cos, sin))
    q = torch.empty(Bt, N, h, d, dtype=qkv_rows.dtype, device=qkv_rows.device)       # (Bt, N, h, d)
    norm = hasattr(attn, "q_norm")
    q_weight, k_weight = (attn.q_norm.weight, attn.k_norm.weight) if norm else (q, q)   # unread without norms
    _heads_into_place[(Bt * N, h + 2 * hk)](
        qkv_rows, cos, sin, slots, q_weight, k_weight, q, keys, values, N, width, d, slots.stride(0),
        slots.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1),
        values.stride(2), attn.q_norm.variance_epsilon if norm else 0.0, HQ=h, HK=hk, D=d,
        HALF=triton.next_power_of_2(d // 2), NORM=norm, num_warps=1)
    return q


# -----------------------------------------------------------------------------
# Attention by buffer slot: each query sees one range of slots of its row

def attend(q, keys, values, mask, scale: float):
    """Masked softmax attention of q (*, N, h, d) over keys/values (*, hk, S, d), mask (*, N, S) -> (*, N, h·d),
    for any leading batch dims *. The g query heads of each K/V head are stacked as rows, so K/V are read
    once and never repeated. Scores in the working dtype, softmax in at least fp32: as transformers' eager
    attention below fp32, in float64 for float64 (as SDPA, which dflash.py calls). Compiled, this is two
    batched matmuls and a fused masked softmax, for any S."""
    *batch, N, h, d = q.shape
    hk, S = keys.shape[-3], keys.shape[-2]
    g = h // hk
    q = q.reshape(*batch, N, hk, g, d).movedim(-4, -2).reshape(*batch, hk, g * N, d)    # (*, hk, g·N, d)
    scores = (q @ keys.transpose(-1, -2)) * scale                                       # (*, hk, g·N, S)
    scores = scores.view(*batch, hk, g, N, S).masked_fill(~mask[..., None, None, :, :], float("-inf"))
    p = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(values.dtype)
    p = p.view(*batch, hk, g * N, S)                                                    # (*, hk, g·N, S)
    o = p @ values                                                                      # (*, hk, g·N, d)
    return o.view(*batch, hk, g, N, d).movedim(-2, -4).reshape(*batch, N, h * d)        # (*, N, h·d)


def attend_upto(q, keys, values, last, scale: float, first=None):
    """Attention by buffer slot: q (Bt, N, h, d), the query at [b, n] seeing row b's key slots
    first[b, n]..last[b, n] (from 0 without `first`), of keys/values (Bt, hk, S, d) -> (Bt, N, h·d).
    On CUDA a Triton kernel that reads each row's K/V only from its queries' first slot to their last
    (`triton_attend_upto`), where a mask reads all S slots of every row, and writes (Bt, N, h·d) as
    o_proj takes it; elsewhere, and for float64, its plain-torch twin: `attend` under the mask."""
    if q.is_cuda and triton is not None and q.dtype != torch.float64:
        return triton_attend_upto(q, keys, values, last, scale, first)
    slots = torch.arange(keys.shape[-2], device=q.device)                              # (S,)
    mask = slots <= last[..., None]                                                     # (Bt, N, S)
    if first is not None:
        mask &= slots >= first[..., None]
    return attend(q, keys, values, mask, scale)


PROGRAMS = 512   # split K/V spans until about this many programs run (an H200 has 132 SMs),
MAX_SPANS = 4    # into at most this many: at batch 1 on the H200, 4 spans beat 1 and 16 at both bench shapes

if triton is not None:
    @triton.jit
    def _attend_upto_split(Q, K, V, First, Last, Opart, Mpart, Lpart, Out, sqb, sqn, sqh, skb, skh, sks, svb, svh,
                           svs, slb, sln, sfb, sfn, sob, son, soh, N, S, d, split_len, scale, HK: tl.constexpr,
                           G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           IEEE: tl.constexpr, ONE_SPAN: tl.constexpr, HAS_FIRST: tl.constexpr):
        """One (row b, K/V head, block of query rows, span of slots): the unnormalised softmax·V of its
        queries over the slots of its span from each query's first (HAS_FIRST; else 0) to its last,
        with their running max and sum;
        with ONE_SPAN (a span is all slots) the normalised softmax·V, into Out, and no merge follows.
        Query rows are n·G + j (query n, head j of the G sharing this K/V head), so K/V are read once."""
        bh, mb, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, kh, splits, M = bh // HK, bh % HK, tl.num_programs(2), N * G
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)                                     # (BM,)
        n, j, row_ok = rows // G, rows % G, rows < M
        dims = tl.arange(0, D)
        dim_ok = dims < d
        last = tl.load(Last + b * slb + n * sln, mask=row_ok, other=-1)                 # (BM,)
        if HAS_FIRST:
            first = tl.load(First + b * sfb + n * sfn, mask=row_ok, other=S)
        else:
            first = tl.zeros([BLOCK_M], tl.int64)
        q = tl.load(Q + b * sqb + n[:, None] * sqn + (kh * G + j)[:, None] * sqh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)                  # (BM, D)
        start = tl.maximum(split * split_len, tl.min(first, 0))                         # slots before every first: unread
        end = tl.minimum(tl.minimum(split * split_len + split_len, S), tl.max(last, 0) + 1)   # past every last: unread
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for s0 in range(start, end, BLOCK_N):
            slots = s0 + tl.arange(0, BLOCK_N)                                           # (BN,)
            slot_ok = slots < end
            k = tl.load(K + b * skb + kh * skh + slots[None, :] * sks + dims[:, None],
                        mask=dim_ok[:, None] & slot_ok[None, :], other=0.0)             # (D, BN)
            if IEEE:
                scores = tl.dot(q, k, input_precision="ieee")
            else:
                scores = tl.dot(q, k)                                                     # (BM, BN) fp32
            seen = (slots[None, :] <= last[:, None]) & (slots[None, :] >= first[:, None]) & slot_ok[None, :]
            scores = tl.where(seen, (scores * scale).to(tl.float32), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # nothing seen yet: keep exp() at 0, not NaN
            p = tl.exp(scores - m_use[:, None])
            alpha = tl.exp(m_i - m_use)
            v = tl.load(V + b * svb + kh * svh + slots[:, None] * svs + dims[None, :],
                        mask=slot_ok[:, None] & dim_ok[None, :], other=0.0)             # (BN, D)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)                                             # (BM, D)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if ONE_SPAN:
            tl.store(Out + b * sob + n[:, None] * son + (kh * G + j)[:, None] * soh + dims[None, :],
                     (acc / tl.where(row_ok, l_i, 1.0)[:, None]).to(Out.dtype.element_ty),   # l_i >= 1 on a real row
                     mask=row_ok[:, None] & dim_ok[None, :])
        else:
            part = (bh * splits + split) * M + rows                                      # into (Bt·hk, splits, M)
            tl.store(Mpart + part, m_i, mask=row_ok)
            tl.store(Lpart + part, l_i, mask=row_ok)
            tl.store(Opart + part[:, None] * D + dims[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _attend_upto_combine(Opart, Mpart, Lpart, Out, sob, son, soh, N, d, SPLITS: tl.constexpr, HK: tl.constexpr,
                             G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
        """The spans of one (row, K/V head, block of query rows) merged: softmax·V, normalised. The loop
        over spans is unrolled (SPLITS ≤ MAX_SPANS), so that every span's loads are in flight at once:
        a loop over a run-time count waited for each span's loads in turn (12.3 µs for 16 spans)."""
        bh, mb = tl.program_id(0), tl.program_id(1)
        b, kh, M = bh // HK, bh % HK, N * G
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        n, j, row_ok = rows // G, rows % G, rows < M
        dims = tl.arange(0, D)
        m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_all = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for split in tl.static_range(SPLITS):
            part = (bh * SPLITS + split) * M + rows
            m_s = tl.load(Mpart + part, mask=row_ok, other=float("-inf"))
            l_s = tl.load(Lpart + part, mask=row_ok, other=0.0)
            o_s = tl.load(Opart + part[:, None] * D + dims[None, :], mask=row_ok[:, None], other=0.0)
            m_new = tl.maximum(m_all, m_s)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            a_all, a_s = tl.exp(m_all - m_use), tl.exp(m_s - m_use)
            l_all = l_all * a_all + l_s * a_s
            acc = acc * a_all[:, None] + o_s * a_s[:, None]
            m_all = m_new
        out = acc / l_all[:, None]
        tl.store(Out + b * sob + n[:, None] * son + (kh * G + j)[:, None] * soh + dims[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (dims < d)[None, :])


def triton_attend_upto(q, keys, values, last, scale: float, first=None):
    """`attend_upto` as Triton kernels (split-K/V, then the merge of the spans): scores and softmax in
    fp32 registers, never written out; p in the working dtype for p·V, as `attend` has it. Spans are
    split only where rows × heads give too few programs (batch-1 decoding); one span needs no merge."""
    Bt, N, h, d = q.shape
    hk, S = keys.shape[1], keys.shape[2]
    G, M = h // hk, N * h // hk
    if keys.stride(-1) != 1 or values.stride(-1) != 1:   # a whole buffer is not copied to fix it
        raise ValueError(f"triton_attend_upto: keys/values must be contiguous along head_dim (strides "
                         f"{keys.stride(-1)}, {values.stride(-1)})")
    q = q if q.stride(-1) == 1 else q.contiguous()
    BLOCK_M, BLOCK_N, D = (16 if M <= 16 else 64), 64, max(16, triton.next_power_of_2(d))
    m_blocks = triton.cdiv(M, BLOCK_M)
    splits = max(1, min(triton.cdiv(S, BLOCK_N), MAX_SPANS, PROGRAMS // (Bt * hk * m_blocks)))
    split_len = triton.cdiv(triton.cdiv(S, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(S, split_len)
    opart = torch.empty(Bt * hk, splits, M, D, dtype=torch.float32, device=q.device)    # (Bt·hk, splits, M, D)
    mpart = torch.empty(Bt * hk, splits, M, dtype=torch.float32, device=q.device)
    lpart = torch.empty_like(mpart)
    out = torch.empty(Bt, N, h, d, dtype=q.dtype, device=q.device)                     # (Bt, N, h, d)
    bounds = last if first is None else first                                           # First: unread without one
    _attend_upto_split[(Bt * hk, m_blocks, splits)](
        q, keys, values, bounds, last, opart, mpart, lpart, out, q.stride(0), q.stride(1), q.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        last.stride(0), last.stride(1), bounds.stride(0), bounds.stride(1), out.stride(0), out.stride(1), out.stride(2),
        N, S, d, split_len, scale,
        HK=hk, G=G, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32, ONE_SPAN=splits == 1,
        HAS_FIRST=first is not None)
    if splits == 1:
        return out.view(Bt, N, h * d)
    _attend_upto_combine[(Bt * hk, m_blocks)](
        opart, mpart, lpart, out, out.stride(0), out.stride(1), out.stride(2), N, d,
        SPLITS=splits, HK=hk, G=G, D=D, BLOCK_M=BLOCK_M)
    return out.view(Bt, N, h * d)


# -----------------------------------------------------------------------------
# Inverse-CDF draws: a token per row of a distribution over the vocabulary

def sample(dist, u):
    """dflash.sample: a draw per row of dist (..., V), which need not sum to 1, by the inverse CDF of its
    uniform u (...) in [0, 1). On CUDA two Triton kernels (`triton_sample`), where the compiled cumulative
    sum and search are a scan, its workspace's fill and a search, and where one call per row costs that per
    row; elsewhere, and for float64, dflash.sample: the twin."""
    if dist.is_cuda and triton is not None and dist.dtype != torch.float64:
        return triton_sample(dist, u)
    return dflash.sample(dist, u)


if triton is not None:
    @triton.jit
    def _chunk_sums(Dist, Sums, V, sdn, CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
        """Σ of chunk c of row n of dist, in fp32, into Sums[n, c] (a row of CHUNKS, zeros past the last chunk)."""
        n, c = tl.program_id(0), tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(Dist + n * sdn + cols, mask=cols < V, other=0.0).to(tl.float32)
        tl.store(Sums + n * CHUNKS + c, tl.sum(x, 0))

    @triton.jit
    def _draw(Dist, Sums, U, Out, V, sdn, CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
        """Row n's draw: v = u · total, the chunk whose running sum first passes v, then within it the first
        token whose running sum passes v (searchsorted(right=True), compared in float64, as torch compares a
        float32 CDF with the float64 value), at most V − 1."""
        n = tl.program_id(0)
        cs = tl.arange(0, CHUNKS)
        sums = tl.load(Sums + n * CHUNKS + cs)                                          # (CHUNKS,), 0 past V
        ends = tl.cumsum(sums, 0)                                                       # each chunk's running sum
        value = tl.load(U + n).to(tl.float64) * tl.max(ends, 0).to(tl.float64)
        chunk = tl.minimum(tl.sum((ends.to(tl.float64) <= value).to(tl.int32), 0), CHUNKS - 1)
        before = tl.sum(tl.where(cs == chunk - 1, ends, 0.0), 0)                       # 0 before the first
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(Dist + n * sdn + cols, mask=cols < V, other=0.0).to(tl.float32)
        cdf = before + tl.cumsum(x, 0)                                                  # (CHUNK,)
        passed = tl.sum(((cdf.to(tl.float64) <= value) & (cols < V)).to(tl.int32), 0)
        tl.store(Out + n, tl.minimum(chunk * CHUNK + passed, V - 1).to(tl.int64))


SAMPLE_CHUNK = 2048   # vocabulary entries a program sums: 75 programs a row at Qwen3's 151,936


def triton_sample(dist, u):
    """`sample` as two Triton kernels: every chunk of every row summed at once (a program each), then per row
    the chunk the draw falls in and the token within it. The running sums are chunk sums and in-chunk scans,
    so they round in another order than a sequential cumsum (as the compiled scan does)."""
    *batch, V = dist.shape
    dist2, u1 = dist.reshape(-1, V), u.reshape(-1)
    dist2 = dist2 if dist2.stride(-1) == 1 else dist2.contiguous()
    N, chunks = dist2.shape[0], triton.cdiv(V, SAMPLE_CHUNK)
    CHUNKS = triton.next_power_of_2(chunks)
    sums = torch.zeros(N, CHUNKS, dtype=torch.float32, device=dist.device)            # (N, CHUNKS)
    out = torch.empty(N, dtype=torch.long, device=dist.device)                         # (N,)
    _chunk_sums[(N, chunks)](dist2, sums, V, dist2.stride(0), CHUNKS=CHUNKS, CHUNK=SAMPLE_CHUNK, num_warps=4)
    _draw[(N,)](dist2, sums, u1, out, V, dist2.stride(0), CHUNKS=CHUNKS, CHUNK=SAMPLE_CHUNK, num_warps=4)
    return out.view(batch)


# -----------------------------------------------------------------------------
# The k largest of each row, largest first

if triton is not None:
    @triton.jit
    def _sort_keys(x, cols):
        """fp32 values and their columns -> int64 keys in the values' order, and among equal values the
        lower column higher: the value's bits (negatives' magnitude flipped) over 0x7FFFFFFF − column."""
        bits = x.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)

    @triton.jit
    def _topk_chunks(X, Keys, V, sxn, K: tl.constexpr, CHUNK: tl.constexpr):
        """The K largest of chunk c of row n, as sort keys, largest first, into Keys[n, c, :]."""
        n, c = tl.program_id(0), tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(X + n * sxn + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        lowest = -9223372036854775807                                                   # below every key
        keys = tl.where(cols < V, _sort_keys(x, cols), lowest)
        out = Keys + (n * tl.num_programs(1) + c) * K
        for i in tl.static_range(K):
            best = tl.max(keys, 0)
            tl.store(out + i, best)
            keys = tl.where(keys == best, lowest, keys)

    @triton.jit
    def _topk_merge(Keys, Values, Indices, count, svn, sin, K: tl.constexpr, COUNT: tl.constexpr):
        """Row n's K largest among its chunks' keys, largest first: values (in Values' dtype) and columns."""
        n = tl.program_id(0)
        js = tl.arange(0, COUNT)
        lowest = -9223372036854775807
        keys = tl.load(Keys + n * count + js, mask=js < count, other=lowest)
        for i in tl.static_range(K):
            best = tl.max(keys, 0)
            keys = tl.where(keys == best, lowest, keys)
            ordered = (best >> 32).to(tl.int32)
            bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
            tl.store(Values + n * svn + i, bits.to(tl.float32, bitcast=True).to(Values.dtype.element_ty))
            tl.store(Indices + n * sin + i, (0x7FFFFFFF - (best & 0x7FFFFFFF)).to(tl.int64))


TOPK_CHUNK = 2048   # columns a program takes the top k of


def topk(x, k: int):
    """x.topk(k, dim=-1) of rows x (N, V): values and columns, largest first. On CUDA two Triton kernels
    (`triton_topk`), where torch's radix select is about a dozen; elsewhere, for float64 and for k past a
    chunk, torch.topk: the twin. Equal values come lowest column first, where torch leaves their order open."""
    if x.is_cuda and triton is not None and x.dtype != torch.float64 and x.dim() == 2 and k <= min(TOPK_CHUNK,
                                                                                                   x.shape[-1]):
        return triton_topk(x, k)
    return x.topk(k, dim=-1)


def triton_topk(x, k: int):
    """`topk` as two Triton kernels: the k largest of every chunk of every row (a program each, k rounds of
    a max over one int64 sort key per column), then per row the k largest of its chunks' keys."""
    (N, V), chunks = x.shape, triton.cdiv(x.shape[1], TOPK_CHUNK)
    x = x if x.stride(-1) == 1 else x.contiguous()
    keys = torch.empty(N, chunks, k, dtype=torch.int64, device=x.device)               # (N, chunks, k)
    values = torch.empty(N, k, dtype=x.dtype, device=x.device)                          # (N, k)
    indices = torch.empty(N, k, dtype=torch.long, device=x.device)
    _topk_chunks[(N, chunks)](x, keys, V, x.stride(0), K=k, CHUNK=TOPK_CHUNK, num_warps=4)
    _topk_merge[(N,)](keys, values, indices, chunks * k, values.stride(0), indices.stride(0), K=k,
                      COUNT=triton.next_power_of_2(chunks * k), num_warps=4)
    return values, indices


# -----------------------------------------------------------------------------
# DFlash2's candidate walk: every row's scores at once, then the picks

def candidate_walk(selector, hidden, logits, anchor, temperature: float, uniforms):
    """DFlash2's walk (`dflash.CandidateSelector`): final-normed draft rows hidden (N, H), their logits (N, V),
    the anchor id (0-dim), a uniform per row for T > 0 -> drafts (N,), candidates (N, k), and q (N, k) each
    draft was drawn from (None at T = 0). On CUDA four Triton kernels and the projection (`triton_candidate_walk`),
    where the selector's own forward runs about forty; elsewhere, and for float64, that forward: the twin."""
    if hidden.is_cuda and triton is not None and hidden.dtype != torch.float64:
        return triton_candidate_walk(selector, hidden, logits, anchor, temperature, uniforms)
    return selector(hidden, logits, anchor, temperature, uniforms)


if triton is not None:
    @triton.jit
    def _selector_scores(Cand, Unary, U, A, B, Anchor, Scores, k, r, scn, sun, suu, sav, sbv, KP: tl.constexpr,
                         RP: tl.constexpr, IEEE: tl.constexpr):
        """Row t's scores for each token the walk can have picked before it (row t−1's candidates; the anchor
        at t = 0) and each of its own candidates: Scores[t, i, j] = logit_j + Σ_r (A[prev_i, r]·u_t[r])·B[c_j, r],
        the product, the sum and the score each rounded to the working dtype, as the selector rounds them."""
        t = tl.program_id(0)
        ks, rs = tl.arange(0, KP), tl.arange(0, RP)
        k_ok, r_ok = ks < k, rs < r
        dtype = A.dtype.element_ty
        prev = tl.load(Cand + tl.maximum(t - 1, 0) * scn + ks, mask=k_ok, other=0)     # (KP,)
        prev = tl.where(t > 0, prev, tl.load(Anchor))
        cand = tl.load(Cand + t * scn + ks, mask=k_ok, other=0)                         # (KP,)
        both = k_ok[:, None] & r_ok[None, :]
        a = tl.load(A + prev[:, None] * sav + rs[None, :], mask=both, other=0.0)        # (KP, RP)
        u = tl.load(U + t * suu + rs, mask=r_ok, other=0.0)                             # (RP,)
        a = (a.to(tl.float32) * u.to(tl.float32)[None, :]).to(dtype)
        b = tl.load(B + cand[:, None] * sbv + rs[None, :], mask=both, other=0.0)        # (KP, RP)
        if IEEE:
            pairs = tl.dot(a, tl.trans(b), input_precision="ieee")                      # (KP, KP) fp32
        else:
            pairs = tl.dot(a, tl.trans(b))
        unary = tl.load(Unary + t * sun + ks, mask=k_ok, other=float("-inf")).to(tl.float32)   # -inf past k
        scores = (unary[None, :] + pairs.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(Scores + t * KP * KP + ks[:, None] * KP + ks[None, :], scores)

    @triton.jit
    def _selector_walk(Scores, Cand, Uniforms, Drafts, Q, N, k, temperature, scn, sqn,
                       NP: tl.constexpr, KP: tl.constexpr, SAMPLED: tl.constexpr):
        """The walk, one program: every row's score tables held in registers, then row by row the scores
        given the previous pick and the pick: the argmax (the first of equals, as torch's), or at T > 0 the
        inverse-CDF draw from q = softmax(scores / T) with the row's float64 uniform, q written out."""
        rows, js = tl.arange(0, NP * KP), tl.arange(0, KP)                              # rows: t·KP + previous pick
        table = tl.load(Scores + rows[:, None] * KP + js[None, :], mask=(rows < N * KP)[:, None],
                        other=float("-inf"))                                            # (NP·KP, KP)
        pick = tl.zeros([], tl.int32)   # at t = 0 every row of the table is the anchor's
        for t in range(N):
            scores = tl.max(tl.where(rows[:, None] == t * KP + pick, table, float("-inf")), 0)   # (KP,)
            if SAMPLED:
                x = scores / temperature
                e = tl.exp(x - tl.max(x, 0))
                q = e / tl.sum(e, 0)
                cdf = tl.cumsum(q, 0)
                value = tl.load(Uniforms + t) * tl.sum(tl.where(js == k - 1, cdf, 0.0), 0).to(tl.float64)
                below = (cdf.to(tl.float64) <= value) & (js < k)   # searchsorted(right=True), compared in float64
                pick = tl.minimum(tl.sum(below.to(tl.int32), 0), k - 1)
                tl.store(Q + t * sqn + js, q, mask=js < k)
            else:
                pick = tl.argmax(scores, 0, tie_break_left=True).to(tl.int32)
            tl.store(Drafts + t, tl.load(Cand + t * scn + pick))


def triton_candidate_walk(selector, hidden, logits, anchor, temperature: float, uniforms):
    """`candidate_walk` as four Triton kernels and the hidden projection: the candidates (`triton_topk`),
    every row's (k, k) score table at once (a program per row), then the walk over the tables (one program),
    which reads no memory between its picks. Row t−1's candidates are the only tokens the walk can have
    picked before row t, so the tables hold every score the selector's forward computes."""
    unary, candidates = triton_topk(logits, selector.top_k) if selector.top_k <= TOPK_CHUNK else \
        logits.topk(selector.top_k, dim=-1)                                             # (N, k)
    u = selector.hidden_projection(hidden)                                              # (N, r)
    A, B = selector.predecessor_codebook, selector.successor_codebook                   # (V, r)
    if A.stride(-1) != 1 or B.stride(-1) != 1:
        raise ValueError(f"triton_candidate_walk: codebooks must be contiguous along the rank (strides "
                         f"{A.stride(-1)}, {B.stride(-1)})")
    u, unary = (t if t.stride(-1) == 1 else t.contiguous() for t in (u, unary))
    (N, k), r, device = candidates.shape, u.shape[-1], hidden.device
    KP, RP = max(16, triton.next_power_of_2(k)), max(16, triton.next_power_of_2(r))   # tl.dot's least sizes
    scores = torch.empty(N, KP, KP, dtype=torch.float32, device=device)                # (N, KP, KP)
    _selector_scores[(N,)](candidates, unary, u, A, B, anchor.reshape(1), scores, k, r, candidates.stride(0),
                           unary.stride(0), u.stride(0), A.stride(0), B.stride(0), KP=KP, RP=RP,
                           IEEE=u.dtype == torch.float32, num_warps=4)
    drafts = torch.empty(N, dtype=torch.long, device=device)                           # (N,)
    sampled = temperature > 0
    q = torch.empty(N, k, dtype=torch.promote_types(u.dtype, torch.float32), device=device) if sampled else None
    _selector_walk[(1,)](scores, candidates, uniforms if sampled else drafts, drafts, q if sampled else drafts,
                         N, k, float(temperature) if sampled else 1.0, candidates.stride(0),
                         k if q is None else q.stride(0), NP=triton.next_power_of_2(N), KP=KP, SAMPLED=sampled,
                         num_warps=1)
    return drafts, candidates, q
