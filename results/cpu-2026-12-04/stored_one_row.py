"""On CPU: `fastpath.stored` (inductor's `prims.inductor_force_stride_order`) stores a value that several
calls of an opaque op read, except when it has one element: `ExternKernel.require_strides` returns a
0- or 1-element input untouched unless exact strides are asked for, so the 1-row AR step's slots
(1, 1) are still recomputed for every call, as bench.py's AR profile on the H200 showed (28 kernels
`triton_poi_fused__unsafe_view_add_arange_unsqueeze` a step). Counts the kernels that compute the
slots in the generated code, for N rows and a way of storing them.

    $ python stored_one_row.py        # prints, per way and N, the generated kernels that compute slots
"""
import re
import sys
from pathlib import Path

import torch
import torch._inductor.inductor_prims  # noqa: F401
from torch._inductor.utils import run_and_get_code

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import fastpath  # noqa: E402

torch.library.define("demo::consume", "(Tensor slots, Tensor(a!) keys) -> Tensor")


@torch.library.impl("demo::consume", "cpu")
def _(slots, keys):
    keys[0, slots[0, -1]] += 1
    return keys[0, :1].sum()


@torch.library.register_fake("demo::consume")
def _(slots, keys):
    return keys.new_empty(())


WAYS = {"none": lambda t: t,
        "force_stride_order": lambda t: torch.ops.prims.inductor_force_stride_order(t, t.stride()),
        "as_strided": lambda t: t.as_strided(t.size(), t.stride()),
        "fastpath.stored": fastpath.stored}


def compiled_code(way, rows):
    def step(start, keys):
        slots = WAYS[way]((start + torch.arange(rows))[None])                           # (1, N)
        return sum(torch.ops.demo.consume(slots, keys[l]) for l in range(3))
    torch._dynamo.reset()
    keys = torch.zeros(3, 1, 64)
    _, (code,) = run_and_get_code(torch.compile(step, fullgraph=True), torch.tensor(5), keys)
    return code


if __name__ == "__main__":
    for way in WAYS:
        for rows in (1, 4):
            calls = re.findall(r"^\s+(cpp_fused\w*arange\w*)\(", compiled_code(way, rows), re.M)
            print(f"{way:20s} N={rows}: {len(calls)} slot kernel call(s) for 3 calls of the op {calls}")
