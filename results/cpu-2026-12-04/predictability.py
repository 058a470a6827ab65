"""How sure SmolLM2 itself is where the shipped drafter's drafts are accepted and where they are not.

For the first N prompts of MT-Bench and HumanEval (chat template, ≤ 256 new tokens, float32 on CPU,
K = 15 as on the H200): decode with `dflash.generate`, then run the target once over prompt + answer
and read, at every answer position, the target's own probability of the token it chose (its top-1
probability p1; greedy, so the chosen token is its argmax). Each round's draft j aims at the position j
after the round's first token; it is reached when drafts 1..j-1 were accepted. Acceptance of the
reached drafts is binned by p1 at the drafted position, for draft 1 and for all drafts.

    $ python results/cpu-2026-12-04/predictability.py --limit 20 --out results/cpu-2026-12-04/predictability.json
    $ python results/cpu-2026-12-04/predictability.py --replot --out results/cpu-2026-12-04/predictability.json

Writes the JSON and a plot beside it (.png): acceptance by p1 bin, and the share of positions in each.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import dflash  # noqa: E402
import evaluation  # noqa: E402
import offline  # noqa: E402
import train  # noqa: E402

BINS = [0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0001]


def bin_of(p: float) -> int:
    return next(i for i in range(len(BINS) - 1) if p < BINS[i + 1])


def answer_p1(target, prompt_ids: list[int], answer: list[int]) -> tuple[list[float], int]:
    """p1[i]: the target's probability of answer[i] given prompt + answer[:i] (one forward over the
    whole answer), and how many answer tokens are not that forward's argmax (near-ties that one
    forward and the step-by-step decode round apart)."""
    ids = torch.tensor([prompt_ids + answer])
    logits = target(ids).logits[0, len(prompt_ids) - 1:-1].float()                     # (len(answer), V)
    probs = logits.softmax(-1)
    chosen = probs.gather(1, torch.tensor(answer)[:, None])[:, 0]
    return chosen.tolist(), int((probs.argmax(-1) != torch.tensor(answer)).sum())


def plot(report: dict, path: Path):
    """Per set: the share of answer positions in each p1 bin (bars) and draft-1 acceptance there (line)."""
    plt = evaluation.pyplot()
    if plt is None:
        return print("matplotlib is not installed: no plot")
    labels = [f"{a:.2f}–{min(b, 1):.2f}" for a, b in zip(BINS, BINS[1:])]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.4
    for k, (name, d) in enumerate(report["datasets"].items()):
        share = [n / sum(d["positions_by_p1"]) for n in d["positions_by_p1"]]
        xs = [i + (k - 0.5) * width for i in range(len(labels))]
        ax.bar(xs, share, width, alpha=0.35, label=f"{name}: share of positions", color=f"C{k}")
        ax.plot(range(len(labels)), d["draft1"]["rate"], marker="o", color=f"C{k}",
                label=f"{name}: draft-1 acceptance (τ {d['tau']:.2f})")
    mids = [(a + min(b, 1)) / 2 for a, b in zip(BINS, BINS[1:])]
    ax.plot(range(len(labels)), mids, ls=":", color="gray", label="acceptance = p1 (bin middle)")
    ax.set(xticks=range(len(labels)), xticklabels=labels, ylim=(0, 1.05),
           xlabel="SmolLM2's probability of its own greedy token at the drafted position",
           title=f"acceptance against the target's confidence (first {next(iter(report['datasets'].values()))['prompts']} prompts, K = {report['num_drafts']})")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--num-drafts", type=int, default=15)
    parser.add_argument("--out", required=True)
    parser.add_argument("--replot", action="store_true", help="only redraw the plot from --out")
    args = parser.parse_args()
    if args.replot:
        return plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
    torch.set_grad_enabled(False)
    target, tokenizer = train.load_target_and_tokenizer(str(offline.ensure_smollm2()), torch.float32, "cpu")
    drafter = dflash.load_drafter(str(offline.DEFAULT_DRAFT), target, torch.float32, "cpu")
    stops = offline.stop_token_ids(target, tokenizer)
    report = {"target": "SmolLM2-135M-Instruct", "drafter": str(offline.DEFAULT_DRAFT), "dtype": "float32",
              "num_drafts": args.num_drafts, "max_new_tokens": 256, "bins": BINS[:-1] + [1.0], "datasets": {}}
    for name, prompts in (("mtbench", offline.read_mtbench()), ("humaneval", offline.read_humaneval())):
        nb = len(BINS) - 1
        first = {"reached": [0] * nb, "accepted": [0] * nb}
        every = {"reached": [0] * nb, "accepted": [0] * nb}
        positions = [0] * nb
        rounds = tokens = committed = not_argmax = 0
        for text in prompts[:args.limit]:
            ids = train.encode_chat(tokenizer, text)
            gen = dflash.generate(target, drafter, ids, 256, num_drafts=args.num_drafts, stop_ids=stops)
            p1, off = answer_p1(target, ids, gen.tokens)
            not_argmax += off
            for p in p1[1:]:
                positions[bin_of(p)] += 1
            start = 0                                  # the round's first token: the prefill's, then each bonus
            for r in gen.rounds:
                for j in range(1, min(len(r["draft"]), r["accepted"] + 1) + 1):
                    if start + j >= len(p1):           # past a stop or the limit
                        break
                    b, ok = bin_of(p1[start + j]), j <= r["accepted"]
                    every["reached"][b] += 1
                    every["accepted"][b] += ok
                    if j == 1:
                        first["reached"][b] += 1
                        first["accepted"][b] += ok
                start += r["accepted"] + 1
            assert start >= len(gen.tokens) - 1, (start, len(gen.tokens))   # every token after the first, by round
            rounds += len(gen.rounds)
            tokens += len(gen.tokens)
            committed += sum(gen.acceptance_lengths)
        rate = lambda d: [a / n if n else None for a, n in zip(d["accepted"], d["reached"])]   # noqa: E731
        report["datasets"][name] = {"prompts": min(args.limit, len(prompts)), "tokens": tokens, "rounds": rounds,
                                    "tau": committed / rounds if rounds else None, "not_argmax": not_argmax,
                                    "positions_by_p1": positions, "draft1": first | {"rate": rate(first)},
                                    "all_drafts": every | {"rate": rate(every)}}
        d = report["datasets"][name]
        print(f"\n{name}: {d['prompts']} prompts, {tokens} tokens, τ {d['tau']:.2f}; {not_argmax} tokens not the "
              f"whole-answer forward's argmax")
        print(f"{'target p1':>12} {'positions':>10} {'draft 1 reached':>16} {'accepted':>9} {'all reached':>12} {'accepted':>9}")
        for i in range(nb):
            f, e = d["draft1"], d["all_drafts"]
            fr = f"{f['rate'][i]:.2f}" if f["rate"][i] is not None else "-"
            er = f"{e['rate'][i]:.2f}" if e["rate"][i] is not None else "-"
            print(f"{BINS[i]:>5.2f}–{min(BINS[i + 1], 1):<5.2f} {positions[i] / max(sum(positions), 1):>10.1%} "
                  f"{f['reached'][i]:>16} {fr:>9} {e['reached'][i]:>12} {er:>9}")
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(report, Path(args.out).with_suffix(".png"))
    print(f"-> {args.out}, {Path(args.out).with_suffix('.png')}")


if __name__ == "__main__":
    main()
