"""triton_ops.py: each Triton kernel against its plain-torch twin (under the Triton interpreter on CPU, on
CUDA where there is one), and the twins against the math they stand for."""
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import fastpath
import loss
import triton_ops
from conftest import HERE, head_chunk_cases


def test_attend_upto_is_causal_attention_by_slot():
    """attend_upto (the plain-torch twin that CPU runs) is attention where the query at [b, n] sees
    row b's slots 0..last[b, n]: as float64 SDPA over those slots alone, with K/V heads shared by g
    queries, to float64 rounding (attend's softmax keeps float64, as SDPA does)."""
    g = torch.Generator().manual_seed(0)
    Bt, N, h, hk, d, S = 3, 4, 6, 2, 8, 20
    q = torch.randn(Bt, N, h, d, dtype=torch.float64, generator=g)
    keys, values = (torch.randn(Bt, hk, S, d, dtype=torch.float64, generator=g) for _ in range(2))
    last = torch.randint(0, S, (Bt, N), generator=g)
    got = triton_ops.attend_upto(q, keys, values, last, 0.3).view(Bt, N, h, d)
    for b in range(Bt):
        for n in range(N):
            upto = int(last[b, n]) + 1
            k = keys[b, :, :upto].repeat_interleave(h // hk, 0)                          # (h, upto, d)
            v = values[b, :, :upto].repeat_interleave(h // hk, 0)
            want = F.scaled_dot_product_attention(q[b, n][:, None], k, v, scale=0.3)[:, 0]   # (h, d)
            torch.testing.assert_close(got[b, n], want, rtol=1e-12, atol=1e-13)


KERNEL_CASES = [   # (Bt, N, h, hk, d, S): SmolLM2-135M and Qwen3-8B heads, decode / verify / prefill queries
    (5, 1, 9, 3, 64, 300), (1, 16, 9, 3, 64, 1024), (2, 64, 9, 3, 64, 256),
    (3, 1, 32, 8, 128, 200), (1, 16, 32, 8, 128, 1024), (2, 3, 4, 2, 8, 40)]


def kernel_errors(device: str, dtypes) -> dict:
    """Max |triton_attend_upto - attend in float64| per case, dtype, partition (PROGRAMS as set, and
    1: one span, normalised in the split kernel, no merge) and lower bound (none, or a first slot per
    query, as a drafter's window has it), K/V in (Bt, hk, S + 32, d) buffers sliced to S (as
    dense_layer passes them), every row's last and first slots drawn at random."""
    g = torch.Generator().manual_seed(0)
    errors = {}
    for case in KERNEL_CASES:
        Bt, N, h, hk, d, S = case
        for dtype in dtypes:
            q = torch.randn(Bt, N, h, d, generator=g).to(device, dtype)
            keys, values = (torch.randn(Bt, hk, S + 32, d, generator=g).to(device, dtype) for _ in range(2))
            last = torch.randint(0, S, (Bt, N), generator=g).to(device)
            first = (last - torch.randint(0, S, (Bt, N), generator=g).to(device)).clamp(min=0)   # a window's start
            slots = torch.arange(S, device=device)
            for lower in (None, first):
                mask = (slots <= last[..., None]) & (slots >= (0 if lower is None else lower[..., None]))
                want = triton_ops.attend(q.double(), keys[:, :, :S].double(), values[:, :, :S].double(), mask, d ** -0.5)
                for programs in (triton_ops.PROGRAMS, 1):
                    with mock.patch.object(triton_ops, "PROGRAMS", programs):
                        got = triton_ops.triton_attend_upto(q, keys[:, :, :S], values[:, :, :S], last, d ** -0.5, lower)
                    errors[f"{case} programs={programs} first={lower is not None} {dtype}"] = \
                        (got.double() - want).abs().max().item()
    return errors


HEADS_CASES = [   # (Bt, N, h, hk, d, C, Qwen3's q/k norms): SmolLM2-135M, Qwen3-8B, small, and d 80 (half not a power of 2)
    (1, 16, 9, 3, 64, 1024, False), (3, 1, 9, 3, 64, 300, False), (1, 16, 32, 8, 128, 1024, True),
    (2, 5, 32, 8, 128, 200, True), (2, 3, 4, 2, 8, 40, True), (1, 4, 2, 1, 80, 30, False)]


def heads_kernel_errors(device: str, dtypes) -> dict:
    """Per case and dtype: the max errors against the twin in float64 of triton_heads_into_place and of
    the twin in the same dtype (q, and the K/V slots written), the largest value, and whether every
    slot the rows do not own was left as it was."""
    import transformers.models.qwen3.modeling_qwen3 as qwen3
    g = torch.Generator().manual_seed(0)
    errors = {}
    for case in HEADS_CASES:
        Bt, N, h, hk, d, C, norm = case
        attn = torch.nn.Module()
        if norm:
            attn.q_norm, attn.k_norm = qwen3.Qwen3RMSNorm(d, 1e-6), qwen3.Qwen3RMSNorm(d, 1e-6)
            for m in (attn.q_norm, attn.k_norm):
                m.weight.data = 1 + 0.3 * torch.randn(d, generator=g)
        qkv = torch.randn(Bt, N, (h + 2 * hk) * d, generator=g)
        angles = 100 * torch.rand(Bt, N, d // 2, generator=g).repeat(1, 1, 2)               # (Bt, N, d), as rotary_emb
        slots = torch.stack([torch.randperm(C, generator=g)[:N] for _ in range(Bt)]).to(device)
        background = torch.randn(2, Bt, hk, C, d, generator=g)                           # what the buffers held before

        def run(fn, dtype):
            module = attn.to(device, dtype) if norm else attn
            keys, values = (background[i].to(device, dtype).clone() for i in range(2))
            q = fn(module, qkv.to(device, dtype), keys, values, angles.cos().to(device, dtype),
                   angles.sin().to(device, dtype), slots)
            return q.double(), keys.double(), values.double()

        twin = lambda *a: fastpath.heads_into_place(a[0], qwen3.apply_rotary_pos_emb, *a[1:])
        want = run(twin, torch.float64)
        for dtype in dtypes:
            got = run(triton_ops.triton_heads_into_place, dtype)
            plain = run(twin, dtype)
            owned = torch.zeros(Bt, C, dtype=torch.bool, device=device)
            owned[torch.arange(Bt, device=device)[:, None], slots] = True
            kept = all(torch.equal(t.movedim(2, 1)[~owned], background[i].to(device, dtype).double().movedim(2, 1)[~owned])
                       for i, t in enumerate(got[1:]))
            errors[f"{case} {dtype}"] = dict(
                kernel=max((a - b).abs().max().item() for a, b in zip(got, want)),
                twin=max((a - b).abs().max().item() for a, b in zip(plain, want)),
                largest=max(t.abs().max().item() for t in want), kept=kept,
                values_exact=torch.equal(got[2], plain[2]))
    return errors


def check_heads_kernel(errors: dict):
    """Every slot not written is kept, v is copied exactly, and the kernel's error against float64 is
    within 2× the twin's own error in the same dtype plus 1e-6 of the largest value (the kernel rounds
    RoPE once, in fp32, where the eager twin rounds each product)."""
    assert errors
    for key, e in errors.items():
        assert e["kept"] and e["values_exact"], key
        assert e["kernel"] <= 2 * e["twin"] + 1e-6 * e["largest"], (key, e)


def under_the_triton_interpreter(call: str):
    """test_triton_ops.<call>'s JSON result, run in a fresh process with TRITON_INTERPRET=1 (set before
    Triton is imported), so that the kernels run on the CPU."""
    pytest.importorskip("triton")
    code = f"import json, torch, test_triton_ops; print(json.dumps(test_triton_ops.{call}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(HERE)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def heads_kernel_broadcast_difference() -> float:
    """triton_heads_into_place with one RoPE table for both rows against the table given per row: the
    largest difference in q and the K/V written (0 when the wrapper broadcasts the shared table)."""
    g = torch.Generator().manual_seed(0)
    Bt, N, h, hk, d, C = 2, 3, 4, 2, 16, 12
    qkv = torch.randn(Bt, N, (h + 2 * hk) * d, generator=g)
    angles = torch.rand(1, N, d // 2, generator=g).repeat(1, 1, 2)                       # (1, N, d)
    slots = torch.tensor([[0, 1, 2], [5, 6, 7]])

    def run(cos, sin):
        keys, values = torch.zeros(Bt, hk, C, d), torch.zeros(Bt, hk, C, d)
        q = triton_ops.triton_heads_into_place(torch.nn.Module(), qkv, keys, values, cos, sin, slots)
        return torch.cat([q.flatten(), keys.flatten(), values.flatten()])
    shared = run(angles.cos(), angles.sin())
    per_row = run(angles.cos().expand(Bt, N, d).contiguous(), angles.sin().expand(Bt, N, d).contiguous())
    return float((shared - per_row).abs().max())


def test_heads_kernel_broadcasts_a_shared_rope_table_under_the_interpreter():
    """Under Triton's CPU interpreter, one RoPE table for every row gives what that table given per row
    gives: the wrapper broadcasts it (the kernel reads a table per row, and read past a shared one)."""
    assert under_the_triton_interpreter("heads_kernel_broadcast_difference()") == 0.0


KERNEL_TOLERANCE = {torch.float32: 2e-6, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def test_attend_upto_kernel_under_the_triton_interpreter():
    """The Triton kernel of attend_upto, run by Triton's CPU interpreter (TRITON_INTERPRET=1, set
    before Triton is imported, hence a fresh process), equals the float64 plain-torch math at both
    shapes' head sizes, in fp32 (tolerance 2e-6) and fp16 (4e-3). The interpreter's bf16 matmul is
    not faithful, so bf16 runs in the GPU test only."""
    errors = under_the_triton_interpreter("kernel_errors('cpu', [torch.float32, torch.float16])")
    assert len(errors) == 2 * 2 * 2 * len(KERNEL_CASES)
    for key, error in errors.items():
        assert error < KERNEL_TOLERANCE[torch.float16 if "float16" in key else torch.float32], (key, error)


@pytest.mark.skipif(triton_ops.triton is None, reason="needs Triton")
def test_kernel_wrappers_refuse_layouts_their_kernels_misread():
    """The Triton wrappers refuse, before any launch, K/V buffers strided along head_dim (the kernels
    address them with unit stride) and an odd head_dim for the heads kernel (RoPE's halves); RoPE tables
    shared by the rows are broadcast to every row, not read past their end."""
    Bt, N, h, hk, d, S = 2, 3, 4, 2, 8, 20
    q = torch.randn(Bt, N, h, d)
    keys = torch.randn(Bt, hk, d, S).transpose(-1, -2)                                 # stride 1 along S, not d
    with pytest.raises(ValueError, match="triton_attend_upto: keys/values must be contiguous along head_dim"):
        triton_ops.triton_attend_upto(q, keys, keys.contiguous(), torch.zeros(Bt, N, dtype=torch.long), 0.3)
    attn = types.SimpleNamespace()                                                     # no q/k norms
    rows = torch.randn(Bt, N, (h + 2 * hk) * d)
    table = torch.randn(1, N, d)                                                        # one table for both rows
    with pytest.raises(ValueError, match="head_dim 8 must be even .* contiguous along it"):
        triton_ops.triton_heads_into_place(attn, rows, keys, keys.contiguous(), table, table, torch.zeros(Bt, N))
    odd = torch.zeros(Bt, hk, S, 9)
    with pytest.raises(ValueError, match="head_dim 9 must be even"):
        triton_ops.triton_heads_into_place(attn, torch.randn(Bt, N, (h + 2 * hk) * 9), odd, odd, table, table,
                                         torch.zeros(Bt, N))


def test_heads_kernel_under_the_triton_interpreter():
    """fastpath's one kernel between the [q; k; v] matmul and attention (per-head norms, RoPE, the K/V
    writes), run by Triton's CPU interpreter in fp32 and fp16 at both shapes' head sizes, against the
    model's own modules (`check_heads_kernel`)."""
    errors = under_the_triton_interpreter("heads_kernel_errors('cpu', [torch.float32, torch.float16])")
    assert len(errors) == 2 * len(HEADS_CASES)
    check_heads_kernel(errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_heads_kernel_on_cuda():
    """The same on the GPU, in fp32, fp16 and bf16."""
    errors = heads_kernel_errors("cuda", [torch.float32, torch.float16, torch.bfloat16])
    print(errors)
    check_heads_kernel(errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_attend_upto_kernel_on_cuda():
    """On the GPU the kernel equals the float64 math at both shapes' head sizes in fp32 (2e-6, IEEE
    matmuls), fp16 (4e-3) and bf16 (3e-2: p and the inputs rounded to bf16, as `attend` has them)."""
    errors = kernel_errors("cuda", [torch.float32, torch.float16, torch.bfloat16])
    print(errors)
    for key, error in errors.items():
        dtype = next(t for t in KERNEL_TOLERANCE if str(t) == key.split()[-1])
        assert error < KERNEL_TOLERANCE[dtype], (key, error)


def head_kernel_errors(device, dtypes, cases=((37, 1000), (5, 4096)), block=256):
    """The head loss kernel (triton_head_chunk_grad; tiles of `block`, so that a row takes several,
    the last cut short where V is not a multiple) and its twin head_chunk_grad, each against float64
    autograd: the largest errors of the loss and of the gradient to the logits, the largest exact
    values, and whether each gradient came back in the logits' dtype."""
    errors = {}
    for rows, vocab in cases:
        for dtype in dtypes:
            logits, labels, w, want, want_grad = head_chunk_cases(device, dtype, rows, vocab)
            runs = {"kernel": triton_ops.triton_head_chunk_grad(logits, labels, w, block=block),
                    "twin": triton_ops.head_chunk_grad(logits, labels, w)}
            errors[f"{rows}x{vocab} {dtype}"] = {
                **{name: [abs(loss.item() - want.item()), (grad.double() - want_grad).abs().max().item()]
                   for name, (loss, grad) in runs.items()},
                "largest": [abs(want.item()), want_grad.abs().max().item()],
                "same_dtype": all(grad.dtype == dtype for _, grad in runs.values())}
    return errors


def check_head_kernel(errors: dict):
    """The kernel's loss and gradient are within twice the twin's own error in the same dtype plus
    1e-6 of the largest exact value (at least 1e-6)."""
    assert errors
    for key, e in errors.items():
        assert e["same_dtype"], key
        for i in range(2):
            assert e["kernel"][i] <= 2 * e["twin"][i] + 1e-6 * max(1.0, e["largest"][i]), (key, i, e)


def test_head_kernel_under_the_triton_interpreter():
    """The head's loss kernel (one row per program: log Z in an online pass, then loss and gradient),
    run by Triton's CPU interpreter in fp32 and fp16, against float64 autograd as closely as its
    plain-torch twin (`check_head_kernel`)."""
    errors = under_the_triton_interpreter("head_kernel_errors('cpu', [torch.float32, torch.float16])")
    assert len(errors) == 2 * 2
    check_head_kernel(errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_head_kernel_on_cuda():
    """The same on the GPU in fp32, fp16 and bf16, and at SmolLM2's vocabulary in bf16 with the
    kernel's own tiles (a full chunk of 8,192 rows and a short one)."""
    errors = head_kernel_errors("cuda", [torch.float32, torch.float16, torch.bfloat16])
    errors |= head_kernel_errors("cuda", [torch.bfloat16], cases=((loss.CE_CHUNK, 49152), (1000, 49152)),
                                 block=triton_ops.HEAD_BLOCK)
    print(errors)
    check_head_kernel(errors)
