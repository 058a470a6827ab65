"""Rewrite fastpath.py (run from the checkout's root) as one of the draft-part variants measured here:
    view   the draft part's positions stored through `stored` (`as_strided`), the visible ranges not
    fresh  the same, with `stored` taking `t * 1` first (stored-fresh.patch of ../h200-2026-12-04-stored)
    range  the positions and each layer's visible range stored (commit 48a07ed's draft part)

    $ python variant.py view|fresh|range
"""
import sys

POSITIONS = ("    positions = buf.start + torch.arange(W, device=device)                             # (W,)\n",
             "    positions = stored(buf.start + torch.arange(W, device=device))                     # (W,)\n")
RANGES = ("        first, last = visible_slots(positions, layer.causal, layer.window)\n",
          "        first, last = (s if s is None else stored(s) for s in visible_slots(positions, layer.causal, "
          "layer.window))\n")
FRESH = ("    return t.as_strided(t.size(), t.stride()) if torch.compiler.is_compiling() else t\n",
         "    if not torch.compiler.is_compiling():\n        return t\n    t = t * 1   # a fresh value, offset 0\n"
         "    return t.as_strided(t.size(), t.stride())\n")
CHANGES = {"view": [POSITIONS], "fresh": [POSITIONS, FRESH], "range": [POSITIONS, RANGES]}

source = open("fastpath.py").read()
for old, new in CHANGES[sys.argv[1]]:
    assert source.count(old) == 1, old
    source = source.replace(old, new)
open("fastpath.py", "w").write(source)
