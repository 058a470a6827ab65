"""On CPU: a Decoder's draft and verify compiled by inductor against the eager ones, three steps on a
tiny float32 Llama target, on main and on the branch rope-stored (within 1e-5 on both, not bit-equal, as inductor's
fp32 is not eager's)."""
import os, sys, tempfile
from pathlib import Path

import torch
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT)); os.chdir(ROOT)
import test_dflash as T, dflash, fastpath
from contextlib import closing
path = T.write_target(Path(tempfile.mkdtemp()), "llama")
target = dflash.load_target(str(path), torch.float32, "cpu")
raw, drafter = T.fresh_drafter(target, block_size=5, num_layers=1)
with closing(fastpath.Decoder(target, drafter, 32, 4)) as eager, closing(fastpath.Decoder(target, drafter, 32, 4)) as traced:
    compiled = [torch.compile(part, fullgraph=True) for part in traced.parts().values()]
    with torch.inference_mode():
        for dec, parts in ((eager, list(eager.parts().values())), (traced, compiled)):
            dec.prefill([1, 2, 3, 4, 5]); dec.buf.max_accept.fill_(4)
            for _ in range(3):
                for part in parts: part()
    print("equal:", all(torch.allclose(a.double(), b.double(), atol=1e-5) for a, b in zip(traced.buf.tensors(), eager.buf.tensors())),
          "exact:", all(torch.equal(a, b) for a, b in zip(traced.buf.tensors(), eager.buf.tensors())))
