"""Held-out τ against blocks seen since 13a, one line per phase: 14a (from 13a, 291 s) and 15a (from
14a, 443 s, the packed forward through flex attention), one panel per held-out set. Each line starts at
its start's own τ on the set (`at_init`); 15a's starts where 14a's blocks end.

    $ python results/h200-2026-12-04-phase15/plot.py
"""
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
RUNS = {"14a: from 13a, 291 s": (HERE.parent / "h200-2026-12-04-phase14" / "d14a" / "training.json", "14"),
        "15a: from 14a, 443 s (flex attention)": (HERE / "d15a" / "training.json", "15")}
SETS = {"11a's everyday turns": None, "stubs (the last 32)": "/root/stash/code{}.pt", "10a's turns": "/root/stash/self10h.pt"}


def tau(entry: dict, key: str | None):
    return entry.get("heldout_tau") if key is None else entry.get("heldout_more", {}).get(key, {}).get("tau")


fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
for ax, (title, key) in zip(axes, SETS.items()):
    start = 0
    for name, (path, phase) in RUNS.items():
        log, set_key = json.loads(path.read_text()), key and key.format(phase)
        points, seen = [(start, tau(log["at_init"], set_key))], start
        for entry in log["history"]:
            seen += entry["blocks"]
            if tau(entry, set_key) is not None:
                points.append((seen, tau(entry, set_key)))
        ax.plot([x / 1e6 for x, _ in points], [y for _, y in points], marker="o", label=name)
        start = seen
    ax.set(title=title, xlabel="blocks seen since 13a (millions)", ylabel="held-out τ (first 256 tokens)")
axes[0].legend(fontsize=8)
fig.tight_layout()
fig.savefig(HERE / "heldout.png", dpi=110)
print(f"-> {HERE / 'heldout.png'}")
