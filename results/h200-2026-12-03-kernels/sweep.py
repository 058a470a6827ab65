"""The part of a target layer between the [q; k; v] matmul and o_proj, at batch 1, on the H200:
fastpath's previous way (the model's q/k norms and RoPE, index writes into K/V, the masked softmax
`attend` over all C slots, compiled by inductor) against the Triton kernels (`heads_into_place`, then
`triton_attend_upto` at several span counts), each compiled (fullgraph, static shapes) and replayed
as one CUDA graph over L layers of distinct buffers. Prints a table, writes JSON.

    python results/h200-2026-12-03-kernels/sweep.py --out sweep.json
"""
import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench   # noqa: E402
import fastpath   # noqa: E402
import transformers.models.qwen3.modeling_qwen3 as qwen3   # noqa: E402

SHAPES = {"smollm2-135m": dict(h=9, hk=3, d=64, layers=30, norm=False),
          "qwen3-8b": dict(h=32, hk=8, d=128, layers=36, norm=True)}
C, CONTEXT = 1024, 640   # bench.py's capacity at prompt 512 + 256 new, and its mid-generation context


def before(attn, qkv_rows, keys, values, cos, sin, slots):
    """fastpath before the kernels: heads_into_place's twin (traced with fastpath.triton = None), then
    attend under the mask slot <= last."""
    q = fastpath.heads_into_place(attn, qwen3.apply_rotary_pos_emb, qkv_rows, keys, values, cos, sin, slots)
    mask = torch.arange(keys.shape[-2], device=q.device) <= slots[..., None]
    return fastpath.attend(q, keys, values, mask, attn.scaling)


def after(attn, qkv_rows, keys, values, cos, sin, slots):
    q = fastpath.triton_heads_into_place(attn, qkv_rows, keys, values, cos, sin, slots)
    return fastpath.triton_attend_upto(q, keys, values, slots, attn.scaling)


def measure(fn, layer_args, programs=None) -> dict:
    """fn compiled once and called for every layer's arguments, captured as one graph: bench.graph_profile per layer."""
    torch._dynamo.reset()
    no_triton = mock.patch.object(fastpath, "triton", None) if fn is before else mock.patch.object(fastpath, "triton", fastpath.triton)
    spans = mock.patch.object(fastpath, "MAX_SPANS", 16)   # call 1 ran before the cap; the sweep chooses it
    with mock.patch.object(fastpath, "PROGRAMS", programs or fastpath.PROGRAMS), spans, no_triton:
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        graph = bench.captured(lambda: [compiled(*a) for a in layer_args])
    return bench.graph_profile(graph, steps=10, calls=len(layer_args))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    torch.manual_seed(0)
    results = []
    for shape_name, s in SHAPES.items():
        attn = torch.nn.Module()
        attn.scaling = s["d"] ** -0.5
        if s["norm"]:
            attn.q_norm, attn.k_norm = qwen3.Qwen3RMSNorm(s["d"]), qwen3.Qwen3RMSNorm(s["d"])
            attn.to("cuda", torch.bfloat16)
        for N in (1, 16):
            width = (s["h"] + 2 * s["hk"]) * s["d"]
            slots = CONTEXT + torch.arange(N, device="cuda")[None]                       # (1, N)
            angles = torch.rand(1, N, s["d"] // 2, device="cuda").repeat(1, 1, 2)
            cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
            layer_args = [(attn, torch.randn(1, N, width, device="cuda", dtype=torch.bfloat16),
                           torch.randn(1, s["hk"], C, s["d"], device="cuda", dtype=torch.bfloat16),
                           torch.randn(1, s["hk"], C, s["d"], device="cuda", dtype=torch.bfloat16), cos, sin, slots)
                          for _ in range(s["layers"])]
            M = N * s["h"] // s["hk"]
            m_blocks = -(-M // (16 if M <= 16 else 64))
            variants = [("before: twin + masked attend", before, None)] + [
                (f"after: kernels, {splits} span{'s' if splits > 1 else ''}", after, splits * s["hk"] * m_blocks)
                for splits in (1, 4, 16)]   # 16: what PROGRAMS = 512 gives at these shapes
            for name, fn, programs in variants:
                try:
                    r = measure(fn, layer_args, programs)
                except Exception as err:   # a variant that fails is reported, the sweep goes on
                    r = dict(error=f"{type(err).__name__}: {str(err)[:300]}")
                r.update(shape=shape_name, rows=N, variant=name, programs=programs)
                results.append(r)
                print(f"{shape_name:<14}{N:>4} rows  {name:<34}" + (
                    f"{r['replay_us']:8.2f} us/layer replayed {r['kernels']:5.1f} kernels "
                    f"{r['kernel_us']:7.2f} us kernel time" if "error" not in r else r["error"]), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(dict(
                        conditions=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, C=C, context=CONTEXT,
                                        dtype="bfloat16", PROGRAMS=fastpath.PROGRAMS), results=results), indent=2))


if __name__ == "__main__":
    main()
