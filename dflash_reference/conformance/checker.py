"""The conformance kit's checker: a port's dump against a case's golden values, stage by stage.

A port runs a case's request on its pair, writes what it computed under the case's names (any subset)
into one safetensors file, and the checker reports, stage by stage, what differs (the rows and columns,
compactly) and which pitfall that stage usually means. Where a stage differs, it replays dflash.py with
each mistake ports are known to make there and names those that reproduce the dump's value. A dump in
bf16 is held to the case's bf16 bands, as far as the case's choices stay out of bf16's reach; a served
case's dump holds each request's values under 'request.<i>.'.

    $ dflash-conformance write                                  # the kit, from dflash.py
    $ dflash-conformance dump-fastpath --case laguna --out d.safetensors   # this project's twin
    $ dflash-conformance check d.safetensors --case laguna
    $ dflash-conformance dump-fastpath --graphs --case high-acceptance --out g.safetensors   # on CUDA
    $ dflash-conformance costs --out costs.json      # τ with each of the field's porting bugs, shipped pair
"""
if __name__ == "__main__":   # a Ctrl-C while torch and transformers import ends as the CLI's own: exit 130
    import signal
    import sys
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import json
import sys
import time
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import dflash
import fastpath
from dflash_reference import loading, scripts
from dflash_reference.conformance import cases

# -----------------------------------------------------------------------------
# Checking a dump

def first_difference(got: torch.Tensor, want: torch.Tensor, tolerance: float):
    """None if equal within tolerance, else (index, got, want) of the first element that differs."""
    if got.shape != want.shape:
        return "shape", tuple(got.shape), tuple(want.shape)
    bad = differing(got, want, tolerance)
    if not bad.any():
        return None
    flat = int(bad.flatten().nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), want.shape)) if want.dim() else ()
    return index, got[index].item(), want[index].item()


def differing(got, want, tolerance: float):
    """Where |got − want| > tolerance · (1 + |want|) (exact for ids and tolerance 0), as a bool tensor."""
    if not want.is_floating_point():
        return got != want
    got, want = got.double(), want.double()
    return ~((got - want).abs() <= tolerance * (1 + want.abs()))


def compact(mask) -> str:
    """The true places of a bool vector as ranges: 'all 8', or '1-3, 5 of 8'."""
    where, n = mask.nonzero()[:, 0].tolist(), len(mask)
    if len(where) == n:
        return f"all {n}"
    runs, start = [], None
    for i, w in enumerate(where):
        if start is None:
            start = w
        if i + 1 == len(where) or where[i + 1] != w + 1:
            runs.append(f"{start}" if start == w else f"{start}-{w}")
            start = None
    return f"{', '.join(runs)} of {n}"


def spread(got, want, tolerance: float) -> str:
    """Which rows (positions) and columns differ, compactly, by how much, and what that pattern usually is:
    a small drift over every row and column is rounding, whole rows a position or mask, a block of columns
    a head, a capture or a layer."""
    if got.shape != want.shape or want.dim() == 0:
        return ""
    bad = differing(got, want, tolerance)
    if want.dim() == 1:
        return f"elements {compact(bad)}"
    rows, cols = bad.flatten(0, -3).any(0).any(-1) if want.dim() > 2 else bad.any(-1), bad.flatten(0, -2).any(0)
    text = f"rows {compact(rows)}, columns {compact(cols)}"
    if not want.is_floating_point() or not tolerance:
        return text
    times, blocks = cases.deviation(got, want) / tolerance, compact(cols).count(",") + 1   # runs of columns
    if times < 4 and rows.all() and (cols.all() or blocks > 2):
        kind = "rounding beyond the case's band: a reduction, norm or softmax below float32?"
    elif rows.all() and cols.all():
        kind = "every row and column: the stage's computation itself"
    elif cols.all():
        kind = "whole rows: a position, a mask or rows read shifted"
    elif rows.all() and blocks <= 2:
        kind = "a block of columns: a head, a capture or a layer"
    else:
        kind = "some rows, some columns"
    return f"{text}, up to {times:.1f}× the tolerance ({kind})"


def dump_dtype(dump: dict) -> str:
    """bfloat16 where any float value of the dump is bf16 or fp16, else float32."""
    low = any(t.dtype in (torch.bfloat16, torch.float16) for t in dump.values())
    return "bfloat16" if low else "float32"


def check(case_dir: Path, dump: dict, tolerance: float | None = None, diagnose: bool = True,
          dtype: str | None = None) -> dict:
    """Compare a dump with a case: per key 'ok', 'missing', 'beyond bf16' or the first difference; the first
    key that differs, its pitfall, where it points, which rows and columns differ, and (diagnose) the known
    mistakes that reproduce it. dtype (default: the dump's) bfloat16 holds float stages to the case's bf16
    bands and compares only the keys before the first one bf16 can move; `tolerance` replaces every float
    stage's own: |got − want| ≤ tolerance · (1 + |want|), the case's float32 values the reference."""
    case_dir = Path(case_dir)
    spec = loading.read_file(case_dir / "case.json", "conformance case")
    expected, dtype = load_file(case_dir / "expected.safetensors"), dtype or dump_dtype(dump)
    dflash.require(dtype == "float32" or spec.get("bf16") is not None, f"conformance: case {spec['case']} is float32 "
                   f"only: bf16 moves its choices before any drafter stage; check a bf16 dump on one of "
                   f"{', '.join(n for n in cases.CASES if n in bf16_cases(case_dir.parent))}")
    if "requests" not in spec:
        return check_request(case_dir, spec, spec["request"], expected, spec["acceptance_lengths"], dump, tolerance,
                             diagnose, dtype, spec["bf16"]["until"] if dtype == "bfloat16" else None)
    parts = []
    for i, request in enumerate(spec["requests"]):
        prefix = f"request.{i}."
        mine = {k[len(prefix):]: v for k, v in expected.items() if k.startswith(prefix)}
        given = {k[len(prefix):]: v for k, v in dump.items() if k.startswith(prefix)}
        until = spec["bf16"]["until"][i] if dtype == "bfloat16" else None
        parts.append(check_request(case_dir, spec, request, mine, spec["outcomes"][i]["acceptance_lengths"], given,
                                   tolerance, diagnose, dtype, until, prefix))
    first = next((part["first"] for part in parts if part["first"] is not None), None)
    if first is not None and diagnose and first["key"].startswith("request."):
        first["mistakes"] = served_mistakes(case_dir, spec, first)
    known = {key for part in parts for key in part["results"]}
    return {"case": spec["case"], "dtype": dtype, "results": {k: v for part in parts for k, v in part["results"].items()},
            "first": first, "unknown": sorted(set(dump) - known), "spreads": {k: v for p in parts for k, v in p["spreads"].items()},
            "compared": sum(p["compared"] for p in parts), "total": sum(p["total"] for p in parts),
            "staged": min(p["staged"] for p in parts), "until": None}


def bf16_cases(kit: Path) -> list[str]:
    """The cases of a kit that a bf16 dump can be checked on."""
    return [p.name for p in sorted(Path(kit).iterdir()) if (p / "case.json").is_file() and
            loading.read_file(p / "case.json", "conformance case").get("bf16") is not None]


def check_request(case_dir: Path, spec: dict, request: dict, expected: dict, lengths: list, dump: dict, tolerance,
                  diagnose: bool, dtype: str, until: str | None, prefix: str = "") -> dict:
    """check for one request of a case: its expected values and acceptance lengths; keys named with prefix."""
    expected = expected | {"acceptance_lengths": torch.tensor(lengths)}
    whole_run = {"tokens": spec["tokens"], "acceptance_lengths": {"tolerance": 0, "pitfall": cases.ACCEPTANCE_PITFALL},
                 "round_drafts": {"tolerance": 0, "pitfall": cases.ROUND_DRAFTS_PITFALL}}
    bands = spec["bf16"]["tolerances"] if dtype == "bfloat16" else {}
    order = cases.stage_order(expected)
    beyond = set(order[order.index(until):]) if until else set()
    results, spreads, first = {}, {}, None
    for key in order:
        stage = cases.stage_of(key)
        info = whole_run[key] if key in cases.WHOLE_RUN else spec["stages"][stage]
        if key not in dump:
            results[prefix + key] = "missing"
            continue
        if key in beyond:
            results[prefix + key] = "beyond bf16"
            continue
        got, want, r = dump[key], expected[key], key.rsplit(".", 1)[-1]
        same_order = lambda replayed: replayed   # a replay's value as the comparison orders it
        own = lambda name: bands.get(name, spec["stages"][name]["tolerance"]) if tolerance is None else tolerance
        tol = own(stage) if info["tolerance"] else 0   # exact stages stay exact
        if stage == "top5_ids" and got.shape == want.shape and f"top5_logits.{r}" in expected:
            logits = expected[f"top5_logits.{r}"].double()
            same_order = lambda ids, logits=logits, tol=own("top5_logits"): cases.within_ties(ids, logits, tol)
            got, want = same_order(got), same_order(want)
        if stage in ("candidates", "selector_scores") and f"candidates.{r}" in dump:   # compared by candidate id
            by_id = dump[f"candidates.{r}"].argsort(-1)
            got = got.gather(-1, by_id) if got.shape == by_id.shape else got
        if stage in ("acceptance_lengths", "round_drafts") and got.shape[1:] == want.shape[1:] and \
                len(got) != len(want):   # runs of other lengths: the first round where they part
            n = min(len(got), len(want))
            part = next((i for i in range(n) if not torch.equal(got[i], want[i])), n)
            diff = ((part,), *(t[part].tolist() if part < len(t) else "none" for t in (got, want)))
        else:
            diff = first_difference(got.to(want.dtype) if want.is_floating_point() else got, want, tol)
        results[prefix + key] = "ok" if diff is None else diff
        if diff is not None:
            spreads[prefix + key] = spread(got, want, tol)
        earlier_round = first is not None and first["key"] == prefix + "round_drafts" and \
            key == "acceptance_lengths" and diff is not None and diff[0] != "shape" and \
            first["difference"][0] != "shape" and diff[0][0] < first["difference"][0][0]   # the earlier round first
        if diff is not None and (first is None or earlier_round):
            first = {"key": prefix + key, "stage": stage, "difference": diff, "pitfall": info["pitfall"],
                     "note": where_it_points(case_dir, stage, diff, want), "spread": spreads[prefix + key],
                     "got": got, "tolerance": tol, "same_order": same_order}
            if diagnose and any(stage in m.stages for m in MISTAKES.values()):
                first["mistakes"] = known_mistakes(case_dir, request, key, got, tol, same_order)
    compared = [key for key, outcome in results.items() if outcome not in ("missing", "beyond bf16")]
    return {"case": spec["case"], "dtype": dtype, "results": results, "first": first, "spreads": spreads,
            "unknown": sorted(set(dump) - set(expected)), "compared": len(compared), "until": until,
            "staged": sum(key[len(prefix):] not in cases.DRAFTER_BLIND for key in compared), "total": len(results)}


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

@dataclass(frozen=True)
class Mistake:
    stages: tuple     # where it can first show
    applies: object   # (drafter, target, request) -> whether this pair and request can show it
    make: object      # (drafter, target, request) -> patches to enter; made on a fresh pair, which it may change


BLOCK, READOUT = ("conv_in", "conv_out", "hidden"), ("top5_logits", "top5_ids", "candidates", "selector_scores", "drafts")
always = lambda d, t, r: True
windowed = lambda d, t, r: any(layer.window for layer in d.layers)
convolved = lambda d, t, r: d.layers[0].attention_conv is not None
selected = lambda d, t, r: d.candidate_selector is not None


def set_layers(drafter, only=lambda layer: True, **attributes) -> list:
    for layer in drafter.layers:
        if only(layer):
            for name, value in attributes.items():
                setattr(layer, name, value)
    return []


def block_at(offset):
    """dflash.draft_block with the block's rows at start + offset(drafter, S): their queries', their own keys'
    RoPE and the masks; the context keeps its positions."""
    def make(drafter, target, request):
        def draft_block(drafter_, ctx, block_embeds):
            positions = torch.arange(ctx.length, ctx.length + len(block_embeds)) + offset(drafter_, ctx.length)   # (W,)
            key_positions = torch.cat([torch.arange(ctx.length), positions])                           # (S+W,)
            masks = [dflash.attention_mask(positions, key_positions, layer.causal, layer.window)
                     for layer in drafter_.layers]
            return drafter_(block_embeds, drafter_.rope_tables(positions, block_embeds.dtype),
                            list(zip(ctx.keys, ctx.values)), masks, block=len(block_embeds))
        return [mock.patch.object(dflash, "draft_block", draft_block)]
    return make


def one_sided_visible_at(delta, causal: bool, window):
    visible = delta >= 0 if causal else torch.ones_like(delta, dtype=torch.bool)
    return visible if window is None else visible & (delta < window)


def rope_base_everywhere(theta_of):
    """Every layer's RoPE at theta_of(drafter, target)."""
    def make(drafter, target, request):
        theta = theta_of(drafter, target)
        for layer in drafter.layers:
            layer.self_attn.rope_theta = theta
        drafter.config.rope_thetas = [theta] * len(drafter.layers)
        return []
    return make


def target_theta(drafter, target) -> float:
    """The target's RoPE base (its full-attention layers' where they are keyed by layer type)."""
    cfg = target.config.get_text_config()
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("full_attention", params).get("rope_theta") or cfg.rope_theta)


def bonus_row_early(drafter, target, request) -> list:
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
    return lambda drafter, target, request: setattr(drafter, module_name, None if module_name ==
                                                    "candidate_selector" else torch.nn.Identity()) or []


def moved(y, shift: int):
    """y[..., t + shift, :] along a block's rows (..., B, H), zeros past either end."""
    if shift <= 0:
        return F.pad(y, (0, 0, -shift, 0))[..., :y.shape[-2], :]
    return F.pad(y, (0, 0, 0, shift))[..., shift:, :]


def convolution(rows_at: int = -1, taps_at: int = 0):
    """dflash.convolve with its rows and taps read elsewhere: Σ_o (base[o] + taps[t + taps_at·o, o]) · x[t + rows_at·o]."""
    def convolve(x, taps, base, block: int):
        g = x.shape[-1] // taps.shape[-1]
        rows = x.unflatten(-2, (-1, block))                                             # (..., W/B, B, H)
        taps = taps.repeat_interleave(g, -1).unflatten(-3, (-1, block))                 # (..., W/B, B, C, H)
        return sum((base[o].to(x.dtype) + moved(taps[..., o, :], taps_at * o)) * moved(rows, rows_at * o)
                   for o in range(base.shape[0])).flatten(-3, -2)                       # (..., W, H)
    return convolve


def conv_made(convolve=None, pre=True, post=True, swapped=False, post_taps_from_output=False):
    """DFlash2's GroupedDynamicCausalConv.forward with one of a port's mistakes."""
    def forward(conv, a, sublayer, block):
        run = convolve or dflash.convolve
        split = lambda y: conv.kernel_projection(y).unflatten(-1, (2, -1, conv.groups))   # (..., W, 2, C, G)
        taps, base = split(a), conv.base_kernel.flip(0) if swapped else conv.base_kernel
        z = sublayer(run(a, taps[..., 0, :, :], base[0], block) if pre else a)
        taps = split(z) if post_taps_from_output else taps
        return run(z, taps[..., 1, :, :], base[1], block) if post else z
    return lambda drafter, target, request: [mock.patch.object(dflash.GroupedDynamicCausalConv, "forward", forward)]


def conv_over_residual(drafter, target, request) -> list:
    """The convolutions run over the residual stream (the layer's input, and its input plus the attention's
    output), their taps still from the normed input."""
    residual = {}

    def layer_forward(layer, x, tables, context, mask, block, attend=dflash.attend):
        attention = lambda u: layer.self_attn(u, tables[layer.self_attn.rope_theta], context, mask, attend)
        residual["x"] = x
        x = x + dflash.around(layer.attention_conv, layer.input_layernorm(x), attention, block)
        residual["x"] = x
        return x + dflash.around(layer.mlp_conv, layer.post_attention_layernorm(x), layer.mlp, block)

    def forward(conv, a, sublayer, block):
        taps = conv.kernel_projection(a).unflatten(-1, (2, -1, conv.groups))
        z = sublayer(dflash.convolve(residual["x"], taps[..., 0, :, :], conv.base_kernel[0], block))
        return dflash.convolve(z, taps[..., 1, :, :], conv.base_kernel[1], block)
    return [mock.patch.object(dflash.DraftLayer, "forward", layer_forward),
            mock.patch.object(dflash.GroupedDynamicCausalConv, "forward", forward)]


def embeddings_unscaled(drafter, target, request) -> list:
    return [mock.patch.object(dflash, "embed_block", lambda drafter_, block, target_: F.embedding(
        block, target_.get_input_embeddings().weight))]


def rows_from_the_anchor(drafter, target, request) -> list:
    """The draft rows read one early: row j's draft from the block's row j − 1, the anchor's for the first."""
    real = dflash.draft_block
    return [mock.patch.object(dflash, "draft_block", lambda *args: (lambda h: torch.cat([h[:1], h[:-1]]))(real(*args)))]


def unshared_head(drafter, target, request) -> list:
    """The target's LM head not shared with the drafter (a padded vocabulary read as the drafter's own): the
    draft logits come from an unset head, all zero."""
    return [mock.patch.object(dflash.Drafter, "draft_logits", lambda self, hidden, head: hidden.new_zeros(
        *hidden.shape[:-1], head.weight.shape[0]))]


def unscaled_candidates(drafter, target, request) -> list:
    """The selector's candidates and unary scores taken from the head's logits before output_multiplier and
    softcapping (the draft logits' own readout keeps them)."""
    def read_drafts(drafter_, hidden, target_, anchor, sampling, uniforms):
        logits = target_.get_output_embeddings()(hidden)                                # (N, V), unscaled
        drafts, candidates, q = drafter_.candidate_selector(hidden, logits, anchor, sampling.temperature, uniforms)
        return drafts, None if q is None else torch.zeros_like(logits, dtype=q.dtype).scatter(-1, candidates, q)
    return [mock.patch.object(dflash, "read_drafts", read_drafts)]


def walk_made(own_argmax: bool = False, from_mask: bool = False):
    """CandidateSelector.forward with the wrong predecessor: each row's own argmax for the token picked before,
    or the mask token before the first draft instead of the bonus."""
    def make(drafter, target, request):
        mask_id = drafter.config.mask_token_id

        def forward(selector, hidden, logits, anchor, temperature, uniforms):
            unary, candidates = logits.topk(selector.top_k, dim=-1)                    # (N, k)
            u = selector.hidden_projection(hidden)                                      # (N, r)
            previous, drafts, qs = (torch.full_like(anchor, mask_id) if from_mask else anchor).reshape(1), [], []
            for t in range(len(hidden)):
                previous = logits[t].argmax().reshape(1) if own_argmax else previous
                scores = selector.scores(unary[t], candidates[t], previous, u[t])      # (k,)
                if temperature == 0:
                    pick = scores.argmax().reshape(1)
                else:
                    qs.append((scores.to(torch.promote_types(scores.dtype, torch.float32)) / temperature).softmax(-1))
                    pick = dflash.sample(qs[-1], uniforms[t]).reshape(1)
                previous = candidates[t][pick]
                drafts.append(previous)
            return torch.cat(drafts), candidates, torch.stack(qs) if qs else None
        return [mock.patch.object(dflash.CandidateSelector, "forward", forward)]
    return make


def codebooks_swapped(drafter, target, request) -> list:
    s = drafter.candidate_selector
    s.predecessor_codebook, s.successor_codebook = s.successor_codebook, s.predecessor_codebook
    return []


def one_hot_verification(drafter, target, request) -> list:
    real = dflash.verify
    return [mock.patch.object(dflash, "verify", lambda drafts, logits, sampling, uniforms, draft_probs=None:
                              real(drafts, logits, sampling, uniforms, None))]


def mask_tokens_dropped(drafter, target, request) -> list:
    real, mask = cases.whole_run_values, drafter.config.mask_token_id

    def whole_run_values(gen):
        values = real(gen)
        return values | {"tokens": values["tokens"][values["tokens"] != mask]}
    return [mock.patch.object(cases, "whole_run_values", whole_run_values)]


def layer_one_off(drafter, target, request) -> list:
    drafter.config.target_layer_ids = [i + 1 for i in drafter.config.target_layer_ids]
    return []


# the mistake -> where it first shows, whether a pair can show it, the mistake made on a fresh pair
MISTAKES = {
    "a causal mask over the block (no row sees a later one)": Mistake(
        BLOCK, lambda d, t, r: not all(layer.causal for layer in d.layers), lambda d, t, r: set_layers(d, causal=True)),
    "the causality override ignored (its sliding layers causal, as without dflash_config.causal false)": Mistake(
        BLOCK, lambda d, t, r: any(layer.window and not layer.causal for layer in d.layers) and
        any(layer.window is None for layer in d.layers),
        lambda d, t, r: set_layers(d, lambda layer: layer.window is not None, causal=True)),
    "no causal mask (the rows of a causal layer see later rows)": Mistake(
        BLOCK, lambda d, t, r: any(layer.causal for layer in d.layers), lambda d, t, r: set_layers(d, causal=False)),
    "a sliding layer as full attention (no window, no causal mask)": Mistake(
        BLOCK, lambda d, t, r: any(layer.window and layer.causal for layer in d.layers),
        lambda d, t, r: set_layers(d, lambda layer: layer.window is not None, causal=False, window=None)),
    "the block one position late (its rows at start + 1 …)": Mistake(BLOCK, always, block_at(lambda d, S: 1)),
    "the block one position early (its rows at start − 1 …)": Mistake(BLOCK, always, block_at(lambda d, S: -1)),
    "positions counted from a clipped window (the block at S − max(0, S − window), the context at its own)": Mistake(
        BLOCK, windowed, block_at(lambda d, S: -max(0, S - max(w for w in d.config.windows if w)))),
    "no sliding window": Mistake(BLOCK, windowed, lambda d, t, r: set_layers(d, window=None)),
    "the window on one side only (a bidirectional sliding layer)": Mistake(
        BLOCK, lambda d, t, r: any(layer.window and not layer.causal for layer in d.layers),
        lambda d, t, r: [mock.patch.object(dflash, "visible_at", one_sided_visible_at)]),
    "the first layer's RoPE base in every layer": Mistake(
        BLOCK, lambda d, t, r: len(set(d.config.rope_thetas)) > 1, rope_base_everywhere(lambda d, t: d.config.rope_thetas[0])),
    "the target's RoPE base for the drafter's (rope_theta read from the target's config)": Mistake(
        ("ctx_keys",) + BLOCK, lambda d, t, r: any(theta != target_theta(d, t) for theta in d.config.rope_thetas),
        rope_base_everywhere(target_theta)),
    "no final norm": Mistake(BLOCK, always, without("norm")),
    "the block's embeddings unscaled (input_embedding_scale ignored)": Mistake(
        BLOCK, lambda d, t, r: d.config.input_embedding_scale != 1, embeddings_unscaled),
    "a convolution's taps reading a later row (x[t + o] for x[t − o])": Mistake(
        BLOCK, convolved, conv_made(convolve=convolution(rows_at=1))),
    "the dynamic taps indexed at the source row t − o, not the output row t": Mistake(
        BLOCK, convolved, conv_made(convolve=convolution(taps_at=-1))),
    "base_kernel's halves swapped (the taps after the sublayer used before it)": Mistake(
        BLOCK, convolved, conv_made(swapped=True)),
    "the convolution before each sublayer skipped": Mistake(BLOCK, convolved, conv_made(pre=False)),
    "the convolution after each sublayer skipped": Mistake(BLOCK, convolved, conv_made(post=False)),
    "the second convolution's taps from the sublayer's output, not its normed input": Mistake(
        BLOCK, convolved, conv_made(post_taps_from_output=True)),
    "the convolutions run over the residual stream, not the normed input": Mistake(BLOCK, convolved, conv_over_residual),
    "every capture one target layer deeper (HF hidden_states[i + 2])": Mistake(
        ("features",), lambda d, t, r: max(d.config.target_layer_ids) + 1 < t.config.get_text_config().num_hidden_layers,
        layer_one_off),
    "no hidden_norm after fc": Mistake(("context",), always, without("hidden_norm")),
    "no per-capture norms (aux_hidden_norms)": Mistake(
        ("context",), lambda d, t, r: d.aux_hidden_norms is not None,
        lambda d, t, r: setattr(d, "aux_hidden_norms", None) or []),
    "the bonus's hidden state in the context a round early (a row past the accepted drafts)": Mistake(
        ("context",), always, bonus_row_early),
    "the draft rows read before the final norm (by the head and the selector)": Mistake(READOUT, always, without("norm")),
    "the draft rows read one early, from the anchor's (rows 0..k−1 for 1..k)": Mistake(READOUT, always, rows_from_the_anchor),
    "the target's LM head not shared (a padded vocabulary read as the drafter's own): draft logits from an unset head":
        Mistake(READOUT, always, unshared_head),
    "the selector's candidates taken before output_multiplier and softcapping": Mistake(
        READOUT, lambda d, t, r: selected(d, t, r) and (d.config.output_multiplier != 1 or
                                                         d.config.final_logit_softcapping is not None), unscaled_candidates),
    "the selector's pair term with each row's own argmax for the token picked before": Mistake(
        READOUT, selected, walk_made(own_argmax=True)),
    "the walk not seeded with the bonus (the mask token before the first draft)": Mistake(
        READOUT, selected, walk_made(from_mask=True)),
    "the predecessor and successor codebooks swapped": Mistake(READOUT, selected, codebooks_swapped),
    "a DFlash2 drafter run without its selector (each row's argmax drafted)": Mistake(
        READOUT, selected, without("candidate_selector")),
    "DFlash2's drafts verified as if proposed one-hot (accepted with p(d), not min(1, p/q))": Mistake(
        ("accepted", "tokens", "acceptance_lengths", "round_drafts") + BLOCK,   # or the next round's, by its bonus
        lambda d, t, r: selected(d, t, r) and r["temperature"] > 0, one_hot_verification),
    "tokens equal to the mask id dropped from the output, as if padding": Mistake(("tokens",), always, mask_tokens_dropped),
}


def known_mistakes(case_dir: Path, request: dict, key: str, got, tolerance: float,
                   same_order=lambda value: value) -> tuple[list, list]:
    """Replay the request with each known mistake that can first show at key's stage, up to key -> (the
    mistakes whose value there, ordered as the comparison orders it (same_order: ids by candidate, near-tied
    ranks by id), equals got within tolerance, every mistake replayed)."""
    stage = cases.stage_of(key)
    target, probe, _ = cases.load_case(case_dir)
    tried = [name for name, m in MISTAKES.items() if stage in m.stages and m.applies(probe, target, request)]
    found = []
    for name in tried:   # each on a fresh pair: a mistake changes the drafter it is made on
        target, drafter, _ = cases.load_case(case_dir)
        with ExitStack() as patches:
            for patch in MISTAKES[name].make(drafter, target, request):
                patches.enter_context(patch)
            replayed = replay(target, drafter, request, key)
        if replayed is not None and first_difference(got.to(replayed.dtype) if replayed.is_floating_point() else got,
                                                     same_order(replayed), tolerance) is None:
            found.append(name)
    return found, tried


def replay(target, drafter, request: dict, key: str, generate=None):
    """dflash.py's value at key on the request (None if the run never reaches it); generate: a variant."""
    try:
        values = cases.record_reference(target, drafter, request, generate=generate,
                                        stop_at=None if key in cases.WHOLE_RUN else key)[0]
    except cases.Recorded as recorded:
        return recorded.value
    return values.get(key)


# Served requests: mistakes of an engine instance that serves several, one after another or as one batch

def state_carried(case_dir: Path, requests: list[dict], i: int, key: str, own_positions: bool):
    """Request i run after request i − 1 with the drafter's context not cleared: it starts holding the rows
    request i − 1 left, its own rows after them at the positions that continue theirs, or (own_positions) at
    the request's own positions from 0, as an engine that keeps a stale cache but counts each request anew."""
    target, drafter, _ = cases.load_case(case_dir)
    real_empty, made = dflash.DraftContext.empty, []

    def empty(drafter_, device):
        made.append(made[-1] if made else real_empty(drafter_, device))
        return made[-1]
    with mock.patch.object(dflash.DraftContext, "empty", staticmethod(empty)):
        dflash.generate(target, drafter, requests[i - 1]["prompt_ids"], requests[i - 1]["max_new_tokens"],
                        **cases.generate_kwargs(requests[i - 1]))
        stale = made[-1].length if own_positions else 0

        def append_context(drafter_, ctx, c):   # dflash.append_context at the request's own positions
            tables = drafter_.rope_tables(torch.arange(ctx.length - stale, ctx.length - stale + len(c)), c.dtype)
            for l, layer in enumerate(drafter_.layers):
                k, v = layer.context_kv(c, tables)
                ctx.keys[l], ctx.values[l] = torch.cat([ctx.keys[l], k], 1), torch.cat([ctx.values[l], v], 1)

        def draft_block(drafter_, ctx, block_embeds):   # dflash.draft_block likewise, the stale keys at theirs
            positions = torch.arange(ctx.length - stale, ctx.length - stale + len(block_embeds))     # (W,)
            keys = torch.cat([torch.arange(stale), torch.arange(ctx.length - stale), positions])      # (S+W,)
            masks = [dflash.attention_mask(positions, keys, layer.causal, layer.window) for layer in drafter_.layers]
            return drafter_(block_embeds, drafter_.rope_tables(positions, block_embeds.dtype),
                            list(zip(ctx.keys, ctx.values)), masks, block=len(block_embeds))
        with mock.patch.object(dflash, "append_context", append_context), \
                mock.patch.object(dflash, "draft_block", draft_block):
            return replay(target, drafter, requests[i], key)


def acceptance_of_another_row(case_dir: Path, spec: dict, i: int, key: str):
    """Request i in a batch whose rows each commit the next row's acceptance count (row i takes row i + 1's
    a, 0 once that row has ended), the bonus read at that count."""
    target, drafter, _ = cases.load_case(case_dir)
    other = spec["outcomes"][(i + 1) % len(spec["requests"])]["acceptance_lengths"]
    real, rounds = dflash.verify, []

    def verify(drafts, logits, sampling, uniforms, draft_probs=None):
        accepted, token = real(drafts, logits, sampling, uniforms, draft_probs)
        if len(rounds) == 0 and not len(drafts):   # the prefill's
            rounds.append(None)
            return accepted, token
        r = len(rounds)
        rounds.append(r)
        a = min(other[r - 1] - 1 if r - 1 < len(other) else 0, len(drafts))
        return a, int(logits[a].argmax())
    with mock.patch.object(dflash, "verify", verify):
        return replay(target, drafter, spec["requests"][i], key)


SERVED_MISTAKES = {
    "the drafter's context not cleared between requests (the previous request's rows left in, the new rows at "
    "the request's own positions)": lambda case_dir, spec, i, key: i > 0 and state_carried(
        case_dir, spec["requests"], i, key, own_positions=True),
    "the drafter's context not cleared between requests (the previous request's rows left in, the positions "
    "going on after them)": lambda case_dir, spec, i, key: i > 0 and state_carried(
        case_dir, spec["requests"], i, key, own_positions=False),
    "a row's acceptance applied to another row of the batch (row i commits row i + 1's)": acceptance_of_another_row,
}


def served_mistakes(case_dir: Path, spec: dict, first: dict) -> tuple[list, list]:
    """For a served case: the serving mistakes that reproduce its first difference, in request i."""
    i, key, got = int(first["key"].split(".")[1]), first["key"].split(".", 2)[2], first["got"]
    found = []
    for name, run in SERVED_MISTAKES.items():
        if name.startswith("a row's") and spec["requests"][i]["temperature"] > 0:
            continue
        replayed = run(case_dir, spec, i, key)
        if isinstance(replayed, torch.Tensor) and first_difference(
                got.to(replayed.dtype) if replayed.is_floating_point() else got, first["same_order"](replayed),
                first["tolerance"]) is None:
            found.append(name)
    return found + first.get("mistakes", ([], []))[0], list(SERVED_MISTAKES) + first.get("mistakes", ([], []))[1]


# -----------------------------------------------------------------------------
# The report

def report(result: dict) -> str:
    lines = [f"case {result['case']}" + (" (bf16: the case's bf16 bands)" if result["dtype"] == "bfloat16" else "")]
    beyond = [key for key, outcome in result["results"].items() if outcome == "beyond bf16"]
    for key, outcome in result["results"].items():
        if outcome in ("ok", "missing"):
            lines.append(f"  {key:<24} {outcome}")
        elif outcome != "beyond bf16":
            index, got, want = outcome
            what = f"shape {got}, expected {want}" if index == "shape" else f"at {list(index)}: {got!r}, expected {want!r}"
            lines.append(f"  {key:<24} DIFFERS {what}" + (f"; {result['spreads'][key]}" if result["spreads"].get(key) else ""))
    if beyond:
        lines.append(f"  not compared in bf16: {len(beyond)} values from {beyond[0]} on, where the case's choices are "
                     "within bf16's reach (a float32 run checks them)")
    if result["unknown"]:
        lines.append(f"  not in the kit (ignored): {result['unknown']}")
    first = result["first"]
    lines.append(f"compared {result['compared']} of the case's {result['total']} values")
    if not result["compared"]:
        lines.append("nothing compared: the dump holds none of the case's keys ('<stage>.<round>', tokens, "
                     "acceptance_lengths; a served case's under 'request.<i>.')")
    elif first is not None:
        lines.append(f"first difference: {first['key']} ({first['stage']}); usually {first['pitfall']}")
        lines += [f"  {first[part]}" for part in ("note", "spread") if first[part]]
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
    """Whether a dump conforms: something of the drafter's compared (of every request), and nothing differs."""
    return result["first"] is None and result["staged"] > 0


# -----------------------------------------------------------------------------
# This project's twin as a port, and what the field's porting bugs cost

def dump_fastpath(case_dir: Path, dtype=torch.float32, device: str = "cpu") -> dict:
    """fastpath.py's dump of a case through one held Decoder (a served case's requests one after another), its
    steps eager so that every stage is seen: on CUDA its Triton kernels, not its captured graphs."""
    target, drafter, spec = cases.load_case(case_dir, dtype, device)
    requests, dump = spec.get("requests") or [spec["request"]], {}
    K = requests[0]["num_drafts"] or drafter.config.block_size - 1
    kwargs = cases.generate_kwargs(requests[0])
    capacity = max(fastpath.capacity_for(len(r["prompt_ids"]), r["max_new_tokens"], K) for r in requests)
    with closing(fastpath.Decoder(target, drafter, capacity, K, kwargs["full_block"], kwargs["sampling"])) as decoder:
        decoder.graphs = False
        for i, request in enumerate(requests):
            values = cases.record_fastpath(target, drafter, request, decoder)
            dump |= {f"request.{i}.{k}" if "requests" in spec else k: v for k, v in values.items()}
    return dump


FIELD_BUGS = {   # the field's porting bugs, as MISTAKES name them, and the served one run by `costs`
    "hidden state tapped one layer off": "every capture one target layer deeper (HF hidden_states[i + 2])",
    "RoPE from the target's config": "the target's RoPE base for the drafter's (rope_theta read from the target's config)",
    "absolute positions with a clipped window": "positions counted from a clipped window (the block at S − max(0, "
                                                "S − window), the context at its own)",
    "a sliding window not applied": "no sliding window",
    "a padded vocabulary breaking the shared head": "the target's LM head not shared (a padded vocabulary read as "
                                                    "the drafter's own): draft logits from an unset head",
    "state not reset between requests": None,
    "output tokens equal to the mask token stripped": "tokens equal to the mask id dropped from the output, as if padding",
    "a DFlash2 checkpoint run without its selector": "a DFlash2 drafter run without its selector (each row's argmax drafted)",
}


def costs(prompts: list[list[int]], max_new_tokens: int, num_drafts: int, stop_ids) -> dict:
    """τ and the tokens kept on the shipped pair (CPU, float32, greedy) without and with each field bug, the
    prompts one after another; a bug this pair cannot show (no sliding layers, one RoPE base) says so."""
    target_dir, draft_dir = loading.default_pair()
    target = loading.load_target(str(target_dir), torch.float32, "cpu")
    rows = {}
    for bug, name in [("none", None), *FIELD_BUGS.items()]:
        drafter = loading.load_drafter(str(draft_dir), target, torch.float32, "cpu")
        request = {"temperature": 0.0}
        if name is not None and not MISTAKES[name].applies(drafter, target, request):
            rows[bug] = {"applies": False}
            continue
        lengths, kept, written, t0 = [], 0, 0, time.perf_counter()
        with ExitStack() as patches:
            if name is not None:
                for patch in MISTAKES[name].make(drafter, target, request):
                    patches.enter_context(patch)
            carried = []
            if bug == "state not reset between requests":
                real_empty = dflash.DraftContext.empty
                patches.enter_context(mock.patch.object(dflash.DraftContext, "empty", staticmethod(
                    lambda d, device: carried[0] if carried else carried.append(real_empty(d, device)) or carried[0])))
            for ids in prompts:
                gen = dflash.generate(target, drafter, ids, max_new_tokens, num_drafts=num_drafts, stop_ids=stop_ids)
                lengths += gen.acceptance_lengths
                tokens = cases.whole_run_values(gen)["tokens"]
                written, kept = written + len(gen.tokens), kept + len(tokens)
        rows[bug] = {"applies": True, "tau": sum(lengths) / len(lengths), "tokens": written, "tokens_kept": kept,
                     "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{bug}: τ {rows[bug]['tau']:.2f}, {kept} of {written} tokens kept", file=sys.stderr)
    return rows


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
    p.add_argument("--kit", default=str(cases.KIT), help="the kit's dir (default: the cases shipped in the package)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("write", help="write every case from dflash.py")
    s.add_argument("--case", nargs="+", help="these cases only (default: every case)")
    s = sub.add_parser("dump-fastpath", help="run fastpath.py on a case and write its dump")
    s.add_argument("--case", required=True)
    s.add_argument("--out", required=True, help="the dump to write (.safetensors)")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the pair's dtype")
    s.add_argument("--device", default="cpu", help="where it runs, eagerly: cpu, or cuda for fastpath's kernels "
                   "(a sampled case only on the CPU, whose generator draws the kit's uniforms)")
    s.add_argument("--graphs", action="store_true", help="run on CUDA through the captured graphs: a dump of the "
                   "whole run's values (round_drafts, acceptance_lengths, tokens), the stages being inside the graphs")
    s = sub.add_parser("check", help="compare an engine's dump with a case, stage by stage")
    s.add_argument("dump", help="a .safetensors file of '<stage>.<round>' tensors (any subset)")
    s.add_argument("--case", required=True)
    s.add_argument("--dtype", choices=["float32", "bfloat16"], help="what the engine computed in: bfloat16 holds "
                   "float stages to the case's bf16 bands, as far as bf16 cannot move its choices (default: "
                   "bfloat16 where a float value of the dump is bf16 or fp16)")
    s.add_argument("--tolerance", type=float, help="one tolerance for every float stage instead, against the case's "
                   "float32 values")
    s = sub.add_parser("costs", help="τ on the shipped pair (CPU) without and with each of the field's porting bugs")
    s.add_argument("--out", required=True, help="the JSON to write")
    s.add_argument("--prompts", type=int, default=8, help="MT-Bench's first N prompts")
    s.add_argument("--max-new-tokens", type=int, default=128, help="tokens a prompt's answer has at most")
    s.add_argument("--num-drafts", type=int, default=6, help="drafts a round (the CPU default)")
    args = p.parse_args(argv)
    scripts.quiet_transformers()
    torch.set_num_threads(1)   # tiny models: determinism; costs: one thread, which no other process on the machine slows
    dflash.require(not Path(args.kit).exists() or Path(args.kit).is_dir(), f"--kit '{args.kit}' is a file")
    if args.command in ("dump-fastpath", "costs"):   # checked before anything runs
        dflash.require(not Path(args.out).is_dir() and Path(args.out).resolve().parent.is_dir(),
                       f"--out '{args.out}' must name a file in a directory that exists")
    if args.command == "write":
        unknown = sorted(set(args.case or []) - set(cases.CASES))
        dflash.require(not unknown, f"--case: {unknown} are not cases ({', '.join(cases.CASES)})")
        cases.write_kit(Path(args.kit), args.case)
        return print(f"wrote {len(args.case or cases.CASES)} cases to {args.kit}")
    if args.command == "costs":
        scripts.require_at_least(args, 1, "prompts", "max_new_tokens", "num_drafts")
        prompts = loading.read_mtbench()[:args.prompts]
        tokenizer = loading.load_tokenizer(str(loading.default_pair()[0]))
        ids = [loading.encode_chat(tokenizer, text) for text in prompts]
        stops = loading.stop_token_ids(loading.load_target(str(loading.default_pair()[0]), torch.float32, "cpu"),
                                       tokenizer)
        rows = costs(ids, args.max_new_tokens, args.num_drafts, stops)
        result = {"pair": "SmolLM2-135M-Instruct + the shipped DFlash2 drafter", "device": "cpu", "dtype": "float32",
                  "prompts": f"MT-Bench's first {args.prompts}", "max_new_tokens": args.max_new_tokens,
                  "num_drafts": args.num_drafts, "threads": torch.get_num_threads(), "bugs": rows}
        scripts.replace_file(Path(args.out), lambda path: path.write_text(json.dumps(result, indent=1)))
        return print(f"wrote {args.out}")
    directory = case_dir(args.case, Path(args.kit))
    if args.command == "dump-fastpath":
        spec = loading.read_file(directory / "case.json", "conformance case")
        if args.graphs:
            dflash.require("request" in spec, f"--graphs: case {args.case} serves several requests; give another")
            save_file(cases.record_graphed(directory, spec["request"]), args.out)
        else:
            request = (spec.get("requests") or [spec.get("request")])[0]
            dflash.require(args.device == "cpu" or request["temperature"] == 0, f"--device {args.device}: case "
                           f"{args.case} is sampled, and only the CPU generator draws the kit's uniforms")
            device, _ = scripts.device_and_dtype(args.device, args.dtype)
            dump = dump_fastpath(directory, scripts.DTYPES[args.dtype], device)
            save_file({k: v.contiguous() for k, v in dump.items()}, args.out)
        return print(f"wrote {args.out}")
    dflash.require(args.tolerance is None or 0 < args.tolerance < 1, f"--tolerance = {args.tolerance} must be in (0, 1)")
    dump = loading.read_file(Path(args.dump), "dump", load_file)
    result = check(directory, dump, args.tolerance, dtype=args.dtype)
    print(report(result))
    if not verdict(result):
        sys.exit(1)


def command():
    """`dflash-conformance`: main, with bad input as one `error:` line (exit 2) and Ctrl-C as exit 130."""
    scripts.run(main)


if __name__ == "__main__":
    command()
