"""Prints --compile if bench_train's compiled 3-layer row beat the eager one by 10% (its log, call 1), else nothing."""
import ast, sys
rows = [ast.literal_eval(line) for line in open(sys.argv[1]) if line.startswith("{'layers'")]
pick = {r["compiled"]: r["blocks_per_s"] for r in rows
        if r["layers"] == 3 and r["features"] == "cached" and r["loss"] == "chunked" and r["pad_shapes"] == [1, 1]
        and r["group"] == 8}
print("--compile" if pick.get(True, 0) > 1.1 * pick.get(False, float("inf")) else "")
print(f"pick: {pick}", file=sys.stderr)
