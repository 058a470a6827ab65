"""On CPU: why storing the draft part's visible range (`fastpath.stored(positions[-1].expand(W))`) gave
the H200 wrong drafts. `stored` is `as_strided(size, stride)`, with no storage offset. Torch 2.11's
inductor (the GPU machine's) lowers that by unwrapping a view input to its buffer and taking offset
`storage_offset or 0`, so a view at offset W-1 of the stored positions reads positions[0]: every block
row saw the context and the block's first slot only. Torch 2.13 (pytorch#175325, fixed by #180581)
keeps the view's offset. `python stored_offset.py 2.11` installs 2.11's lowering of
aten.as_strided.default, copied from the 2.11.0 wheel, over 2.13's.

An opaque op reads the value 3 times, as the drafter layers' Triton kernels read `last`; each way of
storing is checked for the value read (start = 10) and the kernels that compute it.

    $ python stored_offset.py [2.11]
"""
import re
import sys

import sympy
import torch
from torch._inductor import ir, lowering
from torch._inductor.utils import run_and_get_code

torch._inductor.config.force_disable_caches = True   # else a graph compiled under the other lowering is reused

if "2.11" in sys.argv:   # torch 2.11.0, torch/_inductor/lowering.py, as_strided
    def as_strided_211(x, size, stride, storage_offset=None):
        new_device = None
        new_dtype = None
        if isinstance(x, ir.TensorBox) and isinstance(x.data, ir.BaseView):
            new_device = x.get_device()
            new_dtype = x.dtype
            x = x.data.unwrap_view()
        x.realize()
        if not ir.is_storage_and_layout(x):
            raise NotImplementedError(f"unrealized as_strided({x}, ...)")
        storage, old_layout = ir.as_storage_and_layout(x)
        new_layout = ir.FixedLayout(
            new_device if new_device else old_layout.device,
            new_dtype if new_dtype else old_layout.dtype,
            [sympy.expand(s) for s in size],
            [sympy.expand(s) for s in stride],
            sympy.expand(storage_offset or 0),
        )
        return ir.TensorBox(ir.ReinterpretView(data=storage, layout=new_layout))
    lowering.register_lowering(torch.ops.aten.as_strided.default, type_promotion_kind=None)(as_strided_211)

torch.library.define("demo::read", "(Tensor last) -> Tensor")


@torch.library.impl("demo::read", "cpu")
def _(last):   # opaque: reads what it is handed, as a Triton kernel given last's pointer and strides
    return last.clone()


@torch.library.register_fake("demo::read")
def _(last):
    return torch.empty_like(last, memory_format=torch.contiguous_format)


def as_strided(t):   # fastpath.stored while compiling
    return t.as_strided(t.size(), t.stride())


WAYS = {"not stored": lambda t: t,
        "as_strided (fastpath.stored)": as_strided,
        "clone, then as_strided": lambda t: as_strided(t.clone()),   # remove_noop_ops drops a same-layout clone
        "t * 1, then as_strided": lambda t: as_strided(t * 1)}       # a fresh value, never a view
W = 4
CASES = {   # positions (stored as fastpath stores them) -> the value read, and what it should be
    "positions[-1].expand(W) (a full layer's last)": (lambda p: p[-1].expand(W), [13] * 4),
    "positions[1:] (a slice at offset 1)": (lambda p: p[1:], [11, 12, 13]),
    "minimum(positions[-1], positions + 1) (a window)": (lambda p: torch.minimum(p[-1].expand(W), p + 1), [11, 12, 13, 13]),
}


def run(store, make):
    def step(start):
        positions = as_strided(start + torch.arange(W))                                 # (W,) a fresh value
        last = store(make(positions))
        return [torch.ops.demo.read(last[None]) for _ in range(3)]
    torch._dynamo.reset()
    outs, (code,) = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=False), torch.tensor(10))
    return outs[0][0].tolist(), len(re.findall(r"^\s+cpp_fused\w*\(", code, re.M))


if __name__ == "__main__":
    print("aten.as_strided lowered as in torch", "2.11.0" if "2.11" in sys.argv else torch.__version__)
    for case, (make, expected) in CASES.items():
        print(f"{case}: should read {expected}")
        for way, store in WAYS.items():
            got, kernels = run(store, make)
            print(f"   {way:30s} {'right' if got == expected else 'WRONG'} {got}, {kernels} kernel(s) for 3 reads")
