"""On CPU: a second Decoder with another K recompiles verify_step with K dynamic (automatic dynamic).

    $ TORCH_LOGS=recompiles,dynamic python cpu_dynamic_k.py 2>&1 | grep "as dynamic"
"""
import os, sys, tempfile
from pathlib import Path

import torch
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT)); os.chdir(ROOT)
import test_dflash as T, dflash, fastpath
torch.set_grad_enabled(False)
path = T.write_target(Path(tempfile.mkdtemp()), "llama")
target = dflash.load_target(str(path), torch.float32, "cpu")
raw, drafter = T.fresh_drafter(target, block_size=4, num_layers=1)
for d, K in [(None, 0), (drafter, 3)]:
    dec = fastpath.Decoder(target, d, 64, K)
    dec.prefill([1, 2, 3, 4, 5])
    torch.compile(dec.verify_step, fullgraph=True)()
    print("compiled verify for K =", K, flush=True)
