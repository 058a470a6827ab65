"""Phase 14's held-out τ against blocks seen: runs (a) argmax labels and (b) logit distillation from
13a at equal time, and the cut first try of (a), one panel per held-out set, each line starting at
13a's own τ on that set (`at_init`).

    $ python results/h200-2026-12-04-phase14/plot.py
"""
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
RUNS = {"14a: argmax labels (CE), 289 s": HERE / "d14a" / "training.json",
        "14b: logit distillation (KL), 289 s": HERE / "training-d14b.json",
        "14a's first try: argmax, 534 s planned, cut at step 3,500": HERE / "first-try" / "training-d14a.json"}
SETS = {"11a's everyday turns": None, "stubs": "/root/stash/code14.pt", "10a's turns": "/root/stash/self10h.pt"}


def tau(entry: dict, key: str | None):
    return entry.get("heldout_tau") if key is None else entry.get("heldout_more", {}).get(key, {}).get("tau")


fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
for ax, (title, key) in zip(axes, SETS.items()):
    for name, path in RUNS.items():
        log = json.loads(path.read_text())
        points, seen = [(0, tau(log["at_init"], key))], 0
        for entry in log["history"]:
            seen += entry["blocks"]
            if tau(entry, key) is not None:
                points.append((seen, tau(entry, key)))
        ax.plot([x / 1e6 for x, _ in points], [y for _, y in points], marker="o", label=name)
    ax.axhline(points[0][1], color="gray", lw=0.8, ls=":")   # 13a, where every run starts
    ax.set(title=title, xlabel="blocks seen in the phase (millions)", ylabel="held-out τ (first 256 tokens)")
axes[0].legend(fontsize=8)
fig.tight_layout()
fig.savefig(HERE / "heldout.png", dpi=110)
print(f"-> {HERE / 'heldout.png'}")
