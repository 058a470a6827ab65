"""On CPU: a cheap pointwise value (slots, a cos table) read by several calls of an opaque op is
recomputed into a fresh buffer for each call under inductor, as fastpath's Triton kernels meet it on
CUDA. Read the generated module's `def call` in TORCHINDUCTOR_CACHE_DIR. Variants: base, static (copy_ into buffers), contig,
reads0 (realize_reads_threshold = 0: one kernel), force (inductor_force_stride_order: one kernel).

    $ TORCHINDUCTOR_CACHE_DIR=/tmp/c python cpu_repro.py force
"""
import torch, sys
import torch._inductor.inductor_prims
torch.library.define("demo::consume", "(Tensor cos, Tensor slots, Tensor(a!) keys) -> Tensor")
@torch.library.impl("demo::consume", "cpu")
def _(cos, slots, keys):
    keys[0, slots[0]] = cos[0]
    return cos * 2
@torch.library.register_fake("demo::consume")
def _(cos, slots, keys):
    return torch.empty_like(cos)
inv = torch.rand(32)
variant = sys.argv[1]
tables = torch.zeros(1, 4, 64, dtype=torch.bfloat16); slot_buf = torch.zeros(1, 4, dtype=torch.long)
def step(start, x, keys):
    slots = (start + torch.arange(4))[None]              # (1, 4)
    freqs = slots[..., None].float() * inv               # (1, 4, 32)
    emb = torch.cat([freqs, freqs], -1)
    cos = emb.cos().to(torch.bfloat16)
    if variant == "static":
        cos = tables.copy_(cos); slots = slot_buf.copy_(slots)
    if variant == "force":

        cos = torch.ops.prims.inductor_force_stride_order(cos, cos.stride()); slots = torch.ops.prims.inductor_force_stride_order(slots, slots.stride())
    if variant == "contig":
        cos, slots = cos.contiguous(), slots.contiguous()
    for l in range(3):
        x = x + torch.ops.demo.consume(cos, slots, keys[l])
    return x
opts = {"realize_reads_threshold": 0} if variant == "reads0" else {}
f = torch.compile(step, fullgraph=True, options=opts)
keys = torch.zeros(3, 1, 1024, 64, dtype=torch.bfloat16)
print(f(torch.tensor(5), torch.zeros(1, 4, 64, dtype=torch.bfloat16), keys).shape)
