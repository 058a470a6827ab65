"""The conformance kit's checker: a port's dump against a case's golden values, stage by stage.

A port runs a case's request on its pair, writes what it computed under the case's names (any subset)
into one safetensors file, and the checker reports, stage by stage, the first position and value that
differ and which pitfall that stage usually means. Where a stage differs, it replays dflash.py with each
mistake ports are known to make at that stage and names those that reproduce the dump's value.

    $ dflash-conformance write                                  # the kit, from dflash.py
    $ dflash-conformance dump-fastpath --case laguna --out d.safetensors   # this project's twin
    $ dflash-conformance check d.safetensors --case laguna
    $ dflash-conformance dump-fastpath --graphs --case high-acceptance --out g.safetensors   # on CUDA
"""
if __name__ == "__main__":   # a Ctrl-C while torch and transformers import ends as the CLI's own: exit 130
    import signal
    import sys
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import sys
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

import dflash
from dflash_reference import loading, scripts
from dflash_reference.conformance import cases

# -----------------------------------------------------------------------------
# Checking a dump


def stage_order(keys) -> list[str]:
    """The keys in the order a decode computes them: by round, then by stage; the whole run's last."""
    order = list(cases.STAGES)
    staged = sorted((k for k in keys if k not in cases.WHOLE_RUN),
                    key=lambda k: (int(k.rsplit(".", 1)[1]), order.index(k.rsplit(".", 1)[0])))
    return staged + [k for k in cases.WHOLE_RUN if k in keys]


def first_difference(got: torch.Tensor, want: torch.Tensor, tolerance: float):
    """None if equal within tolerance, else (index, got, want) of the first element that differs."""
    if got.shape != want.shape:
        return "shape", tuple(got.shape), tuple(want.shape)
    if not want.is_floating_point():
        bad = got != want
    else:
        got, want = got.double(), want.double()
        bad = ~((got - want).abs() <= tolerance * (1 + want.abs()))
    if not bad.any():
        return None
    flat = int(bad.flatten().nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), want.shape)) if want.dim() else ()
    return index, got[index].item(), want[index].item()


def within_ties(ids, logits, tolerance: float):
    """top5_ids (W-1, 5) with each run of ranks whose expected logits lie within twice the logits' tolerance
    of the next sorted by id: near-tied tokens may come in either order in a port that is right."""
    out = ids.clone()
    for row in range(ids.shape[0]):
        start = 0
        for j in range(1, ids.shape[1] + 1):
            if j == ids.shape[1] or logits[row, j - 1] - logits[row, j] > 2 * tolerance * (1 + abs(logits[row, j])):
                out[row, start:j] = ids[row, start:j].sort().values
                start = j
    return out


def check(case_dir: Path, dump: dict, tolerance: float | None = None, diagnose: bool = True) -> dict:
    """Compare a dump with a case: per key 'ok', 'missing' or the first difference; the first stage that
    differs, its pitfall, a note on where it points and (diagnose) the known mistakes that reproduce it. `tolerance` replaces the case's tolerance of every
    float stage (an engine in bf16 needs about 3e-2): |got − want| ≤ tolerance · (1 + |want|), the case's
    float32 values the reference; exact stages stay exact."""
    case_dir = Path(case_dir)
    spec = loading.read_file(case_dir / "case.json", "conformance case")
    expected = load_file(case_dir / "expected.safetensors") | {
        "acceptance_lengths": torch.tensor(spec["acceptance_lengths"])}
    whole_run = {"tokens": spec["tokens"], "acceptance_lengths": {"tolerance": 0, "pitfall": cases.ACCEPTANCE_PITFALL},
                 "round_drafts": {"tolerance": 0, "pitfall": cases.ROUND_DRAFTS_PITFALL}}
    unknown = sorted(set(dump) - set(expected))
    results, first = {}, None
    for key in stage_order(expected):
        stage = key if key in cases.WHOLE_RUN else key.rsplit(".", 1)[0]
        info = whole_run[key] if key in cases.WHOLE_RUN else spec["stages"][stage]
        if key not in dump:
            results[key] = "missing"
            continue
        got, want, r = dump[key], expected[key], key.rsplit(".", 1)[-1]
        tol = info["tolerance"] if tolerance is None or not info["tolerance"] else tolerance
        if stage == "top5_ids" and got.shape == want.shape and f"top5_logits.{r}" in expected:
            logits_tol = spec["stages"]["top5_logits"]["tolerance"] if tolerance is None else tolerance
            got, want = (within_ties(t, expected[f"top5_logits.{r}"].double(), logits_tol) for t in (got, want))
        if stage in ("candidates", "selector_scores") and f"candidates.{r}" in dump:   # compared by candidate id
            by_id = dump[f"candidates.{r}"].argsort(-1)
            got = got.gather(-1, by_id) if got.shape == by_id.shape else got
        if stage in ("acceptance_lengths", "round_drafts") and got.shape[1:] == want.shape[1:] and \
                len(got) != len(want):   # runs of other lengths: the first round where they part
            n = min(len(got), len(want))
            part = next((i for i in range(n) if not torch.equal(got[i], want[i])), n)
            diff = ((part,), *(t[part].tolist() if part < len(t) else "none" for t in (got, want)))
        else:
            diff = first_difference(got, want, tol)
        results[key] = "ok" if diff is None else diff
        earlier_round = first is not None and first["key"] == "round_drafts" and key == "acceptance_lengths" and \
            diff is not None and diff[0] != "shape" and first["difference"][0] != "shape" and \
            diff[0][0] < first["difference"][0][0]   # a round verifies what it drafted: the earlier round first
        if diff is not None and (first is None or earlier_round):
            first = {"key": key, "stage": stage, "difference": diff, "pitfall": info["pitfall"],
                     "note": where_it_points(case_dir, stage, diff, want)}
            if stage in MISTAKES and diagnose:
                first["mistakes"] = known_mistakes(case_dir, spec["request"], key, got, tol)
    compared = [key for key, outcome in results.items() if outcome != "missing"]
    return {"case": spec["case"], "results": results, "first": first, "unknown": unknown, "compared": len(compared),
            "staged": sum(key not in cases.DRAFTER_BLIND for key in compared), "total": len(results)}


def where_it_points(case_dir: Path, stage: str, diff, want) -> str | None:
    """For a features column: which capture and target layer it holds; for a round: which one."""
    index = diff[0]
    if stage == "features" and index != "shape" and len(index) == 2:
        raw = loading.read_file(case_dir / "drafter" / "config.json", "drafter config")
        layers = loading.read_file(case_dir / "target" / "config.json", "target config")["num_hidden_layers"]
        cfg = loading.load_draft_config(raw, layers, want.shape[-1])
        j = index[1] // cfg.hidden_size
        layer = cfg.target_layer_ids[j]
        return (f"column {index[1]} is capture {j} of {len(cfg.target_layer_ids)}: the output of target layer "
                f"{layer} (0-based; HF hidden_states[{layer + 1}]), row {index[0]} its position")
    if stage == "acceptance_lengths" and index != "shape":
        return f"round {index[0] + 1} is the first whose acceptance length differs"
    if stage == "round_drafts" and index != "shape":
        return f"round {index[0] + 1} is the first whose drafts differ" + \
            (f" (at draft {index[1] + 1})" if len(index) == 2 else "")
    return None


# -----------------------------------------------------------------------------
# Known mistakes: where a stage differs, dflash.py is replayed with each mistake a port is known to make
# there, and those whose value at the differing key equals the dump's are named

def set_layers(drafter, only=lambda layer: True, **attributes) -> list:
    for layer in drafter.layers:
        if only(layer):
            for name, value in attributes.items():
                setattr(layer, name, value)
    return []


def block_shifted(offset: int):
    """dflash.draft_block with the block at positions start + offset …: its queries' and keys' RoPE and mask."""
    def draft_block(drafter, ctx, block_embeds):
        positions = torch.arange(ctx.length, ctx.length + len(block_embeds)) + offset                   # (W,)
        key_positions = torch.cat([torch.arange(ctx.length), positions])                                 # (S+W,)
        masks = [dflash.attention_mask(positions, key_positions, layer.causal, layer.window) for layer in drafter.layers]
        return drafter(block_embeds, drafter.rope_tables(positions, block_embeds.dtype),
                       list(zip(ctx.keys, ctx.values)), masks, block=len(block_embeds))
    return lambda drafter: [mock.patch.object(dflash, "draft_block", draft_block)]


def one_sided_visible_at(delta, causal: bool, window):
    visible = delta >= 0 if causal else torch.ones_like(delta, dtype=torch.bool)
    return visible if window is None else visible & (delta < window)


def first_rope_base(drafter) -> list:
    for layer in drafter.layers:
        layer.self_attn.rope_theta = drafter.config.rope_thetas[0]
    drafter.config.rope_thetas = [drafter.config.rope_thetas[0]] * len(drafter.layers)
    return []


def bonus_row_early(drafter) -> list:
    """After each verification, the context takes the row past the accepted ones too: the bonus's own
    hidden state, a round before the bonus is verified."""
    real_forward, real_project, verified = dflash.target_forward, dflash.Drafter.project_context, {}

    def target_forward(*args):
        logits, verified["features"] = real_forward(*args)
        return logits, verified["features"]

    def project_context(self, features):   # features: the first a+1 of the verified rows, or the prompt's
        rows = verified["features"]
        return real_project(self, rows[:len(features) + 1] if len(features) < len(rows) else features)
    return [mock.patch.object(dflash, "target_forward", target_forward),
            mock.patch.object(dflash.Drafter, "project_context", project_context)]


def without(module_name: str):
    return lambda drafter: setattr(drafter, module_name, torch.nn.Identity()) or []


# stage -> {the mistake: (whether a drafter can make it, the mistake made on a fresh pair -> patches to enter)}
MISTAKES = {
    "hidden": {
        "a causal mask over the block (no row sees a later one)": (
            lambda d: not all(layer.causal for layer in d.layers), lambda d: set_layers(d, causal=True)),
        "the causality override ignored (its sliding layers causal, as without dflash_config.causal false)": (
            lambda d: any(layer.window and not layer.causal for layer in d.layers) and
            any(layer.window is None for layer in d.layers),
            lambda d: set_layers(d, lambda layer: layer.window is not None, causal=True)),
        "no causal mask (the rows of a causal layer see later rows)": (
            lambda d: any(layer.causal for layer in d.layers), lambda d: set_layers(d, causal=False)),
        "a sliding layer as full attention (no window, no causal mask)": (
            lambda d: any(layer.window and layer.causal for layer in d.layers),
            lambda d: set_layers(d, lambda layer: layer.window is not None, causal=False, window=None)),
        "the block one position late (its rows at start + 1 …)": (lambda d: True, block_shifted(1)),
        "the block one position early (its rows at start − 1 …)": (lambda d: True, block_shifted(-1)),
        "no sliding window": (lambda d: any(layer.window for layer in d.layers), lambda d: set_layers(d, window=None)),
        "the window on one side only (a bidirectional sliding layer)": (
            lambda d: any(layer.window and not layer.causal for layer in d.layers),
            lambda d: [mock.patch.object(dflash, "visible_at", one_sided_visible_at)]),
        "the first layer's RoPE base in every layer": (lambda d: len(set(d.config.rope_thetas)) > 1, first_rope_base),
        "no final norm": (lambda d: True, without("norm")),
    },
    "context": {
        "no hidden_norm after fc": (lambda d: True, without("hidden_norm")),
        "no per-capture norms (aux_hidden_norms)": (lambda d: d.aux_hidden_norms is not None,
                                                    lambda d: setattr(d, "aux_hidden_norms", None) or []),
        "the bonus's hidden state in the context a round early (a row past the accepted drafts)": (
            lambda d: True, bonus_row_early),
    },
}


def known_mistakes(case_dir: Path, request: dict, key: str, got, tolerance: float) -> tuple[list, list]:
    """Replay the case with each known mistake at key's stage, up to key -> (the mistakes whose value there
    equals got within tolerance, every mistake replayed)."""
    known, probe = MISTAKES[key.rsplit(".", 1)[0]], cases.load_case(case_dir)[1]
    found, tried = [], [mistake for mistake, (applies, _) in known.items() if applies(probe)]
    for mistake in tried:   # each on a fresh pair: a mistake changes the drafter it is made on
        target, drafter, _ = cases.load_case(case_dir)
        with ExitStack() as patches:
            for patch in known[mistake][1](drafter):
                patches.enter_context(patch)
            try:
                cases.record_reference(target, drafter, request, stop_at=key)
                continue   # the replay never reached key
            except cases.Recorded as replayed:
                if first_difference(got, replayed.value, tolerance) is None:
                    found.append(mistake)
    return found, tried


def report(result: dict) -> str:
    lines = [f"case {result['case']}"]
    for key, outcome in result["results"].items():
        if outcome in ("ok", "missing"):
            lines.append(f"  {key:<20} {outcome}")
        else:
            index, got, want = outcome
            what = f"shape {got}, expected {want}" if index == "shape" else \
                f"at {list(index)}: {got!r}, expected {want!r}"
            lines.append(f"  {key:<20} DIFFERS {what}")
    if result["unknown"]:
        lines.append(f"  not in the kit (ignored): {result['unknown']}")
    first = result["first"]
    lines.append(f"compared {result['compared']} of the case's {result['total']} values")
    if not result["compared"]:
        lines.append("nothing compared: the dump holds none of the case's keys ('<stage>.<round>', tokens, "
                     "acceptance_lengths)")
    elif first is not None:
        lines.append(f"first difference: {first['key']} ({first['stage']}); usually {first['pitfall']}")
        if first["note"]:
            lines.append(f"  {first['note']}")
        if "mistakes" in first:
            found, tried = first["mistakes"]
            lines += [f"  {first['key']} is what dflash.py computes with {m}" for m in found] or \
                [f"  no known mistake reproduces {first['key']} (replayed: {'; '.join(tried)})"]
    elif not result["staged"]:
        lines.append("no verdict: only tokens and acceptance_lengths were compared, and the target's verification "
                     "keeps the tokens right whatever a drafter bug drafts; dump the stages ('<stage>.<round>') "
                     "or round_drafts")
    else:
        lines.append("conforms: every stage given matches")
    return "\n".join(lines)


def verdict(result: dict) -> bool:
    """Whether a dump conforms: something of the drafter's compared, and nothing differs."""
    return result["first"] is None and result["staged"] > 0


# -----------------------------------------------------------------------------
# CLI

def case_dir(name: str, kit: Path) -> Path:
    dflash.require(Path(kit).is_dir(), f"--kit '{kit}': no such directory")
    directory = Path(kit) / name
    dflash.require("/" not in name and (directory / "case.json").is_file(), f"--case = {name!r} is not in {kit} "
                   f"(cases: {', '.join(sorted(p.name for p in Path(kit).iterdir() if (p / 'case.json').is_file()))})")
    return directory


def main(argv=None):
    p = scripts.parser("DFlash conformance kit: golden stage values and a checker.")
    p.add_argument("--kit", default=str(cases.KIT), help="the kit's dir (default: conformance/ beside this file)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("write", help="write every case from dflash.py")
    s = sub.add_parser("dump-fastpath", help="run fastpath.py on a case and write its dump")
    s.add_argument("--case", required=True)
    s.add_argument("--out", required=True, help="the dump to write (.safetensors)")
    s.add_argument("--graphs", action="store_true", help="run on CUDA through the captured graphs: a dump of the "
                   "whole run's values (round_drafts, acceptance_lengths, tokens), the stages being inside the graphs")
    s = sub.add_parser("check", help="compare an engine's dump with a case, stage by stage")
    s.add_argument("dump", help="a .safetensors file of '<stage>.<round>' tensors (any subset)")
    s.add_argument("--case", required=True)
    s.add_argument("--tolerance", type=float, help="one tolerance for every float stage, against the case's float32 "
                   "values (about 3e-2 for an engine in bf16; default: each stage's own, for float32)")
    args = p.parse_args(argv)
    scripts.quiet_transformers()
    torch.set_num_threads(1)   # tiny models: determinism over speed
    dflash.require(not Path(args.kit).exists() or Path(args.kit).is_dir(), f"--kit '{args.kit}' is a file")
    if args.command == "dump-fastpath":   # checked before fastpath runs
        dflash.require(not Path(args.out).is_dir() and Path(args.out).resolve().parent.is_dir(),
                       f"--out '{args.out}' must name a file in a directory that exists")
    if args.command == "write":
        cases.write_kit(Path(args.kit))
        return print(f"wrote {len(cases.CASES)} cases to {args.kit}")
    directory = case_dir(args.case, Path(args.kit))
    if args.command == "dump-fastpath":
        spec = loading.read_file(directory / "case.json", "conformance case")
        if args.graphs:
            save_file(cases.record_graphed(directory, spec["request"]), args.out)
        else:
            target, drafter, spec = cases.load_case(directory)
            save_file(cases.record_fastpath(target, drafter, spec["request"]), args.out)
        return print(f"wrote {args.out}")
    dflash.require(args.tolerance is None or 0 < args.tolerance < 1, f"--tolerance = {args.tolerance} must be in (0, 1)")
    dump = loading.read_file(Path(args.dump), "dump", load_file)
    result = check(directory, dump, args.tolerance)
    print(report(result))
    if not verdict(result):
        sys.exit(1)



def command():
    """`dflash-conformance`: main, with bad input as one `error:` line (exit 2) and Ctrl-C as exit 130."""
    scripts.run(main)


if __name__ == "__main__":
    command()
