"""On CPU, at phase 13's shapes (32 sequences of 200-768 positions, prompts 20-150, <= 128 sorted anchors
of blocks of 16): the packed forward's BlockMask tiles (128 x 128) partly and wholly seen, with the
context as long as the longest sequence and rounded up to a multiple of 128 (train --pad-shapes 128 1);
and the host time of make_blocks and block_slots for such a batch (median of 30).

    $ python cpu_counts.py OUT_JSON

Ran at af621aa. Since phase 17, train.packed_mask returns a dflash.PackedMask whose BlockMask covers the
context alone; ../../h200-2026-12-04-phase17/scripts/cpu_tiles.py counts that.
"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import torch
import train

Bt, B, P = 32, 16, 128


def phase13_anchors(g):
    """-> block_anchors (Bt, P), each sequence's sorted (0 in the empty slots), and the context length N,
    drawn from generator g (seeded 0 here and in phase 17's cpu_tiles.py and attention_probe.py)."""
    lengths, prompts = torch.randint(200, 769, (Bt,), generator=g), torch.randint(20, 150, (Bt,), generator=g)
    block_anchors = torch.zeros(Bt, P, dtype=torch.long)                                   # (Bt, P)
    for b, (n, pl) in enumerate(zip(lengths.tolist(), prompts.tolist())):
        a = sorted((torch.randperm(n - pl - B, generator=g)[:P] + pl).tolist())
        block_anchors[b, :len(a)] = torch.tensor(a)
    return block_anchors, int(lengths.max())


def median_ms(fn, reps=30):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(out):
    g = torch.Generator().manual_seed(0)
    block_anchors, N = phase13_anchors(g)
    result = {"torch": torch.__version__, "sequences": Bt, "block": B, "anchors_at_most": P, "tiles": {}}
    for name, context in (("context as is", N), ("context rounded up to 128", -(-N // 128) * 128)):
        mask = train.packed_mask(block_anchors, B, context, False, None, True)
        partly, wholly = int(mask.kv_num_blocks.sum()), int(mask.full_kv_num_blocks.sum())
        result["tiles"][name] = {"N": context, "partly_seen": partly, "wholly_seen": wholly, "kept": partly + wholly}
        print(f"{name:26s} N {context}: {partly} tiles partly seen, {wholly} wholly, {partly + wholly} kept")

    seqs = [train.Sequence(torch.randint(0, 49000, (int(n),), generator=g), int(p))
            for n, p in zip(torch.randint(200, 769, (Bt,), generator=g), torch.randint(20, 200, (Bt,), generator=g))]
    labels, gen = train.pad_sequences(seqs)[0].clone(), torch.Generator().manual_seed(1)
    blocks = train.make_blocks(seqs, P, B, 49151, gen, labels=labels)
    result["host_ms"] = {"make_blocks": median_ms(lambda: train.make_blocks(seqs, P, B, 49151, gen, labels=labels)),
                         "block_slots": median_ms(lambda: train.block_slots(blocks.sequence, Bt))}
    print("host ms:", {k: round(v, 2) for k, v in result["host_ms"].items()})
    json.dump(result, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
