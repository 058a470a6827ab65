"""Feature capture (train.CachedFeatures, the fill before training) with the target's SDPA through cuDNN
(the default on the H200) against cuDNN left out (dflash.TARGET_ATTENTION, as train.capture_features
now runs it). SmolLM2-135M shapes, random weights, bf16, 5 captured layers; sequences of 200-768
tokens as phase 7's (367 on average), each run its own, so that no run meets a length another planned."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
from torch.nn.attention import SDPBackend
import bench, dflash, train

target, _ = bench.build_pair(bench.SHAPES["smollm2-135m"])
vocab = target.config.vocab_size
layer_ids = train.new_drafter_config(target, 3, 16, vocab - 1, 5)["dflash_config"]["target_layer_ids"]
LEFT_OUT = list(dflash.TARGET_ATTENTION)


def sequences(seed, count):
    g = torch.Generator().manual_seed(seed)
    return [train.Sequence(torch.randint(0, vocab - 2, (int(n),), generator=g), 100)
            for n in torch.randint(200, 769, (count,), generator=g)]


def fill(seqs):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    cached = train.CachedFeatures(target, seqs, layer_ids, torch.bfloat16)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, cached


fill(sequences(0, 200))   # CUDA and cuBLAS start-up, untimed
rows = []
for run, (name, backends) in enumerate([("cuDNN left out", LEFT_OUT), ("with cuDNN", LEFT_OUT + [SDPBackend.CUDNN_ATTENTION]),
                                        ("cuDNN left out", LEFT_OUT), ("with cuDNN", LEFT_OUT + [SDPBackend.CUDNN_ATTENTION])]):
    dflash.TARGET_ATTENTION = backends
    seqs = sequences(run + 1, 4000)
    tokens = sum(len(s.ids) for s in seqs)
    seconds, cached = fill(seqs)
    del cached
    rows.append({"run": name, "sequences": len(seqs), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds})
    print(rows[-1], flush=True)
dflash.TARGET_ATTENTION = LEFT_OUT
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "bfloat16",
           "target": "SmolLM2-135M shapes, random weights", "captured_layers": layer_ids, "rows": rows},
          open(os.environ["OUT"] + "/ab-capture.json", "w"), indent=1)
