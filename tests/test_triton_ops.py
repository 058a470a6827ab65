"""kernels.py: each Triton kernel against its plain-torch twin (under the Triton interpreter on CPU, on
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

import dflash
import fastpath
from conftest import HERE, head_chunk_cases
from dflash_reference import kernels
from dflash_reference.training import objective


def test_attend_upto_is_causal_attention_by_slot():
    """attend_upto (the plain-torch twin that CPU runs) is attention where the query at [b, n] sees
    row b's slots 0..last[b, n]: as float64 SDPA over those slots alone, with K/V heads shared by g
    queries, to float64 rounding (attend's softmax keeps float64, as SDPA does)."""
    g = torch.Generator().manual_seed(0)
    Bt, N, h, hk, d, S = 3, 4, 6, 2, 8, 20
    q = torch.randn(Bt, N, h, d, dtype=torch.float64, generator=g)
    keys, values = (torch.randn(Bt, hk, S, d, dtype=torch.float64, generator=g) for _ in range(2))
    last = torch.randint(0, S, (Bt, N), generator=g)
    got = kernels.attend_upto(q, keys, values, last, 0.3).view(Bt, N, h, d)
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
                want = kernels.attend(q.double(), keys[:, :, :S].double(), values[:, :, :S].double(), mask, d ** -0.5)
                for programs in (kernels.PROGRAMS, 1):
                    with mock.patch.object(kernels, "PROGRAMS", programs):
                        got = kernels.triton_attend_upto(q, keys[:, :, :S], values[:, :, :S], last, d ** -0.5, lower)
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
            got = run(kernels.triton_heads_into_place, dtype)
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
        q = kernels.triton_heads_into_place(torch.nn.Module(), qkv, keys, values, cos, sin, slots)
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


@pytest.mark.skipif(kernels.triton is None, reason="needs Triton")
def test_kernel_wrappers_refuse_layouts_their_kernels_misread():
    """The Triton wrappers refuse, before any launch, K/V buffers strided along head_dim (the kernels
    address them with unit stride) and an odd head_dim for the heads kernel (RoPE's halves); RoPE tables
    shared by the rows are broadcast to every row, not read past their end."""
    Bt, N, h, hk, d, S = 2, 3, 4, 2, 8, 20
    q = torch.randn(Bt, N, h, d)
    keys = torch.randn(Bt, hk, d, S).transpose(-1, -2)                                 # stride 1 along S, not d
    with pytest.raises(ValueError, match="triton_attend_upto: keys/values must be contiguous along head_dim"):
        kernels.triton_attend_upto(q, keys, keys.contiguous(), torch.zeros(Bt, N, dtype=torch.long), 0.3)
    attn = types.SimpleNamespace()                                                     # no q/k norms
    rows = torch.randn(Bt, N, (h + 2 * hk) * d)
    table = torch.randn(1, N, d)                                                        # one table for both rows
    with pytest.raises(ValueError, match="head_dim 8 must be even .* contiguous along it"):
        kernels.triton_heads_into_place(attn, rows, keys, keys.contiguous(), table, table, torch.zeros(Bt, N))
    odd = torch.zeros(Bt, hk, S, 9)
    with pytest.raises(ValueError, match="head_dim 9 must be even"):
        kernels.triton_heads_into_place(attn, torch.randn(Bt, N, (h + 2 * hk) * 9), odd, odd, table, table,
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


SAMPLE_CASES = [(15, 5000), (1, 96), (3, 2048), (4, 4097)]   # (rows, V): chunks cut short, one chunk, exact chunks


def sample_mismatches(device: str, dtypes) -> dict:
    """triton_sample against its twin dflash.sample (per row and batched), on peaked random distributions that need
    not sum to 1, some rows zero past half: per case the draws that differ by more than a token (where a uniform
    falls on a boundary the two running sums' rounding may part them by one) and by any."""
    g, out = torch.Generator().manual_seed(0), {}
    for N, V in SAMPLE_CASES:
        for dtype in dtypes:
            dist = (torch.rand(N, V, generator=g) ** 8 * 3).to(dtype)
            dist[:, V // 2:] *= torch.rand(N, 1, generator=g) < 0.5                    # some rows zero past half
            u = torch.rand(N, dtype=torch.float64, generator=g)
            got = kernels.triton_sample(dist.to(device), u.to(device)).cpu()
            want = dflash.sample(dist, u)
            one = torch.stack([dflash.sample(dist[i], u[i]) for i in range(N)])
            out[f"{N}x{V} {dtype}"] = {"far": int(((got - want).abs() > 1).sum()), "any": int((got != want).sum()),
                                       "batched_is_per_row": torch.equal(want, one), "shape": list(got.shape)}
    got = kernels.triton_sample(dist[0].to(device), u[0].to(device)).cpu()          # one distribution (V,)
    out["one row"] = {"far": int(abs(int(got) - int(dflash.sample(dist[0], u[0]))) > 1), "any": 0,
                      "batched_is_per_row": True, "shape": list(got.shape)}
    return out


def check_sample(runs: dict):
    """No draw more than a token from the twin's, at most one in 20 a neighbour (rounding at a boundary), the
    twin's batched draws its per-row ones, and one draw per row (none for one distribution)."""
    assert runs
    for key, run in runs.items():
        assert run["far"] == 0 and run["batched_is_per_row"], (key, run)
        assert run["shape"] == ([] if key == "one row" else [int(key.split("x")[0])]), (key, run)
    assert sum(r["any"] for r in runs.values()) <= max(1, sum(r["shape"][0] for r in runs.values() if r["shape"]) // 20)


def test_sample_kernels_under_the_triton_interpreter():
    """Inverse-CDF draws as two kernels (every chunk's sum, then the chunk and the token), run by Triton's CPU
    interpreter in fp32 (fastpath's distributions are at least fp32), draw what dflash.sample draws (`check_sample`)."""
    runs = under_the_triton_interpreter("sample_mismatches('cpu', [torch.float32])")
    assert len(runs) == len(SAMPLE_CASES) + 1
    check_sample(runs)


def test_batched_sample_draws_what_one_row_at_a_time_draws():
    """dflash.sample over (..., V) with a uniform per row draws, on CPU, exactly what it draws row by row (the
    cumsum is sequential either way), in float32 and float64, and a (V,) distribution with a 0-dim uniform
    draws one 0-dim token."""
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        dist = torch.rand(2, 6, 300, generator=g, dtype=dtype) ** 6
        u = torch.rand(2, 6, generator=g, dtype=torch.float64)
        got = dflash.sample(dist, u)
        assert got.shape == (2, 6)
        assert all(int(got[i, j]) == int(dflash.sample(dist[i, j], u[i, j])) for i in range(2) for j in range(6))
        cdf = dist[0, 0].double().cumsum(0)
        assert int(dflash.sample(dist[0, 0], u[0, 0])) == int((cdf <= u[0, 0] * cdf[-1]).sum())
    assert dflash.sample(dist[0, 0], u[0, 0]).shape == ()


TOPK_CASES = [(15, 5000, 16), (3, 96, 4), (2, 4096, 16), (1, 300, 5)]   # (rows, V, k)


def topk_mismatches(device: str, dtypes) -> dict:
    """triton_topk against torch.topk (its twin), on random rows with k planted largest values (no two equal) and
    on rows of few distinct values (many equal): values equal, each index's value its value, indices distinct, and on the
    rows without ties the indices equal too."""
    g, out = torch.Generator().manual_seed(0), {}
    for N, V, k in TOPK_CASES:
        for dtype in dtypes:
            for kind in ("distinct", "ties"):
                if kind == "distinct":   # below 0.5 but k planted values 1 + i/16, exact in every dtype
                    x = torch.rand(N, V, generator=g) - 0.5
                    x.scatter_(1, torch.rand(N, V, generator=g).argsort(-1)[:, :k], 1 + torch.randperm(k, generator=g)
                               .float().expand(N, k) / 16)
                else:
                    x = torch.randint(-3, 4, (N, V), generator=g).float()
                x = x.to(dtype)
                values, indices = kernels.triton_topk(x.to(device), k)
                values, indices = values.cpu(), indices.cpu()
                want, want_indices = x.topk(k, dim=-1)
                out[f"{N}x{V} k{k} {dtype} {kind}"] = {
                    "values": torch.equal(values, want), "dtype": values.dtype == dtype,
                    "gathered": torch.equal(x.gather(-1, indices), values),
                    "distinct": all(len(set(row.tolist())) == k for row in indices),
                    "indices": kind == "ties" or torch.equal(indices, want_indices),
                    "lowest_first": kind == "distinct" or all(
                        row[i] < row[i + 1] for vals, row in zip(values, indices) for i in range(k - 1)
                        if vals[i] == vals[i + 1])}
    return out


def check_topk(runs: dict):
    assert runs
    for key, run in runs.items():
        assert all(run.values()), (key, run)


def test_topk_kernels_under_the_triton_interpreter():
    """The k largest of each row as two kernels (every chunk's k largest, then theirs), run by Triton's CPU
    interpreter in fp32 and fp16: torch.topk's values, largest first, and its indices where no two values are
    equal; among equal values the lowest index first (`check_topk`)."""
    runs = under_the_triton_interpreter("topk_mismatches('cpu', [torch.float32, torch.float16])")
    assert len(runs) == 2 * 2 * len(TOPK_CASES)
    check_topk(runs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sample_and_topk_kernels_on_cuda():
    """The same on the GPU: the draws in fp32, the k largest in fp32, fp16 and bf16."""
    runs = sample_mismatches("cuda", [torch.float32])
    print(runs)
    check_sample(runs)
    runs = topk_mismatches("cuda", [torch.float32, torch.float16, torch.bfloat16])
    print(runs)
    check_topk(runs)


WALK_CASES = [   # (N rows, k candidates, r rank, V): the bench's DFlash2 selector (a smaller vocabulary), the
    (15, 16, 256, 4096), (5, 4, 8, 96), (7, 5, 24, 300)]   # tiny drafters' sizes, and sizes of no power of 2


def walk_mismatches(device: str, dtypes) -> dict:
    """triton_candidate_walk against its twin, the selector's own forward, in the same dtype, greedy and at T 0.7,
    on random rows, logits (the largest 2k of them distinct in every dtype) and codebooks (pair terms as large as
    the logits' spread, so the picks follow the walk): per case the drafts that differ, whether the candidates
    are the same set, the largest difference of q over the vocabulary, and the kernel's walk re-scored in
    float64 (`walk_margins`)."""
    g, out = torch.Generator().manual_seed(0), {}
    for N, k, r, V in WALK_CASES:
        H = 64
        torch.manual_seed(0)
        selector = dflash.CandidateSelector(types.SimpleNamespace(selector_top_k=k, hidden_size=H, selector_rank=r,
                                                                  vocab_size=V)).requires_grad_(False)
        for p in (selector.predecessor_codebook, selector.successor_codebook):
            p.copy_(torch.randn(V, r, generator=g) * (1.5 / r ** 0.25))
        hidden, logits = torch.randn(N, H, generator=g), (3 * torch.randn(N, V, generator=g)).clamp(max=7)
        top = torch.rand(N, V, generator=g).argsort(-1)[:, :2 * k]                     # 2k planted largest logits,
        logits.scatter_(1, top, 8 + torch.randperm(2 * k, generator=g).float().expand(N, 2 * k) / 8)   # no 2 equal
        uniforms = torch.rand(N, dtype=torch.float64, generator=g).to(device)
        anchor = torch.tensor(int(torch.randint(V, (), generator=g)), device=device)
        for dtype in dtypes:
            sel = selector.to(device, dtype)
            args = (hidden.to(device, dtype), logits.to(device, dtype), anchor)
            for temperature in (0.0, 0.7):
                drafts, candidates, q = kernels.triton_candidate_walk(sel, *args, temperature, uniforms)
                want, want_candidates, want_q = sel(*args, temperature, uniforms)
                out[f"{N}x{k}x{r}x{V} T{temperature} {dtype}"] = {   # candidates as sets: equal logits in any order
                    "drafts_differ": int((drafts != want).sum()),
                    "candidates": torch.equal(candidates.sort(-1).values, want_candidates.sort(-1).values),
                    "q": 0.0 if q is None else (over_vocabulary(q, candidates, V) -
                                                over_vocabulary(want_q, want_candidates, V)).abs().max().item(),
                    "q_none": (q is None) == (want_q is None),
                    **walk_margins(sel, *args, temperature, uniforms, drafts, candidates, q)}
    return out


def over_vocabulary(q, candidates, vocab: int):
    """q (N, k) over its candidates (N, k) -> (N, vocab), as read_drafts scatters it."""
    return torch.zeros(len(q), vocab, dtype=q.dtype, device=q.device).scatter(-1, candidates, q)


def walk_margins(selector, hidden, logits, anchor, temperature, uniforms, drafts, candidates, q) -> dict:
    """The kernel's walk re-scored in float64 from the same inputs, each row given the kernel's own previous
    draft: whether every draft is one of its row's candidates; at T = 0 the largest shortfall of a draft's
    score under its row's best; at T > 0 the largest difference of q from softmax(scores / T), and whether each
    draft is the inverse-CDF draw of the kernel's own q (or its neighbour, where a uniform sits on a boundary)."""
    f = lambda t: t.double().cpu()
    A, B, P = f(selector.predecessor_codebook), f(selector.successor_codebook), f(selector.hidden_projection.weight)
    c, drafts, uniforms = candidates.cpu(), drafts.cpu(), uniforms.cpu()
    unary, u = f(logits).gather(-1, c), f(hidden) @ P.T                                 # (N, k), (N, r)
    previous, shortfall, q_error, drawn, member = int(anchor), 0.0, 0.0, True, True
    for t in range(len(c)):
        scores = unary[t] + B[c[t]] @ (A[previous] * u[t])                               # (k,)
        at = (c[t] == drafts[t]).nonzero()
        member &= len(at) == 1
        pick = int(at[0]) if len(at) else 0
        if temperature == 0:
            shortfall = max(shortfall, float(scores.max() - scores[pick]))
        else:
            q_error = max(q_error, float((f(q[t]) - (scores / temperature).softmax(0)).abs().max()))
            cdf = f(q[t]).cumsum(0)
            drawn &= abs(min(int((cdf <= uniforms[t] * cdf[-1]).sum()), len(cdf) - 1) - pick) <= 1
        previous = int(drafts[t])
    return {"member": member, "shortfall": shortfall, "q_error": q_error, "drawn": drawn}


WALK_TOLERANCE = {"float32": 1e-4, "float16": 0.02, "bfloat16": 0.125}   # a score's rounding at the logits' 8-12


def check_walk(runs: dict):
    """Every draft one of its row's candidates, the candidates the twin's; re-scored in float64, each greedy draft
    its row's best within the score's rounding in the dtype, each drawn one the draw of a q within that
    rounding of the exact softmax (its exponent's /T scale at 0.7). In fp32 also every draft the twin's and q
    the twin's within 1e-5; in fp16 and bf16 the twin's walk may part where two scores round to a tie."""
    assert runs
    for key, run in runs.items():
        tolerance = WALK_TOLERANCE[key.split(".")[-1]]
        assert run["member"] and run["candidates"] and run["q_none"] and run["drawn"], (key, run)
        assert run["shortfall"] <= tolerance and run["q_error"] <= 1e-5 + tolerance / 2, (key, run)
        if key.endswith("float32"):
            assert run["drafts_differ"] == 0 and run["q"] < 1e-5, (key, run)


def test_candidate_walk_kernels_under_the_triton_interpreter():
    """DFlash2's walk as four kernels (the candidates, every row's scores, then the picks), run by Triton's CPU interpreter in
    fp32 and fp16, drafts what the selector's own forward drafts, greedy and drawn (`check_walk`)."""
    runs = under_the_triton_interpreter("walk_mismatches('cpu', [torch.float32, torch.float16])")
    assert len(runs) == 2 * 2 * len(WALK_CASES)
    check_walk(runs)


def test_candidate_walk_is_the_selector_off_cuda():
    """Off CUDA (and in float64) candidate_walk is the selector's own forward, which the conformance kit records."""
    sentinel = object()
    selector = mock.Mock(return_value=sentinel)
    assert kernels.candidate_walk(selector, torch.zeros(2, 4), torch.zeros(2, 8), torch.tensor(1), 0.0, None) \
        is sentinel
    selector.assert_called_once()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_candidate_walk_kernels_on_cuda():
    """The same on the GPU, in fp32, fp16 and bf16."""
    runs = walk_mismatches("cuda", [torch.float32, torch.float16, torch.bfloat16])
    print(runs)
    check_walk(runs)


def head_kernel_errors(device, dtypes, cases=((37, 1000), (5, 4096)), block=256):
    """The head loss kernel (triton_head_chunk_grad; tiles of `block`, so that a row takes several,
    the last cut short where V is not a multiple) and its twin head_chunk_grad, each against float64
    autograd: the largest errors of the loss and of the gradient to the logits, the largest exact
    values, and whether each gradient came back in the logits' dtype."""
    errors = {}
    for rows, vocab in cases:
        for dtype in dtypes:
            logits, labels, w, want, want_grad = head_chunk_cases(device, dtype, rows, vocab)
            runs = {"kernel": objective.triton_head_chunk_grad(logits, labels, w, block=block),
                    "twin": objective.head_chunk_grad(logits, labels, w)}
            errors[f"{rows}x{vocab} {dtype}"] = {
                **{name: [abs(loss.item() - want.item()), (grad.double() - want_grad).abs().max().item()]
                   for name, (loss, grad, _) in runs.items()},
                "largest": [abs(want.item()), want_grad.abs().max().item()],
                "same_dtype": all(grad.dtype == dtype for _, grad, _ in runs.values())}
    return errors


def check_head_kernel(errors: dict):
    """The kernel's loss and gradient are within twice the twin's own error in the same dtype plus
    1e-6 of the largest exact value (at least 1e-6)."""
    assert errors
    for key, e in errors.items():
        assert e["same_dtype"], key
        for i in range(2):
            assert e["kernel"][i] <= 2 * e["twin"][i] + 1e-6 * max(1.0, e["largest"][i]), (key, i, e)


def head_kernel_top_k(device, dtypes, cases=((37, 1000, 5), (6, 100, 16)), block=256):
    """The head loss kernel with top_k (tiles of `block`: a row of several, and a vocabulary shorter than
    one), on random logits with some rows crowded by ties (a constant row, a row of few distinct values,
    the top value repeated) or with the largest logits all in one lane of the tiles: per case, whether every row's ids are distinct columns whose logits are
    torch.topk's values, largest first, and whether the loss and gradient are bitwise those without top_k."""
    results = {}
    for rows, vocab, top_k in cases:
        for dtype in dtypes:
            logits, labels, w, _, _ = head_chunk_cases(device, dtype, rows, vocab)
            logits[0] = 1.0                                                           # every column tied
            logits[1] = torch.randint(0, 3, (vocab,), generator=torch.Generator().manual_seed(1)).to(device, dtype)
            logits[2, ::7] = logits[2].max()                                          # the top value many times
            lane = logits[3:5, 5::block]                                              # one lane's columns
            logits[3, 5::block] = 20 + torch.arange(lane.shape[1], dtype=dtype, device=device)   # rising along it,
            logits[4, 5::block] = 20 - torch.arange(lane.shape[1], dtype=dtype, device=device)   # falling: all its top
            loss, grad, ids = objective.triton_head_chunk_grad(logits, labels, w, top_k, block=block)
            plain_loss, plain_grad, none = objective.triton_head_chunk_grad(logits, labels, w, block=block)
            in_range = bool(((ids >= 0) & (ids < vocab)).all())
            results[f"{rows}x{vocab} top {top_k} {dtype}"] = {
                "shape": list(ids.shape) == [rows, top_k] and list(none.shape) == [rows, 0],
                "distinct": in_range and all(len(set(r)) == top_k for r in ids.tolist()),
                "top_values": in_range and torch.equal(logits.gather(1, ids.clamp(0, vocab - 1)),
                                                       logits.topk(top_k, dim=-1).values),
                "same_loss": torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)}
    return results


def test_head_kernel_top_k_under_the_triton_interpreter():
    """The head loss kernel's top k, taken in its two passes over each row (the logits at or above a floor
    from the first pass's lane maxima; where ties crowd the floor, picked one at a time), run by Triton's
    CPU interpreter in fp32 and fp16: torch.topk's values in order from distinct columns, and the loss
    and gradient unchanged (every check true: `check_topk`)."""
    results = under_the_triton_interpreter("head_kernel_top_k('cpu', [torch.float32, torch.float16])")
    assert len(results) == 2 * 2
    check_topk(results)


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
    kernel's own tiles (a full chunk of 8,192 rows and a short one); its top k likewise, and at Qwen3's
    vocabulary."""
    errors = head_kernel_errors("cuda", [torch.float32, torch.float16, torch.bfloat16])
    errors |= head_kernel_errors("cuda", [torch.bfloat16], cases=((objective.CE_CHUNK, 49152), (1000, 49152)),
                                 block=objective.HEAD_BLOCK)
    print(errors)
    check_head_kernel(errors)
    results = head_kernel_top_k("cuda", [torch.float32, torch.float16, torch.bfloat16])
    results |= head_kernel_top_k("cuda", [torch.bfloat16], cases=((objective.CE_CHUNK, 49152, 16), (1000, 151936, 16)),
                                 block=objective.HEAD_BLOCK)
    print(results)
    check_topk(results)
