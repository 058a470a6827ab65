"""The eager operations left in the packed forward's step when train --compile compiles the drafter's
forward alone (82fcb78) and when train.compile_drafter compiles the context's path too: train.draft_hidden
forward and backward on CPU at SmolLM2's drafter size (3 layers, H 576, heads 9/3, d 64; 2 sequences
of 60 tokens, blocks of 16), float32, the profiler's leaf aten operations after 3 warm-up steps. Views
and other operations that launch no kernel on CUDA are left out; compiled graphs count as their calls.

    $ python cpu_count.py OUT_JSON
"""
import json, os, sys
from collections import Counter
sys.path.insert(0, os.getcwd())
import torch
from torch.profiler import profile
import bench, train

NO_KERNEL = {"aten::" + name for name in (
    "as_strided view empty empty_strided empty_like new_empty new_empty_strided resolve_conj resolve_neg "
    "result_type promote_types t transpose unsqueeze squeeze expand detach detach_ alias reshape "
    "_reshape_alias unflatten flatten split split_with_sizes unbind select slice narrow chunk permute "
    "_unsafe_view lift_fresh set_ is_nonzero item _local_scalar_dense to _to_copy contiguous clone "
    "resize_ scalar_tensor").split()}
target, _ = bench.build_pair(bench.SHAPES["smollm2-135m"], torch.float32, "cpu")
raw = train.new_drafter_config(target, 3, 16, target.config.vocab_size - 1, 5)
g = torch.Generator().manual_seed(0)
sequences = [train.Sequence(torch.randint(0, 1000, (60,), generator=g), 5) for _ in range(2)]
results = {}
for name in ("forward compiled (82fcb78)", "compile_drafter"):
    torch.manual_seed(0)
    drafter = train.new_drafter(target, raw).requires_grad_(True)
    torch._dynamo.reset()
    train.compile_drafter(drafter) if name == "compile_drafter" else drafter.compile(**train.COMPILE)

    def step(i):
        blocks = train.make_blocks(sequences, 6, 16, raw["dflash_config"]["mask_token_id"], torch.Generator().manual_seed(i))
        features = torch.randn(2, 60, drafter.fc.weight.shape[1], generator=torch.Generator().manual_seed(i))
        drafter.zero_grad(set_to_none=True)   # as train's step: the gradients are made, not accumulated
        train.draft_hidden(target, drafter, blocks, features).sum().backward()

    for i in range(3):
        step(i)
    with profile() as prof:
        step(3)
    ops = Counter(e.name for e in prof.events() if e.name.startswith("aten::") and not e.cpu_children
                  and e.name not in NO_KERNEL)
    graphs = sum(1 for e in prof.events() if e.name.startswith("Torch-Compiled Region"))
    results[name] = {"eager_ops": sum(ops.values()), "compiled_regions": graphs, "ops": dict(ops.most_common())}
    print(f"{name:28} eager operations {sum(ops.values()):4}   compiled regions {graphs:3}   "
          + ", ".join(f"{op[6:]} {n}" for op, n in ops.most_common(6)))
json.dump({"torch": torch.__version__, "setting": __doc__.split("\n\n")[0], "runs": results}, open(sys.argv[1], "w"), indent=1)
