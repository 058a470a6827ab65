"""DFlash speculative decoding beside its reference (dflash.py) and fast twin (fastpath.py)."""
