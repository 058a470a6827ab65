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


def phase13_anchors():
    """-> block_anchors (Bt, P) sorted per sequence (0 in the empty slots), B, and the context length N."""
    g = torch.Generator().manual_seed(0)
    Bt, B, P = 32, 16, 128
    lengths, prompts = torch.randint(200, 769, (Bt,), generator=g), torch.randint(20, 150, (Bt,), generator=g)
    block_anchors = torch.zeros(Bt, P, dtype=torch.long)                                   # (Bt, P)
    for b, (n, pl) in enumerate(zip(lengths.tolist(), prompts.tolist())):
        a = sorted((torch.randperm(n - pl - B, generator=g)[:P] + pl).tolist())
        block_anchors[b, :len(a)] = torch.tensor(a)
    return block_anchors, B, int(lengths.max())


def main(out):
    block_anchors, B, N = phase13_anchors()
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
