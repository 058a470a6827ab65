"""On CPU, at phase 13's shapes (phase 16's cpu_counts.py: 32 sequences of 200-768 positions, prompts
20-150, <= 128 sorted anchors of blocks of 16, seed 0): the flex attention tiles (128 x 128) of the packed
forward's context BlockMask now that each block's own rows are attended apart (dflash.attend_packed),
against phase 16's count for the whole key range (cpu-counts.json there: 1,598 partly seen, 706 wholly).

    $ python cpu_tiles.py OUT_JSON
"""
import json, os, sys
sys.path.insert(0, os.getcwd())
import torch
import train
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../h200-2026-12-04-phase16/scripts"))
from cpu_counts import B, phase13_anchors   # phase 16's batch, so the counts compare


def main(out):
    block_anchors, N = phase13_anchors(torch.Generator().manual_seed(0))
    Bt, P = block_anchors.shape
    result = {"torch": torch.__version__, "sequences": Bt, "block": B, "anchors_at_most": P, "N": N,
              "query_tiles": Bt * P * B // 128,
              "phase 16, keys [context | own rows]": {"partly_seen": 1598, "wholly_seen": 706, "kept": 2304}}
    for name, causal, window in (("bidirectional", False, None), ("causal", True, None), ("sliding 40", True, 40)):
        context = train.packed_mask(block_anchors, B, N, causal, window, True).context
        partly, wholly = int(context.kv_num_blocks.sum()), int(context.full_kv_num_blocks.sum())
        result[f"context alone, {name}"] = {"partly_seen": partly, "wholly_seen": wholly, "kept": partly + wholly}
        print(f"context alone, {name:13s}: {partly} tiles partly seen, {wholly} wholly, {partly + wholly} kept "
              f"(phase 16, keys [context | own rows], bidirectional: 1598, 706, 2304)")
    json.dump(result, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
