"""Redraw the shipped drafter's plots from its committed JSON: eval-h200.png (or eval-cpu.png) from
eval-*.json (the speedup as evaluation.py now reports it, DFlash's tokens/s over the target's), and training.png from the phase histories, one line per phase.

    $ python results/h200-2026-12-02-phase8/plots.py
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import evaluation  # noqa: E402

DRAFTER = Path(__file__).resolve().parents[2] / "drafter" / "SmolLM2-135M-Instruct-DFlash-b16"
PHASES = {"phase 1": "training-phase1.json", "phase 2": "training-phase2.json", "phase 3": "training-phase3.json",
          "phase 4": "training-phase4.json", "phase 5": "training-phase5.json", "phase 6a": "training-phase6a.json",
          "phase 6b": "training-phase6b.json", "phase 6c": "training-phase6c.json", "phase 7a": "training-phase7a.json",
          "phase 8a": "training-phase8a.json", "phase 9a": "training-phase9a.json", "phase 10a": "training-phase10a.json",
          "phase 11a": "training-phase11a.json", "phase 13a": "training.json"}

for name in ("eval-h200", "eval-cpu"):
    if (DRAFTER / f"{name}.json").is_file():
        report = json.loads((DRAFTER / f"{name}.json").read_text())
        for r in report["datasets"].values():   # runs before evaluation.py's tokens/s ratio stored a time ratio
            r["speedup"] = r["dflash_tokens_per_s"] / r["target_tokens_per_s"]
        evaluation.plot_eval(report["datasets"], DRAFTER / f"{name}.png")
logs = {phase: json.loads((DRAFTER / file).read_text()) for phase, file in PHASES.items()}
evaluation.plot_training(logs, DRAFTER / "training.png")
print(f"-> {DRAFTER}/eval-*.png, training.png")
