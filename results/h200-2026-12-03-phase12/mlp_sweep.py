"""A candidate for issue 15, not in fastpath: a target layer's MLP (SiLU(x·gateᵀ)·(x·upᵀ)·downᵀ plus the
residual) as one Triton kernel and one reduction, against fastpath's way (the [gate; up] GEMM, SiLU·mul,
the down GEMM, the add: 3–4 kernels), at SmolLM2-135M's size, where a step is bound by its kernel count.

Program j of the kernel takes intermediate columns [j·BJ, (j+1)·BJ): it multiplies the normed rows by
that slice of gate and up, rounds gate, up, SiLU(gate) and the product to the model's dtype as the
modules do, multiplies by the same columns of down, and writes its partial sum (M, H) in fp32. The
partials are then summed in a fixed order and added to the residual, which inductor can fuse into the
next layer's RMSNorm (here it is one kernel of its own). Deterministic: no atomics.

    TRITON_INTERPRET=1 python results/h200-2026-12-03-phase12/mlp_sweep.py --check   # CPU: exactness only
    python results/h200-2026-12-03-phase12/mlp_sweep.py --out mlp-sweep.json          # H200: exactness, then timings

The timings replay 30 layers of distinct weights as one CUDA graph (L2 holds none of them), per layer:
kernels, kernel µs, replay µs (bench.graph_profile), at 1 and 16 rows, for BJ = 16, 32 and 64.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

H, I, LAYERS = 576, 1536, 30   # SmolLM2-135M


@triton.jit
def _mlp_partials(X, GateUp, Down, Part, M, sxm, sgu, sdn, spj, spm, H: tl.constexpr, I: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """Rows X (M, H) through gate/up rows [j·BJ, (j+1)·BJ) of GateUp (2I, H) and down's columns of the
    same slice (Down (H, I)) -> Part[j] (M, H) in fp32. PRECISION: "ieee" for fp32 (no TF32), as torch's
    default matmul."""
    j, m = tl.program_id(0), tl.program_id(1)
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = j * BLOCK_J + tl.arange(0, BLOCK_J)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_J), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_J), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(X + rows[:, None] * sxm + hs[None, :], mask=(rows[:, None] < M) & (hs[None, :] < H), other=0.0)
        w_gate = tl.load(GateUp + cols[:, None] * sgu + hs[None, :], mask=hs[None, :] < H, other=0.0)
        w_up = tl.load(GateUp + (I + cols)[:, None] * sgu + hs[None, :], mask=hs[None, :] < H, other=0.0)
        acc_gate += tl.dot(x, tl.trans(w_gate), input_precision=PRECISION)
        acc_up += tl.dot(x, tl.trans(w_up), input_precision=PRECISION)
    dtype = X.dtype.element_ty   # the rounding the modules do: each matmul's output, SiLU's, the product's
    gate, up = acc_gate.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    inner = (act * up).to(dtype)                                                       # (BLOCK_M, BLOCK_J)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        w_down = tl.load(Down + hs[None, :] * sdn + cols[:, None], mask=hs[None, :] < H, other=0.0)   # (BJ, BLOCK_H)
        part = tl.dot(inner, w_down, input_precision=PRECISION)                        # (BLOCK_M, BLOCK_H)
        tl.store(Part + j * spj + rows[:, None] * spm + hs[None, :], part, mask=(rows[:, None] < M) & (hs[None, :] < H))


@torch.library.custom_op("mlp_sweep::partials", mutates_args=())
def mlp_partials(xn: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, block_j: int) -> torch.Tensor:
    """xn (M, H), gate_up (2I, H), down (H, I) -> partial sums (I / block_j, M, H), fp32."""
    M, Hx = xn.shape
    Ix = down.shape[1]
    part = torch.empty(Ix // block_j, M, Hx, device=xn.device, dtype=torch.float32)
    block_m = 16
    _mlp_partials[(Ix // block_j, triton.cdiv(M, block_m))](
        xn, gate_up, down, part, M, xn.stride(0), gate_up.stride(0), down.stride(0), part.stride(0), part.stride(1),
        H=Hx, I=Ix, BLOCK_M=block_m, BLOCK_J=block_j, BLOCK_H=64,
        PRECISION="ieee" if xn.dtype == torch.float32 else "tf32")
    return part


@mlp_partials.register_fake
def _(xn, gate_up, down, block_j):
    return xn.new_empty(down.shape[1] // block_j, xn.shape[0], xn.shape[1], dtype=torch.float32)


def fastpath_mlp(x, xn, gate_up, down, block_j=None):
    """fastpath.dense_layer's MLP: x (M, H) + down(SiLU(gate)·up), gate/up from xn (M, H) @ [gate; up]ᵀ."""
    gate, up = (xn @ gate_up.T).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down)


def fused_mlp(x, xn, gate_up, down, block_j=32):
    """The same with one kernel for both matmuls and SiLU·mul, then the partials summed in order."""
    return x + mlp_partials(xn, gate_up, down, block_j).sum(0).to(x.dtype)


def inputs(M, dtype, device, generator):
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)
    return rand(M, H), rand(M, H), rand(2 * I, H, scale=H ** -0.5), rand(H, I, scale=I ** -0.5)


def check(device, dtypes) -> dict:
    """Max |fused − fastpath's MLP| per dtype, rows and BJ, both in the same dtype (fp32: the matmul sums'
    order only; fp16/bf16: also a rounding of the output), with the float64 math as the scale."""
    g, errors = torch.Generator().manual_seed(0), {}
    for dtype in dtypes:
        for M in (1, 5, 16, 17):
            x, xn, gate_up, down = inputs(M, dtype, device, g)
            want = fastpath_mlp(x, xn, gate_up, down)
            for block_j in (16, 32, 64):
                got = fused_mlp(x, xn, gate_up, down, block_j)
                errors[f"{str(dtype)[6:]} M={M} BJ={block_j}"] = (got.double() - want.double()).abs().max().item()
    return errors


def measure(fn, M, block_j, generator):
    import bench
    layers = [inputs(M, torch.bfloat16, "cuda", generator) for _ in range(LAYERS)]
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, xn, gu, d: fn(x, xn, gu, d, block_j), fullgraph=True, dynamic=False)
    graph = bench.captured(lambda: [compiled(*layer) for layer in layers])
    return bench.graph_profile(graph, steps=10, calls=LAYERS)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="exactness only (with TRITON_INTERPRET=1 on CPU)")
    p.add_argument("--out")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    dtypes = [torch.float32, torch.float16] if device == "cpu" else [torch.float32, torch.bfloat16]
    errors = check(device, dtypes)
    for name, err in errors.items():
        print(f"{name:<22} max |fused - fastpath| {err:.3g}")
    results = []
    if not args.check and device == "cuda":
        g = torch.Generator().manual_seed(1)
        for M in (1, 16):
            for name, fn, block_j in [("fastpath: GEMM, SiLU·mul, GEMM, add", fastpath_mlp, None)] + [
                    (f"fused, BJ {bj}", fused_mlp, bj) for bj in (16, 32, 64)]:
                try:
                    r = measure(fn, M, block_j, g)
                except Exception as err:   # a variant that fails is reported, the sweep goes on
                    r = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
                r.update(rows=M, variant=name)
                results.append(r)
                print(f"{M:>3} rows  {name:<38}" + (f"{r['replay_us']:8.2f} us/layer replayed {r['kernels']:5.1f} "
                      f"kernels {r['kernel_us']:7.2f} us kernel time" if "error" not in r else r["error"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            conditions=dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
                            torch=torch.__version__, triton=triton.__version__, H=H, I=I, layers=LAYERS),
            errors=errors, results=results), indent=2))


if __name__ == "__main__":
    main()
