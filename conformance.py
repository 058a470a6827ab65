"""A conformance kit for DFlash ports: golden values at every stage of a few rounds, written from dflash.py.

Each case in conformance/<case>/ is a tiny float32 checkpoint pair in a released format, a request, and
the values dflash.py computes at every stage of its first rounds:

    target/, drafter/         config.json + model.safetensors (a vocabulary of 8, so drafts are often right)
    case.json                 the request, the stage list with each stage's tolerance and usual pitfall
    expected.safetensors      '<stage>.<round>' tensors, and 'tokens'

A port runs the request on the pair, writes what it computed under the same names (any subset) into one
safetensors file, and the checker reports, stage by stage, the first position and value that differ and
which pitfall that stage usually means:

    $ python conformance.py write                                  # the kit, from dflash.py
    $ python conformance.py dump-fastpath --case laguna --out d.safetensors   # this project's twin
    $ python conformance.py check d.safetensors --case laguna

Rounds: round 0 is the prefill (the prompt's features and context); round r ≥ 1 drafts a block, verifies
it and appends the accepted rows and the bonus's predecessor to the context. Shapes: P prompt, k drafts
verified this round (K, or fewer near max_new_tokens), W block rows (B, or K+1), a accepted drafts.
"""
if __name__ == "__main__":   # a Ctrl-C while torch and transformers import ends as the CLI's own: exit 130
    import signal
    import sys
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))

import json
import sys
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

import checkpoint
import cli
import dflash
import fastpath
import files
import tiny

KIT = Path(__file__).resolve().parent / "conformance"
ROUNDS = 8        # stages are kept for rounds 0..ROUNDS; the tokens for the whole generation
VOCAB, MAX_POS = 8, 128   # every case's vocabulary and positions

# Stages in the order a round computes them: name -> (shape, atol = rtol, the pitfall it usually means).
STAGES = {
    "conv": ("(W, H)", 1e-4, "DFlash2's convolution before layer 0's attention: run over the context rows too, "
             "carrying the last block's rows instead of restarting at the block from zeros, the dynamic taps read "
             "at the source row t − o instead of the output row t, or the halves of base_kernel swapped"),
    "hidden": ("(W, H)", 1e-4, "the drafter's block: a sliding layer run as full attention, no window or a "
               "window on one side only, causal and bidirectional layers mixed up (the causality override), "
               "another layer's RoPE base, the block at the wrong positions, a missing gate, or no final norm"),
    "top5_logits": ("(W-1, 5)", 1e-3, "the LM head over the drafter's rows 1..W-1: the rows read shifted by "
                    "one, or a head other than the target's own"),
    "top5_ids": ("(W-1, 5)", 0, "the LM head over the drafter's rows 1..W-1, read shifted by one"),
    "candidates": ("(k, top_k)", 0, "DFlash2's candidates, each row's top_k draft logits (after "
                   "output_multiplier and softcapping; compared as sets): the rows read shifted by one"),
    "selector_scores": ("(k, top_k)", 1e-4, "DFlash2's walk: the codebooks read at the wrong rows (a key stored "
                        "without '.weight' missed at load, so left at their init), the walk seeded with another "
                        "token than the bonus, the pair term with the wrong predecessor, or no hidden_projection"),
    "drafts": ("(k,)", 0, "the readout shifted by one: drafts from rows 0..W-2 instead of 1..W-1 (next-token "
               "labels, or anchor-first rows read as same-position), or more drafts than max_new_tokens allows"),
    "uniforms": ("(K+1,)", 0, "the sampling uniforms: draw the kit's to reproduce a sampled case"),
    "features": ("(P or k+1, n·H)", 1e-4, "the captured target layers: a wrong layer index (one layer off), "
                 "the output after the final norm, or HF hidden_states[i] instead of [i + 1]"),
    "accepted": ("()", 0, "verification: the comparison with the target's choice, or the rejection rule"),
    "context": ("(P or a+1, H)", 1e-4, "the projected context: a missing hidden_norm after fc, a missing Laguna "
                "per-capture norm (aux_hidden_norms), or the wrong rows appended: the bonus token's hidden state "
                "put into the context too early (a row past the accepted drafts), or rejected rows kept"),
    "ctx_keys": ("(hk, S, d)", 1e-4, "layer 0's context keys: no input norm on the context before k/v "
                 "(Laguna), a missing k_norm, or RoPE at the wrong context positions"),
    "ctx_values": ("(hk, S, d)", 1e-4, "layer 0's context values: no input norm on the context (Laguna)"),
}
TOKENS_PITFALL = "the commit: the bonus token, stop handling, or trimming at max_new_tokens"
ACCEPTANCE_PITFALL = ("verification in the rounds past the recorded ones: the comparison with the target's "
                      "choice, the rejection rule, or the number of drafts near max_new_tokens")
WHOLE_RUN = ("acceptance_lengths", "tokens")   # values of the whole generation, checked after the rounds' stages

CASES = {
    "zlab-qwen3": dict(
        about="z-lab DFlashDraftModel (Qwen3-8B-DFlash-b16 layout): top-level block_size, full bidirectional "
              "attention, a Qwen3 target", target="qwen3", fmt="zlab", block_size=8, layers=2,
        layer_ids=[1, 3, 4], prompt_len=6, max_new_tokens=24),
    "zlab-new-window": dict(
        about="the newer z-lab layout (dflash_config.block_size, rope_parameters, sliding and full layers, "
              "window 6) with a context long enough that the window bites, a Llama target",
        target="llama", fmt="zlab-new", block_size=8, layers=3, window=6, layer_ids=[1, 4], prompt_len=10,
        max_new_tokens=24),
    "laguna": dict(
        about="poolside Laguna: fused qkv_proj, softplus per-head gate, per-capture norms, causal sliding "
              "layers (window 6), input norm on the context, a Laguna (MoE, hybrid) target",
        target="laguna", fmt="laguna", block_size=8, layers=2, window=6, layer_ids=[0, 2, 5], prompt_len=9,
        max_new_tokens=24),
    "k3-block-width": dict(
        about="K = 3 < B - 1 = 7, the drafter computing all B rows (z-lab)", target="qwen3", fmt="zlab",
        block_size=8, layers=2, layer_ids=[1, 3, 4], prompt_len=5, max_new_tokens=20, num_drafts=3),
    "k3-drafts-width": dict(
        about="K = 3 < B - 1 = 7, the drafter computing K+1 rows", target="qwen3", fmt="zlab", block_size=8,
        layers=2, layer_ids=[1, 3, 4], prompt_len=5, max_new_tokens=20, num_drafts=3, full_block=False),
    "sampled": dict(
        about="sampled at T 0.8, top-p 0.8, top-k 5, from a target whose LM head is not scaled up, so that "
              "its distributions are wide: the stored uniforms decide the accepts and draws, and the output "
              "is not its greedy decode",
        target="qwen3", fmt="zlab", block_size=8, layers=2, layer_ids=[1, 3, 4], prompt_len=6,
        max_new_tokens=24, temperature=0.8, top_p=0.8, top_k=5, seed=11, head_scale=1.0),
    "zlab-new-bidirectional": dict(
        about="the newer z-lab layout with dflash_config.causal false, so that its sliding layers see their "
              "window (6) on both sides, RoPE bases keyed by layer type (sliding 1e4, full 1e7), and no "
              "target_layer_ids (the default ids for 2 features); a Llama target",
        target="llama", fmt="zlab-new", block_size=8, layers=3, window=6, layer_ids=None, num_features=2,
        prompt_len=10, max_new_tokens=24, causal=False, rope_by_type={"sliding_attention": 1e4,
                                                                      "full_attention": 1e7}),
    "dflash2": dict(
        about="z-lab DFlash2DraftModel: a convolution around each sublayer over the block's rows, the candidate "
              "selector's walk from the bonus, every layer sliding (window 6) and bidirectional (top-level "
              "is_causal false); a Qwen3 target", target="qwen3", fmt="dflash2", block_size=8, layers=2, window=6,
        layer_ids=[1, 3, 4], prompt_len=10, max_new_tokens=24),
}


# -----------------------------------------------------------------------------
# The checkpoint pair of a case, from seeded draws (byte-identical wherever torch's CPU generator is)

def write_pair(directory: Path, case: dict, seed: int):
    """The case's target and drafter, as tiny.py writes them: a vocabulary of 8, 128 positions."""
    tiny.write_target(directory / "target", case["target"], seed, VOCAB, MAX_POS, case.get("head_scale", 4.0))
    raw = tiny.drafter_config(case["fmt"], case["block_size"], case["layer_ids"], VOCAB, case["layers"],
                              case.get("window", 4), causal=case.get("causal"), rope_by_type=case.get("rope_by_type"))
    tiny.write_drafter(directory / "drafter", raw, seed + 1, case.get("num_features") or len(case["layer_ids"]))


# -----------------------------------------------------------------------------
# Recording the stages of a generation

class Recorder:
    """'<stage>.<round>' -> tensor, for rounds 0..ROUNDS; `calls` counts target passes (round = calls - 1)."""

    def __init__(self):
        self.values, self.calls, self.target_margin = {}, 0, float("inf")
        self.last_hidden = None        # the drafter's block output, until its propose records the readout
        self.features = []             # fastpath: target passes since the last verify
        self.prefill_context = None    # fastpath: the prefill's context rows so far (it appends in chunks)
        self.accepted = 0              # fastpath: the last verify's accepted count

    def put(self, stage: str, r: int, value):
        if r <= ROUNDS:
            self.values[f"{stage}.{r}"] = torch.as_tensor(value).detach().to("cpu").clone()

    def put_readout(self, r: int, hidden, target, drafter):
        self.put("hidden", r, hidden)
        top = drafter.draft_logits(hidden[1:], target.get_output_embeddings()).topk(5, dim=-1)   # (W-1, 5) each
        self.put("top5_logits", r, top.values)
        self.put("top5_ids", r, top.indices)

    def drafter_parts(self, r_now):
        """Patches that record DFlash2's stages as either file runs them: the first convolution of a round
        (layer 0's, before its attention) and the selector's candidates and scores, by candidate id."""
        real_convolve, real_select, real_scores, scores = dflash.convolve, dflash.CandidateSelector.forward, \
            dflash.CandidateSelector.scores, []

        def convolve(x, taps, base, block):
            out = real_convolve(x, taps, base, block)
            if f"conv.{r_now()}" not in self.values:
                self.put("conv", r_now(), out)
            return out

        def select(selector, hidden, logits, anchor, temperature, uniforms):
            scores.clear()
            drafts, candidates, q = real_select(selector, hidden, logits, anchor, temperature, uniforms)
            order = candidates.argsort(-1)                                              # (k, top_k) by id
            self.put("candidates", r_now(), candidates.gather(-1, order))
            self.put("selector_scores", r_now(), torch.stack(scores).gather(-1, order))
            return drafts, candidates, q

        def score(selector, *args):
            scores.append(real_scores(selector, *args))
            return scores[-1]
        return [mock.patch.object(dflash, "convolve", convolve),
                mock.patch.object(dflash.CandidateSelector, "forward", select),
                mock.patch.object(dflash.CandidateSelector, "scores", score)]


def record_reference(target, drafter, request: dict, generate=None):
    """dflash.generate on the request, every stage recorded by wrapping the functions it calls (the math
    itself is untouched). `generate` swaps in a variant (the tests' broken ports). -> the values, the
    Generation, and the Recorder (its target_margin: the least top-2 logit gap of the target's rows)."""
    rec, d = Recorder(), dflash
    real = {name: getattr(d, name) for name in ("target_forward", "propose", "draft_block", "verify",
                                                "append_context")}
    real_project = d.Drafter.project_context

    def target_forward(*args):
        logits, features = real["target_forward"](*args)
        top2 = logits.topk(2, dim=-1).values                                            # (N, 2)
        rec.target_margin = min(rec.target_margin, float((top2[:, 0] - top2[:, 1]).min()))
        rec.put("features", rec.calls, features)
        rec.calls += 1
        return logits, features

    def draft_block(drafter_, ctx, block_embeds):
        rec.last_hidden = real["draft_block"](drafter_, ctx, block_embeds)
        return rec.last_hidden

    def propose(drafter_, ctx, block, target_, count, sampling, uniforms):
        drafts, q = real["propose"](drafter_, ctx, block, target_, count, sampling, uniforms)
        rec.put_readout(rec.calls, rec.last_hidden, target_, drafter_)
        return drafts, q

    def verify(drafts, logits, sampling, uniforms, draft_probs=None):
        accepted, token = real["verify"](drafts, logits, sampling, uniforms, draft_probs)
        r = rec.calls - 1
        if sampling.temperature > 0:   # greedy rounds draw nothing
            rec.put("uniforms", r, uniforms)
        if r > 0:
            rec.put("drafts", r, drafts)
            rec.put("accepted", r, torch.tensor(accepted))
        return accepted, token

    def project_context(self, features):
        c = real_project(self, features)
        rec.put("context", rec.calls - 1, c)
        return c

    def append_context(drafter_, ctx, c):
        real["append_context"](drafter_, ctx, c)
        rec.put("ctx_keys", rec.calls - 1, ctx.keys[0])
        rec.put("ctx_values", rec.calls - 1, ctx.values[0])

    with ExitStack() as patches:
        for name, fn in [("target_forward", target_forward), ("propose", propose), ("draft_block", draft_block),
                         ("verify", verify), ("append_context", append_context)]:
            patches.enter_context(mock.patch.object(d, name, fn))
        patches.enter_context(mock.patch.object(d.Drafter, "project_context", project_context))
        for patch in rec.drafter_parts(lambda: rec.calls):
            patches.enter_context(patch)
        gen = (generate or d.generate)(target, drafter, request["prompt_ids"], request["max_new_tokens"],
                                       **generate_kwargs(request))
    return rec.values | whole_run_values(gen), gen, rec


def record_fastpath(target, drafter, request: dict) -> dict:
    """fastpath.generate (eager, on CPU) on the request, its stages recorded as the reference's are. It
    verifies K+1 rows and writes K+1 context rows every round; the rows past the accepted ones, which its
    masks hide and the next round overwrites, are left out."""
    rec, f = Recorder(), fastpath
    real = {name: getattr(f, name) for name in ("propose", "draft_block", "verify", "append_context")}
    real_forward = {cls: cls.forward for cls in (f.DenseTarget, f.ModelTarget)}

    def forward_of(cls):
        def forward(self, ids, positions):
            logits, features = real_forward[cls](self, ids, positions)
            rec.features.append(features)
            return logits, features
        return forward

    def draft_block(drafter_, buf, block_embeds):
        rec.last_hidden = real["draft_block"](drafter_, buf, block_embeds)
        return rec.last_hidden

    def propose(drafter_, buf, block, target_, count, sampling, uniforms):
        drafts, q = real["propose"](drafter_, buf, block, target_, count, sampling, uniforms)
        k = int(buf.max_accept)
        if k > 0:   # the reference drafts only where a draft can be verified, and walks only its k rows
            rec.put_readout(rec.calls, rec.last_hidden, target_, drafter_.module)
            for stage in ("candidates", "selector_scores"):
                if f"{stage}.{rec.calls}" in rec.values:
                    rec.values[f"{stage}.{rec.calls}"] = rec.values[f"{stage}.{rec.calls}"][:k]
        else:                         # so its stages of this round are not the reference's
            for stage in ("conv", "candidates", "selector_scores"):
                rec.values.pop(f"{stage}.{rec.calls}", None)
        return drafts, q

    def verify(drafts, logits, sampling, uniforms, max_accept, draft_probs=None):
        accepted, token = real["verify"](drafts, logits, sampling, uniforms, max_accept, draft_probs)
        k, r = int(max_accept), rec.calls   # calls counts verifications here, the prefill's first
        rec.put("features", r, torch.cat(rec.features) if r == 0 else rec.features[-1][:k + 1])
        if r > 0:
            rec.put("drafts", r, drafts[:k])
            rec.put("accepted", r, torch.tensor(int(accepted)))
        if sampling.temperature > 0:
            rec.put("uniforms", r, uniforms)
        rec.accepted, rec.features = int(accepted), []
        rec.calls += 1
        return accepted, token

    def append_context(drafter_, buf, c, positions):
        real["append_context"](drafter_, buf, c, positions)
        if rec.calls == 0:   # prefill chunks, appended before the prefill's verify
            r = 0
            rec.prefill_context = c if rec.prefill_context is None else torch.cat([rec.prefill_context, c])
            rows, length = rec.prefill_context, int(positions[-1]) + 1
        else:                # after a round's verify: the accepted drafts' rows and the bonus's
            r = rec.calls - 1
            rows, length = c[:rec.accepted + 1], int(positions[0]) + rec.accepted + 1
        rec.put("context", r, rows)
        rec.put("ctx_keys", r, buf.ctx_keys[0][:, :length])
        rec.put("ctx_values", r, buf.ctx_values[0][:, :length])

    with ExitStack() as patches:
        for name, fn in [("propose", propose), ("draft_block", draft_block), ("verify", verify),
                         ("append_context", append_context)]:
            patches.enter_context(mock.patch.object(f, name, fn))
        for cls in real_forward:
            patches.enter_context(mock.patch.object(cls, "forward", forward_of(cls)))
        for patch in rec.drafter_parts(lambda: rec.calls):
            patches.enter_context(patch)
        gen = f.generate(target, drafter, request["prompt_ids"], request["max_new_tokens"],
                         **generate_kwargs(request))
    return rec.values | whole_run_values(gen)


def whole_run_values(gen) -> dict:
    """The WHOLE_RUN values of a Generation, as a dump holds them."""
    return {"acceptance_lengths": torch.tensor(gen.acceptance_lengths), "tokens": torch.tensor(gen.tokens)}


def generate_kwargs(request: dict) -> dict:
    # a case made before drafts could be drawn proposes the argmax, as its request does not say
    sampling = dflash.Sampling(request["temperature"], request["top_p"], request["top_k"],
                               request.get("drafts", "argmax"))
    return dict(num_drafts=request["num_drafts"], full_block=request["full_block"], sampling=sampling,
                seed=request["seed"])


# -----------------------------------------------------------------------------
# Writing the kit

def request_of(name: str, case: dict) -> dict:
    g = torch.Generator().manual_seed(len(name))
    return {"prompt_ids": torch.randint(0, VOCAB - 1, (case["prompt_len"],), generator=g).tolist(),
            "max_new_tokens": case["max_new_tokens"], "num_drafts": case.get("num_drafts"),
            "full_block": case.get("full_block", True), "temperature": case.get("temperature", 0.0),
            "top_p": case.get("top_p", 1.0), "top_k": case.get("top_k", 0), "seed": case.get("seed", 0)}


def load_case(case_dir: Path):
    """The pair (float32, CPU) and the request of a kit case."""
    case_dir = Path(case_dir)
    spec = checkpoint.read_file(case_dir / "case.json", "conformance case")
    target = checkpoint.load_target(str(case_dir / "target"), torch.float32, "cpu")
    drafter = checkpoint.load_drafter(str(case_dir / "drafter"), target, torch.float32, "cpu")
    return target, drafter, spec


MARGIN = 1e-2   # the least gap between the two largest logits of any row a case's tokens depend on


def margin(values: dict, target_margin: float) -> float:
    """The smallest top-2 logit gap over the target's rows and the recorded draft rows."""
    draft = [float((top[:, 0] - top[:, 1]).min()) for key, top in values.items() if key.startswith("top5_logits.")]
    return min([target_margin] + draft)


CASE_FILES = {"target", "drafter", "case.json", "expected.safetensors"}


def write_case(root: Path, name: str, case: dict, seed: int):
    """fill_case into a dir beside the case's, then moved into place: an interrupted write leaves the old
    case whole, never a new seed's model beside the old case.json."""
    directory = Path(root) / name
    if directory.exists() or directory.is_symlink():   # replaced whole: it must hold nothing but a case
        dflash.require(directory.is_dir(), f"conformance: {directory} is a file, not a case's dir")
        others = files.foreign_names(directory, CASE_FILES)
        dflash.require(not others, f"conformance: {directory} holds files a case does not ({', '.join(others)}); "
                       "move them or give another --kit")
    files.replace_dir(directory, lambda partial: fill_case(partial, name, case, seed))


def fill_case(directory: Path, name: str, case: dict, seed: int):
    """A case's pair from the first seed (seed, seed + 2, ...) whose greedy choices all win by MARGIN, so
    that a port's float32 rounding cannot flip a token and whose output holds two tokens at least, or,
    sampled, whose output is not its greedy decode and holds at least 4 different tokens, so that the draws
    are not forced; and whose recorded rounds accept a draft, so that acceptance and a multi-row context
    append are checked; its request; dflash.py's values at every stage."""
    request = request_of(name, case)
    for seed in range(seed, seed + 40, 2):
        write_pair(directory, case, seed)
        target = checkpoint.load_target(str(directory / "target"), torch.float32, "cpu")
        drafter = checkpoint.load_drafter(str(directory / "drafter"), target, torch.float32, "cpu")
        values, gen, recorder = record_reference(target, drafter, request)
        if request["temperature"] > 0:
            greedy = dflash.generate(target, drafter, request["prompt_ids"], request["max_new_tokens"]).tokens
            clear = gen.tokens != greedy and len(set(gen.tokens)) >= 4
        else:   # and not one token over and over, which a verifier that compares wrongly can still match
            clear = margin(values, recorder.target_margin) >= MARGIN and len(set(gen.tokens)) >= 2
        if clear and any(int(v) > 0 for k, v in values.items() if k.startswith("accepted.")):
            break
    else:
        raise ValueError(f"conformance: no seed gives case {name} clear argmaxes and an accepted draft")
    spec = {"case": name, "about": case["about"], "seed": seed, "request": request, "rounds_recorded": ROUNDS,
            "stages": {stage: {"shape": shape, "tolerance": tol, "pitfall": pitfall}
                       for stage, (shape, tol, pitfall) in STAGES.items()},
            "tokens": {"shape": "(T,)", "tolerance": 0, "pitfall": TOKENS_PITFALL},
            "tau": gen.tau, "acceptance_lengths": gen.acceptance_lengths}
    (directory / "case.json").write_text(json.dumps(spec, indent=1))
    staged = {k: v for k, v in values.items() if k != "acceptance_lengths"}   # case.json holds them
    save_file(staged, directory / "expected.safetensors", metadata={"format": "pt"})


def write_kit(root: Path = KIT):
    for i, (name, case) in enumerate(CASES.items()):
        write_case(root, name, case, seed=100 * (i + 1))


# -----------------------------------------------------------------------------
# Checking a dump

def stage_order(keys) -> list[str]:
    """The keys in the order a decode computes them: by round, then by stage; the whole run's last."""
    order = list(STAGES)
    staged = sorted((k for k in keys if k not in WHOLE_RUN),
                    key=lambda k: (int(k.rsplit(".", 1)[1]), order.index(k.rsplit(".", 1)[0])))
    return staged + [k for k in WHOLE_RUN if k in keys]


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


def check(case_dir: Path, dump: dict, tolerance: float | None = None) -> dict:
    """Compare a dump with a case: per key 'ok', 'missing' or the first difference; the first stage that
    differs, its pitfall and a note on where it points. `tolerance` replaces the case's tolerance of every
    float stage (an engine in bf16 needs about 3e-2): |got − want| ≤ tolerance · (1 + |want|), the case's
    float32 values the reference; exact stages stay exact."""
    case_dir = Path(case_dir)
    spec = checkpoint.read_file(case_dir / "case.json", "conformance case")
    expected = load_file(case_dir / "expected.safetensors") | {
        "acceptance_lengths": torch.tensor(spec["acceptance_lengths"])}
    whole_run = {"tokens": spec["tokens"], "acceptance_lengths": {"tolerance": 0, "pitfall": ACCEPTANCE_PITFALL}}
    unknown = sorted(set(dump) - set(expected))
    results, first = {}, None
    for key in stage_order(expected):
        stage = key if key in WHOLE_RUN else key.rsplit(".", 1)[0]
        info = whole_run[key] if key in WHOLE_RUN else spec["stages"][stage]
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
        if stage == "acceptance_lengths" and got.shape != want.shape:   # the first round where they part
            n = min(len(got), len(want))
            part = next((i for i in range(n) if got[i] != want[i]), n)
            diff = ((part,), got[part].item() if part < len(got) else "none", want[part].item() if part < len(want)
                    else "none")
        else:
            diff = first_difference(got, want, tol)
        results[key] = "ok" if diff is None else diff
        if diff is not None and first is None:
            first = {"key": key, "stage": stage, "difference": diff, "pitfall": info["pitfall"],
                     "note": where_it_points(case_dir, stage, diff, want)}
    compared = [key for key, outcome in results.items() if outcome != "missing"]
    return {"case": spec["case"], "results": results, "first": first, "unknown": unknown, "compared": len(compared),
            "staged": sum(key not in WHOLE_RUN for key in compared), "total": len(results)}


def where_it_points(case_dir: Path, stage: str, diff, want) -> str | None:
    """For a features column: which capture and target layer it holds; for a round: which one."""
    index = diff[0]
    if stage == "features" and index != "shape" and len(index) == 2:
        raw = checkpoint.read_file(case_dir / "drafter" / "config.json", "drafter config")
        layers = checkpoint.read_file(case_dir / "target" / "config.json", "target config")["num_hidden_layers"]
        cfg = checkpoint.load_draft_config(raw, layers, want.shape[-1])
        j = index[1] // cfg.hidden_size
        layer = cfg.target_layer_ids[j]
        return (f"column {index[1]} is capture {j} of {len(cfg.target_layer_ids)}: the output of target layer "
                f"{layer} (0-based; HF hidden_states[{layer + 1}]), row {index[0]} its position")
    if stage == "acceptance_lengths" and index != "shape":
        return f"round {index[0] + 1} is the first whose acceptance length differs"
    return None


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
    elif not result["staged"]:
        lines.append("no verdict: only tokens and acceptance_lengths were compared, and the target's verification "
                     "keeps the tokens right whatever a drafter bug drafts; dump the stages ('<stage>.<round>')")
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
    p = cli.parser("DFlash conformance kit: golden stage values and a checker.")
    p.add_argument("--kit", default=str(KIT), help="the kit's dir (default: conformance/ beside this file)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("write", help="write every case from dflash.py")
    s = sub.add_parser("dump-fastpath", help="run fastpath.py on a case and write its dump")
    s.add_argument("--case", required=True)
    s.add_argument("--out", required=True, help="the dump to write (.safetensors)")
    s = sub.add_parser("check", help="compare an engine's dump with a case, stage by stage")
    s.add_argument("dump", help="a .safetensors file of '<stage>.<round>' tensors (any subset)")
    s.add_argument("--case", required=True)
    s.add_argument("--tolerance", type=float, help="one tolerance for every float stage, against the case's float32 "
                   "values (about 3e-2 for an engine in bf16; default: each stage's own, for float32)")
    args = p.parse_args(argv)
    cli.quiet_transformers()
    torch.set_num_threads(1)   # tiny models: determinism over speed
    dflash.require(not Path(args.kit).exists() or Path(args.kit).is_dir(), f"--kit '{args.kit}' is a file")
    if args.command == "dump-fastpath":   # checked before fastpath runs
        dflash.require(not Path(args.out).is_dir() and Path(args.out).resolve().parent.is_dir(),
                       f"--out '{args.out}' must name a file in a directory that exists")
    if args.command == "write":
        write_kit(Path(args.kit))
        return print(f"wrote {len(CASES)} cases to {args.kit}")
    directory = case_dir(args.case, Path(args.kit))
    if args.command == "dump-fastpath":
        target, drafter, spec = load_case(directory)
        save_file(record_fastpath(target, drafter, spec["request"]), args.out)
        return print(f"wrote {args.out}")
    dflash.require(args.tolerance is None or 0 < args.tolerance < 1, f"--tolerance = {args.tolerance} must be in (0, 1)")
    dump = checkpoint.read_file(Path(args.dump), "dump", load_file)
    result = check(directory, dump, args.tolerance)
    print(report(result))
    if not verdict(result):
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)
